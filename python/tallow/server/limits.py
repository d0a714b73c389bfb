"""Request limits checked before the work they guard.

Prompt length: no token covers more than ``max_piece_chars`` characters of text, so a text's length
alone proves some prompts too long before a tokenizer runs; the rest are tokenized on the event loop
when short and in a worker thread (tokenizers' batch call, which releases the GIL) when long.
Sequences: a request holds prompts × n seats against ``--max-pending-requests`` from before it is
queued until its handler ends (``Seats``)."""
from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from tallow.server.errors import APIError, bad_request

# characters per token when the tokenizer cannot promise that every character lands in some piece (a
# word-level or WordPiece model maps a whole unknown word to one token, and some drop whitespace): generous,
# so that it bounds the work and refuses only texts averaging over 1024 characters per token
FALLBACK_PIECE_CHARS = 1024
# NFC/NFKC compose a base character and its marks (or a Hangul syllable's jamo) into one: up to 3 to 1
_COMPOSING_FACTOR = 4
OFF_LOOP_CHARS = 16 * 1024  # shorter texts tokenize in a few milliseconds at most: not worth a thread hop

_SAFE_NORMALIZERS = {"Sequence", "NFC", "NFD", "NFKC", "NFKD", "Prepend", "Replace", "Lowercase"}
_SAFE_PRE_TOKENIZERS = {"Sequence", "ByteLevel", "Metaspace", "Digits", "Punctuation", "Split", "UnicodeScripts"}


def _nodes(spec: Any):
    """Every component of a tokenizer.json normalizer / pre-tokenizer (Sequences opened)."""
    if not isinstance(spec, dict):
        return
    yield spec
    for child in spec.get("normalizers") or spec.get("pretokenizers") or ():
        yield from _nodes(child)


def _component(obj) -> Any:
    """A tokenizers normalizer / pre-tokenizer as its tokenizer.json dict (None when absent)."""
    return None if obj is None else json.loads(obj.__getstate__())


def _keeps_every_character(backend) -> tuple[bool, bool]:
    """(every input character ends up in some piece, a normalizer may compose characters) for a
    ``tokenizers.Tokenizer``: byte-level or byte-fallback BPE / Unigram with normalizers and pre-tokenizers
    that neither drop nor collapse characters."""
    normalizers = list(_nodes(_component(backend.normalizer)))
    pre = list(_nodes(_component(backend.pre_tokenizer)))
    byte_level = any(n.get("type") == "ByteLevel" for n in pre)
    model = type(backend.model).__name__
    if not (model in ("BPE", "Unigram") and (byte_level or getattr(backend.model, "byte_fallback", False))):
        return False, False
    for n in normalizers:
        if n.get("type") not in _SAFE_NORMALIZERS:
            return False, False
        if n.get("type") == "Replace" and ("String" not in (n.get("pattern") or {}) or not n.get("content")):
            return False, False  # a regex may collapse runs; an empty replacement deletes
    for n in pre:
        if n.get("type") not in _SAFE_PRE_TOKENIZERS or str(n.get("behavior", "")).lower() == "removed":
            return False, False
    return True, any(n.get("type") in ("NFC", "NFKC") for n in normalizers)


def max_piece_chars(tokenizer) -> int:
    """An upper bound on the characters of text one token covers (computed once per server)."""
    try:
        keeps, composes = _keeps_every_character(tokenizer.backend_tokenizer)
        longest = max(map(len, tokenizer.get_vocab()), default=0) if keeps else 0
    except Exception:  # noqa: BLE001 - not a tokenizers-backed tokenizer: it cannot tell
        return FALLBACK_PIECE_CHARS
    if longest <= 0:
        return FALLBACK_PIECE_CHARS
    return longest * (_COMPOSING_FACTOR if composes else 1)


# -- prompt length -------------------------------------------------------------------------------
def too_long(limit: int, n_tokens: int, param: str, *, generate: bool, n_chars: int = 0) -> APIError:
    """limit: the model's context; generate: the prompt must leave room for one generated token."""
    has = f"at least {n_tokens} tokens ({n_chars} characters)" if n_chars else f"{n_tokens} tokens"
    if generate:
        msg = (f"this model's maximum context length is {limit} tokens, and the prompt has {has}, leaving no room "
               "for a completion; shorten it")
    else:
        msg = f"the input has {has}; this model's maximum context length is {limit} tokens"
    return bad_request(msg, param, "context_length_exceeded")


def _fits(n_tokens: int, limit: int, generate: bool) -> bool:
    return n_tokens < limit if generate else n_tokens <= limit


def check_chars(st, n_chars: int, param: str, *, generate: bool, limit: int = 0) -> None:
    """Refuse a text whose character count alone proves it has too many tokens."""
    limit = limit or st.max_model_len
    at_least = math.ceil(n_chars / st.max_piece_chars)
    if not _fits(at_least, limit, generate):
        raise too_long(limit, at_least, param, generate=generate, n_chars=n_chars)


def check_tokens(st, n_tokens: int, param: str, *, generate: bool, limit: int = 0) -> None:
    limit = limit or st.max_model_len
    if not _fits(n_tokens, limit, generate):
        raise too_long(limit, n_tokens, param, generate=generate)


async def encode_all(st, texts: list[str], param: str, *, generate: bool,
                     add_special_tokens: bool = True) -> list[list[int]]:
    """texts -> token ids, each checked against the context before (by characters) and after tokenizing;
    when they are long together they are tokenized in a worker thread so the event loop keeps answering."""
    for text in texts:
        check_chars(st, len(text), param, generate=generate)
    tok = st.tokenizer
    if sum(map(len, texts)) <= OFF_LOOP_CHARS:
        ids = [tok.encode(t, add_special_tokens=add_special_tokens) for t in texts]
    elif hasattr(tok, "encode_batch"):  # tokenizers releases the GIL in its batch call, not in encode
        ids = await asyncio.to_thread(tok.encode_batch, texts, add_special_tokens)
    else:
        ids = await asyncio.to_thread(lambda: [tok.encode(t, add_special_tokens=add_special_tokens) for t in texts])
    for x in ids:
        check_tokens(st, len(x), param, generate=generate)
    return ids


async def encode(st, text: str, param: str, *, generate: bool, add_special_tokens: bool = True) -> list[int]:
    return (await encode_all(st, [text], param, generate=generate, add_special_tokens=add_special_tokens))[0]


# -- sequences in flight ---------------------------------------------------------------------------
def check_seqs_per_request(st, n_prompts: int, n: int, param: str = "n") -> None:
    cap = st.config.max_seqs_per_request
    if n_prompts * n > cap:
        raise bad_request(f"this request asks for {n_prompts} prompt(s) × n={n} = {n_prompts * n} sequences; "
                          f"the server allows at most {cap} per request (--max-seqs-per-request)", param)


class Seats:
    """n sequences held against --max-pending-requests (ServerState.seqs_in_flight) from admission until
    release(), which the handler calls in a ``finally`` so that errors and disconnects give them back."""

    def __init__(self, st, n: int):
        cap = st.config.max_pending
        if n > cap:  # would never be admitted: retrying cannot help
            raise bad_request(f"this request needs {n} sequences; the server holds at most {cap} in flight "
                              "(--max-pending-requests)", "n")
        if st.seqs_in_flight + n > cap:
            raise APIError(f"the server is at capacity ({st.seqs_in_flight} of {cap} sequences in flight; this "
                           f"request needs {n}); retry later", 503, code="server_busy", headers={"Retry-After": "1"})
        self._st, self._n = st, n
        st.seqs_in_flight += n

    def release(self) -> None:
        """Idempotent."""
        if self._n:
            self._st.seqs_in_flight -= self._n
            self._n = 0
