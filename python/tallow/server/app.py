"""The aiohttp application: routes, authentication, OpenAI-style errors, and the endpoints that do
not generate (models, tokenize, detokenize, health, version, metrics, the web UI).

    app = build_app(AsyncEngine(llm_engine), ServerConfig(model_names=["my-model"]))
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import logging
import pathlib
import time
from typing import Any, Optional

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from tallow.engine.structured_output import CompiledGrammars
from tallow.server import protocol as P
from tallow.server import responses, serving
from tallow.server.errors import APIError, bad_request, internal_error
from tallow.server.keys import STATE, T0
from tallow.server.limits import check_chars, check_tokens, encode, max_piece_chars
from tallow.server.metrics import CONTENT_TYPE, ServerMetrics
from tallow.server.reasoning import uses_reasoning
from tallow.server.tool_parsers import PARSERS, detect_parser

log = logging.getLogger("tallow.server")

STATIC_DIR = pathlib.Path(__file__).parent / "static"
DEFAULT_MAX_BODY = 32 * 2**20
_PROTECTED = ("/v1/", "/tokenize", "/detokenize")


@dataclasses.dataclass
class ServerConfig:
    model_names: list[str]
    model_root: str = ""  # where the model came from (reported by /v1/models)
    api_key: Optional[str] = None
    tool_parser: Optional[str] = None  # --enforce-parser; None: picked from the chat template / family
    reasoning: str = "auto"  # auto (when the chat template uses <think>), think, none
    ui: bool = False
    max_pending: int = 4096  # sequences (prompts x n) in flight before new requests get 503
    max_body_bytes: int = DEFAULT_MAX_BODY
    embedding_pooling: str = "last"
    max_seqs_per_request: int = 256  # prompts x n of one request (400 above)
    max_embedding_inputs: int = 2048  # inputs per /v1/embeddings request, as OpenAI
    # tokens per /v1/embeddings request; None: 4 x max_model_len capped at 65,536 (ServerState). One request
    # runs as one pass that nothing else shares, so this bounds how long it can hold the engine and the
    # activation memory of that pass; a few full-context documents per call is what clients batch.
    max_embedding_tokens: Optional[int] = None
    strict_model_name: bool = False  # --strict-model-name: 404 for a request naming another model

    def __post_init__(self):
        if not self.model_names:
            raise ValueError("ServerConfig needs at least one model name")
        self.model_names = P.ServedNames(self.model_names, self.strict_model_name)  # check_model reads both
        if self.tool_parser is not None and self.tool_parser not in PARSERS:
            raise ValueError(f"unknown tool parser {self.tool_parser!r}; choose one of {', '.join(PARSERS)}")
        if self.reasoning not in ("auto", "think", "none"):
            raise ValueError(f"reasoning must be auto, think or none, got {self.reasoning!r}")
        if self.embedding_pooling not in ("last", "mean"):
            raise ValueError(f"embedding pooling must be last or mean, got {self.embedding_pooling!r}")
        for name in ("max_pending", "max_seqs_per_request", "max_embedding_inputs", "max_embedding_tokens"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")


class ServerState:
    """What the handlers share: the engine, the tokenizer and what was decided about the model."""

    def __init__(self, engine, config: ServerConfig):
        from tallow import __version__

        self.engine = engine
        self.config = config
        llm = engine.engine
        self.tokenizer = engine.tokenizer
        cfg = getattr(llm, "config", None)
        self.max_model_len = int(getattr(llm, "max_model_len", 0) or getattr(cfg, "max_position_embeddings", 0)
                                 or 2**31)
        self.vocab_size = int(getattr(cfg, "vocab_size", 0) or self.tokenizer.vocab_size)
        # output constraints are compiled here first, so a bad one is a 400 before the engine sees it
        self.grammars = CompiledGrammars(self.tokenizer, self.vocab_size, getattr(self.tokenizer, "eos_token_ids", ()))
        self.hidden_size = int(getattr(cfg, "hidden_size", 0) or 0)
        self.family = getattr(cfg, "family", None)
        self.chat_template = getattr(self.tokenizer, "chat_template", None)
        self.tool_parser_name = config.tool_parser or detect_parser(self.chat_template, self.family)
        self.reasoning = config.reasoning == "think" or (config.reasoning == "auto"
                                                          and uses_reasoning(self.chat_template))
        parser_cls = PARSERS[self.tool_parser_name]
        self.tool_markers_special = self._any_special(parser_cls.markers + ("<|python_tag|>",))
        self.think_special = self._any_special(("<think>", "</think>"))
        dtype = getattr(llm, "dtype", "")
        self.fingerprint = "fp_" + hashlib.sha256(
            f"tallow {__version__} {config.model_root} {dtype}".encode()).hexdigest()[:10]
        self.created = int(time.time())
        self.metrics = ServerMetrics(engine, config.model_names[0])
        self.max_piece_chars = max_piece_chars(self.tokenizer)  # bounds a text's tokens by its length
        self.max_embedding_tokens = config.max_embedding_tokens or min(4 * self.max_model_len, 65_536)
        self.seqs_in_flight = 0  # sequences admitted (limits.Seats) and not yet released

    def _any_special(self, markers) -> bool:
        tok = self.tokenizer
        for m in markers:
            try:
                tid = tok.piece_to_id(m)
                if tid is not None and tok.is_special(tid):
                    return True
            except Exception:  # noqa: BLE001 - a tokenizer without these queries
                return False
        return False

    def render_chat(self, messages, tools, add_generation_prompt: bool, continue_final: bool,
                    template_kwargs: dict) -> str:
        from tallow.tokenizer.chat_template import ChatTemplateError, NoChatTemplateError, parse_tool_call_arguments

        # the rendered prompt holds every message's text: refuse by length before rendering and tokenizing it
        n_chars = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
        check_chars(self, n_chars, "messages", generate=False)
        kw = dict(template_kwargs)
        if continue_final:
            kw["continue_final_message"] = True
        try:
            return self.tokenizer.apply_chat_template(parse_tool_call_arguments(messages), tools=tools,
                                                      add_generation_prompt=add_generation_prompt, tokenize=False,
                                                      **kw)
        except NoChatTemplateError as e:
            raise bad_request(f"{e}; /v1/completions takes plain prompts", "messages", "no_chat_template") from None
        except ChatTemplateError as e:
            raise bad_request(f"the chat template rejected these messages: {e}", "messages") from None
        except TypeError as e:  # e.g. an unexpected keyword in chat_template_kwargs
            raise bad_request(f"chat_template_kwargs: {e}", "chat_template_kwargs") from None


# -- middlewares -------------------------------------------------------------------------------
@web.middleware
async def error_middleware(request: web.Request, handler):
    request[T0] = time.monotonic()
    st: ServerState = request.app[STATE]
    route = request.match_info.route.resource
    endpoint = route.canonical if route is not None else "unmatched"
    try:
        resp = await handler(request)
    except APIError as e:
        resp = e.response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        resp = _http_error(request, e).response()
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:  # a bug: log it, never show it
        log.exception("internal error answering %s %s", request.method, request.path)
        resp = internal_error().response()
    st.metrics.http(endpoint, resp.status)
    return resp


def _http_error(request: web.Request, e: web.HTTPException) -> APIError:
    if e.status == 404:
        return APIError(f"no route {request.method} {request.path[:200]}", 404, code="not_found")
    if e.status == 405:
        allowed = ", ".join(sorted(getattr(e, "allowed_methods", ()) or ()))
        return APIError(f"method {request.method} is not allowed on {request.path[:200]}"
                        + (f" (allowed: {allowed})" if allowed else ""), 405, code="method_not_allowed")
    if e.status == 413:
        return APIError(f"the request body is too large (limit {request.app[STATE].config.max_body_bytes} bytes)",
                        413, code="request_too_large")
    return APIError(e.reason or "bad request", e.status)


@web.middleware
async def auth_middleware(request: web.Request, handler):
    key = request.app[STATE].config.api_key
    if key and request.path.startswith(_PROTECTED):
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if not header:
            token = request.headers.get("x-api-key", "")
            if not token:
                raise APIError("missing API key: send the header 'Authorization: Bearer <key>'", 401,
                               code="missing_api_key", headers={"WWW-Authenticate": "Bearer"})
        elif scheme.lower() != "bearer":
            token = ""
        if not hmac.compare_digest(_header_bytes(token.strip()), key.encode("utf-8")):
            raise APIError("invalid API key", 401, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return await handler(request)


def _header_bytes(value: str) -> bytes:
    """A header value as the bytes sent: aiohttp keeps bytes that are not UTF-8 as lone surrogates."""
    try:
        return value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate no decoding produces: cannot match any key
        return b"\0"


# -- small endpoints ---------------------------------------------------------------------------
def _json(obj: Any, status: int = 200) -> web.Response:
    return web.json_response(obj, status=status)


def _model_card(st: ServerState, name: str) -> dict:
    return {"id": name, "object": "model", "created": st.created, "owned_by": "tallow",
            "root": st.config.model_root or name, "parent": None, "max_model_len": st.max_model_len}


async def list_models(request: web.Request) -> web.Response:
    st = request.app[STATE]
    return _json({"object": "list", "data": [_model_card(st, n) for n in st.config.model_names]})


async def get_model(request: web.Request) -> web.Response:
    st = request.app[STATE]
    name = request.match_info["model"]
    if name not in st.config.model_names:
        raise APIError(f"the model '{name[:200]}' does not exist", 404, type="invalid_request_error", param="model",
                       code="model_not_found")
    return _json(_model_card(st, name))


async def tokenize(request: web.Request) -> web.Response:
    st = request.app[STATE]
    body = await P.read_json(request)
    P.check_model(body, st.config.model_names)
    tok = st.tokenizer
    return_strs = P.get_field(body, "return_token_strs", "bool", False)
    # a prompt longer than the context is refused (by its length before tokenizing): the answer stays small
    if body.get("messages") is not None:
        messages = P.chat_messages(body)
        tools, _ = P.chat_tools(body)
        add_gen = P.get_field(body, "add_generation_prompt", "bool", True)
        kwargs = P.template_kwargs(body)
        add_special = P.get_field(body, "add_special_tokens", "bool", False)
        text = st.render_chat(messages, tools, add_gen, False, kwargs)
        ids = await encode(st, text, "messages", generate=False, add_special_tokens=add_special)
    else:
        prompt = P.get_field(body, "prompt", "str")
        if prompt is None:
            raise bad_request("'prompt' (a string) or 'messages' is required", "prompt")
        add_special = P.get_field(body, "add_special_tokens", "bool", True)
        ids = await encode(st, prompt, "prompt", generate=False, add_special_tokens=add_special)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": st.max_model_len, "tokens": ids}
    if return_strs:
        out["token_strs"] = [tok.id_to_piece(i) for i in ids]
    return _json(out)


async def detokenize(request: web.Request) -> web.Response:
    st = request.app[STATE]
    body = await P.read_json(request)
    P.check_model(body, st.config.model_names)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise bad_request("'tokens' must be an array of token ids", "tokens")
    check_tokens(st, len(ids), "tokens", generate=False)  # no model wrote more; decoding millions stalls the loop
    bad = next((t for t in ids if not 0 <= t < st.vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is out of range: this model's vocabulary has ids 0..{st.vocab_size - 1}",
                          "tokens")
    skip = P.get_field(body, "skip_special_tokens", "bool", True)
    return _json({"prompt": st.tokenizer.decode(ids, skip_special_tokens=skip)})


async def health(request: web.Request) -> web.Response:
    st = request.app[STATE]
    if not st.engine.is_running:
        err = st.engine.dead_error
        raise APIError(f"the engine is not running{': ' + str(err) if err else ''}", 503, code="engine_unavailable")
    return _json({"status": "ok"})


async def version(request: web.Request) -> web.Response:
    from tallow import __version__

    return _json({"version": __version__})


async def metrics(request: web.Request) -> web.Response:
    st = request.app[STATE]
    return web.Response(body=st.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


async def ui_index(request: web.Request) -> web.Response:
    return web.FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})


async def ui_config(request: web.Request) -> web.Response:
    st = request.app[STATE]
    return _json({"model": st.config.model_names[0], "auth": bool(st.config.api_key),
                  "max_model_len": st.max_model_len, "reasoning": st.reasoning})


# -- the app -----------------------------------------------------------------------------------
def build_app(engine, config: ServerConfig) -> web.Application:
    """An aiohttp app serving `engine` (an AsyncEngine). Run it with handler_cancellation=True
    (``run_app`` below does) so that a client that disconnects cancels, and aborts, its request."""
    app = web.Application(middlewares=[error_middleware, auth_middleware], client_max_size=config.max_body_bytes)
    app[STATE] = ServerState(engine, config)
    r = app.router
    r.add_post("/v1/chat/completions", serving.chat_completions)
    r.add_post("/v1/completions", serving.completions)
    r.add_post("/v1/embeddings", serving.embeddings)
    responses.add_routes(app)  # /v1/responses, GET and DELETE /v1/responses/{id}
    r.add_get("/v1/models", list_models)
    r.add_get("/v1/models/{model:.+}", get_model)
    r.add_post("/tokenize", tokenize)
    r.add_post("/detokenize", detokenize)
    r.add_get("/health", health)
    r.add_get("/version", version)
    r.add_get("/metrics", metrics)
    if config.ui:
        r.add_get("/", ui_index)
        r.add_get("/ui/config", ui_config)
        r.add_static("/ui/static/", STATIC_DIR, show_index=False)
    return app


class _MalformedRequestLog(logging.Filter):
    """aiohttp answers a request it cannot parse (a bad Content-Length, chunk or header) with a 400 itself
    and logs a traceback at ERROR; the client's mistake is worth one line at INFO."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 400) < 500:
            record.msg, record.args = f"{record.getMessage()}: {exc.message}", ()
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.INFO, "INFO"
            return log.isEnabledFor(logging.INFO)
        return True


_http_log = logging.getLogger("tallow.server.http")
_http_log.addFilter(_MalformedRequestLog())
# what every runner of the app passes: handlers cancelled (and requests aborted) when their client leaves;
# bodies left as sent, since read_json inflates them within the body limit and answers a bad encoding as 4xx
RUNNER_KWARGS = dict(handler_cancellation=True, access_log=None, auto_decompress=False, logger=_http_log)


async def start_server(app: web.Application, host: str, port: int, reuse_port: bool = False
                       ) -> tuple[web.AppRunner, int]:
    """Start serving; returns the runner (``await runner.cleanup()`` stops it) and the bound port
    (useful with port 0). reuse_port: several API server processes share the port (the kernel
    spreads connections over them)."""
    runner = web.AppRunner(app, **RUNNER_KWARGS)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True, reuse_port=reuse_port or None)
    await site.start()
    sockets = [s for s in (site._server.sockets if site._server else [])]  # noqa: SLF001
    bound = sockets[0].getsockname()[1] if sockets else port
    return runner, bound
