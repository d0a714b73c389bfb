"""A request body -> a JSON object, every limit checked before the expensive step it guards: the
media type before reading, the size while reading (aiohttp's client_max_size), the decoded size while
inflating (a gzip bomb stops at the limit), the nesting depth by the JSON parser's own recursion limit
and one linear walk of the parsed value. Every problem is an OpenAI-style 4xx (errors.py)."""
from __future__ import annotations

import asyncio
import json
import zlib
from typing import Any

from aiohttp import web

from tallow.server.errors import APIError, bad_request
from tallow.server.keys import STATE

MAX_JSON_DEPTH = 256  # OpenAI request bodies nest a few levels; what reads them later may recurse per level
# media types a JSON endpoint reads as JSON: curl -d sends x-www-form-urlencoded and some clients text/plain
# without meaning it (vLLM accepts them too); anything else (multipart, octet-stream, ...) is a 415
_TEXT_TYPES = ("text/plain", "application/x-www-form-urlencoded")
# zlib's wbits: 16+ reads a gzip header, a negative value raw deflate; deflate is zlib-wrapped by the RFC but
# some clients send it raw, so deflate tries the wrapper first
_GZIP = (16 + zlib.MAX_WBITS,)
_WBITS = {"gzip": _GZIP, "x-gzip": _GZIP, "deflate": (zlib.MAX_WBITS, -zlib.MAX_WBITS)}
OFF_LOOP_BYTES = 256 * 1024  # larger bodies are inflated, parsed and walked in a worker thread


def _too_large(limit: int) -> APIError:
    return APIError(f"the request body is too large (limit {limit} bytes)", 413, code="request_too_large")


def check_content_type(request: web.Request) -> None:
    raw = request.headers.get("Content-Type")
    if raw is None or not raw.strip():
        return
    mime = request.content_type.lower()  # without parameters such as charset
    if mime.endswith("/json") or mime.endswith("+json") or mime in _TEXT_TYPES:
        return
    raise APIError(f"unsupported Content-Type {raw[:100]!r}: send the body as application/json", 415,
                   code="unsupported_media_type")


def _encodings(request: web.Request) -> list[str]:
    """The Content-Encoding codings in the order they were applied (identity dropped); 415 for any
    other than gzip and deflate."""
    codings = [c.strip().lower() for c in request.headers.get("Content-Encoding", "").split(",")]
    codings = [c for c in codings if c and c != "identity"]
    for c in codings:
        if c not in _WBITS:
            raise APIError(f"unsupported Content-Encoding {c[:40]!r}: send the body uncompressed, gzip or deflate",
                           415, code="unsupported_encoding")
    if len(codings) > 2:
        raise APIError("at most two Content-Encodings are accepted", 415, code="unsupported_encoding")
    return codings


def _inflate(data: bytes, coding: str, limit: int) -> bytes:
    """data decoded by one coding, never producing more than limit + 1 bytes (a bomb stops there)."""
    error = None
    for wbits in _WBITS[coding]:
        d = zlib.decompressobj(wbits)
        try:
            out = d.decompress(data, limit + 1)
        except zlib.error as e:
            error = str(e)
            continue
        if len(out) > limit:
            raise _too_large(limit)
        if not d.eof or d.unconsumed_tail:
            error = "the compressed stream is truncated"
            continue
        return out
    raise APIError(f"the request body is not valid {coding} data ({error}); check Content-Encoding", 400,
                   code="invalid_encoding")


def _check_tree(obj: Any) -> None:
    """One walk of the parsed value: depth at most MAX_JSON_DEPTH and no lone UTF-16 surrogate
    escapes (\\ud800 is valid JSON but not text)."""
    stack = [(obj, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    raise bad_request("the request contains a lone UTF-16 surrogate escape (e.g. \\ud800), "
                                      "which is not valid text") from None
        elif isinstance(v, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise bad_request(f"the request body is nested too deeply (more than {MAX_JSON_DEPTH} levels)")
            if isinstance(v, dict):
                stack.extend((k, depth) for k in v)
                v = v.values()
            stack.extend((x, depth + 1) for x in v if isinstance(x, (str, dict, list)))


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def json_type(v: Any) -> str:
    """How an error message names a JSON value's type."""
    return {type(None): "null", bool: "a boolean", int: "a number", float: "a number", str: "a string",
            list: "an array"}.get(type(v), "an object")


def parse_body(raw: bytes, codings: list[str], limit: int) -> dict:
    """Bytes as sent -> the request's JSON object (the CPU-heavy part of read_json; any thread)."""
    for coding in reversed(codings):
        raw = _inflate(raw, coding, limit)
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8 (byte {e.start})") from None
    error = None
    try:  # linear; deep nesting stops at the interpreter's recursion limit (about 1000 levels)
        body = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        error = f"the request body is nested too deeply (more than {MAX_JSON_DEPTH} levels)"
    except ValueError as e:  # bad syntax, NaN/Infinity, integers over Python's digit limit
        error = f"the request body is not valid JSON: {str(e)[:200]}"
    if error is not None:  # raised outside the handler: the parser's exception is not kept as context
        raise bad_request(error)
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {json_type(body)}")
    _check_tree(body)
    return body


async def read_json(request: web.Request) -> dict:
    """The body of a JSON endpoint as a dict; an APIError (400, 413 or 415) for anything else."""
    check_content_type(request)
    codings = _encodings(request)
    limit = request.app[STATE].config.max_body_bytes
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(limit) from None
    except Exception as e:  # noqa: BLE001 - aiohttp's payload errors (a bad chunk, an encoding it decoded itself)
        raise bad_request(f"the request body could not be read: {str(e).strip()[:200]}") from None
    if getattr(request.content, "total_compressed_bytes", None) is not None:
        codings = []  # a runner with auto_decompress on already inflated it (within client_max_size)
    if len(raw) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(parse_body, raw, codings, limit)
    return parse_body(raw, codings, limit)
