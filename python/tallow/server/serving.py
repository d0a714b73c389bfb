"""The OpenAI endpoints that generate: /v1/chat/completions, /v1/completions, /v1/embeddings.

Each handler validates the body (protocol.py), turns it into token ids and SamplingParams, hands
them to the AsyncEngine and shapes the delta RequestOutputs it yields into OpenAI responses:
one JSON body, or server-sent events ending with ``data: [DONE]``. A request whose client goes
away (a failed write, or the handler cancelled on disconnect) is aborted in a ``finally``, which
returns its KV blocks to the pool before the next step."""
from __future__ import annotations

import asyncio
import base64
import logging
import time
import uuid
from typing import Any, AsyncIterator, Optional

import msgspec
import numpy as np
from aiohttp import web

from tallow.engine.async_engine import EngineDeadError, EngineStepError
from tallow.engine.structured_output import StructuredOutputsParams
from tallow.server import limits as L
from tallow.server import protocol as P
from tallow.server.errors import APIError, bad_request
from tallow.server.keys import STATE, T0
from tallow.server.mcp_tools import mcp_hub, offer_mcp_tools
from tallow.server.reasoning import ReasoningStream, prompt_opens_reasoning
from tallow.server.tool_parsers import ForcedToolCallStream, ToolCallStream, make_parser

log = logging.getLogger("tallow.server")

_NEG_INF_LOGPROB = -9999.0  # JSON has no -Infinity


def _lp(v: float) -> float:
    return v if v > _NEG_INF_LOGPROB else _NEG_INF_LOGPROB


# msgspec writes UTF-8 without escaping non-ASCII, like json.dumps(ensure_ascii=False), at a fraction of
# its cost: a stream's chunks are encoded once per delta, so this is per-token work.
_json_bytes = msgspec.json.Encoder().encode


def _dumps(obj: Any) -> str:
    return _json_bytes(obj).decode("utf-8")


def _sse(obj: Any) -> bytes:
    return b"data: " + _json_bytes(obj) + b"\n\n"


class _ChunkFrame:
    """A stream's SSE chunk as bytes around its choices: the fields every chunk of the stream repeats
    (id, object, created, model, fingerprint) are encoded once per request, only the choice per chunk."""

    def __init__(self, fields: dict, include_usage: bool):
        self.head = b"data: " + _json_bytes(fields)[:-1] + b',"choices":['
        self.tail = b'],"usage":null}\n\n' if include_usage else b"]}\n\n"

    def choice(self, choice: dict) -> bytes:
        return self.head + _json_bytes(choice) + self.tail

    def usage(self, usage: dict) -> bytes:
        return self.head + b'],"usage":' + _json_bytes(usage) + b"}\n\n"


def _json_response(obj: Any) -> web.Response:
    return web.Response(body=_json_bytes(obj), content_type="application/json", charset="utf-8")


# -- engine plumbing shared by the handlers ----------------------------------------------------
async def _add(st, prompt: dict, params, request_id: str, seats: L.Seats):
    """Queue one request; its seats go back if it cannot be queued (else the handler's finally frees them).
    An output constraint is compiled against the tokenizer first (in a thread): a bad one is a 400."""
    try:
        if params.structured_outputs is not None:
            await asyncio.wrap_future(st.grammars.matcher(params.structured_outputs))
        return await st.engine.add_request(prompt, params, request_id)
    except BaseException as e:
        seats.release()
        if isinstance(e, ValueError):
            raise bad_request(str(e)) from None
        if isinstance(e, EngineDeadError):
            raise APIError(str(e), 503, code="engine_unavailable") from None
        raise


async def _observed(st, stream, t0: float) -> AsyncIterator:
    """The stream's deltas, observing TTFT, inter-token and end-to-end latency on the way."""
    last = None
    m = st.metrics
    async for out in stream:
        now = time.monotonic()
        if any(o.token_ids for o in out.outputs):
            if last is None:
                m.ttft.observe(now - t0)
            else:
                m.itl.observe(now - last)
            last = now
        if out.finished:
            m.e2e.observe(now - t0)
            for o in out.outputs:
                m.finished(o.finish_reason)
        yield out


async def _merged(st, streams: list, t0: float) -> AsyncIterator[tuple[int, Any]]:
    """(prompt index, delta) from several request streams as they come."""
    if len(streams) == 1:
        async for out in _observed(st, streams[0], t0):
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(k, s):
        try:
            async for out in _observed(st, s, t0):
                q.put_nowait((k, out))
        except BaseException as e:  # noqa: BLE001 - handed to the reader
            q.put_nowait((k, e))
        finally:
            q.put_nowait((k, done))

    tasks = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            k, item = await q.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield k, item
    finally:
        for t in tasks:
            t.cancel()


def _engine_error(e: BaseException) -> APIError:
    if isinstance(e, EngineDeadError):
        return APIError(str(e), 503, code="engine_unavailable")
    log.error("request failed in the engine: %s", e)
    return APIError("the model failed while generating this response; the request was aborted", 500,
                    code="engine_error")


async def _start_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                       "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    return resp


def _usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens}
    if cached:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u


# -- logprobs ----------------------------------------------------------------------------------
def _entries(lps, token_ids):
    """(token id, its Logprob, the entry dict) per generated token."""
    for tid, entry in zip(token_ids, lps or ()):
        lp = entry.get(tid)
        if lp is None:  # the sampled token is the entry's first key
            tid, lp = next(iter(entry.items()))
        yield tid, lp, entry


def _top(entry: dict, k: int) -> list:
    return sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:k]


def _tok_text(st, tid: int, lp) -> str:
    return lp.decoded_token if lp.decoded_token is not None else st.tokenizer.decode([tid], False)


def chat_logprobs(st, lps, token_ids, k: int) -> list[dict]:
    out = []
    for tid, lp, entry in _entries(lps, token_ids):
        text = _tok_text(st, tid, lp)
        top = [{"token": _tok_text(st, t, x), "logprob": _lp(x.logprob),
                "bytes": list(_tok_text(st, t, x).encode("utf-8"))} for t, x in _top(entry, k)] if k else []
        out.append({"token": text, "logprob": _lp(lp.logprob), "bytes": list(text.encode("utf-8")),
                    "top_logprobs": top})
    return out


def completion_logprobs(st, lps, token_ids, k: int, offset: int) -> tuple[dict, int]:
    res = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, lp, entry in _entries(lps, token_ids):
        text = _tok_text(st, tid, lp)
        res["tokens"].append(text)
        res["token_logprobs"].append(_lp(lp.logprob))
        res["top_logprobs"].append({_tok_text(st, t, x): _lp(x.logprob) for t, x in _top(entry, k)} if k else None)
        res["text_offset"].append(offset)
        offset += len(text)
    return res, offset


def prompt_completion_logprobs(st, prompt_lps, prompt_ids, k: int) -> tuple[dict, int]:
    """The echoed prompt's part of a completion's logprobs: the first token has none (null), the
    others their log-probability given the tokens before them and their top k (prompt_logprobs)."""
    first = st.tokenizer.decode([prompt_ids[0]], False)
    res = {"tokens": [first], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}
    rest, offset = completion_logprobs(st, (prompt_lps or [None])[1:], prompt_ids[1:], k, len(first))
    for key in res:
        res[key] += rest[key]
    return res, offset


def _prompt_logprobs_json(prompt_lps) -> Optional[list]:
    """vLLM's prompt_logprobs field: null for the first prompt token, then {token id: {logprob, rank,
    decoded_token}} per token."""
    if prompt_lps is None:
        return None
    return [None if e is None else {str(t): {"logprob": _lp(v.logprob), "rank": v.rank,
                                             "decoded_token": v.decoded_token} for t, v in e.items()}
            for e in prompt_lps]


# -- chat --------------------------------------------------------------------------------------
class _ChoiceState:
    """Turns one choice's text deltas into reasoning, content and tool-call deltas."""

    def __init__(self, reasoning: bool, in_reasoning: bool, parser, forced: str, single_call: bool = False):
        self.rs = ReasoningStream(in_reasoning) if reasoning else None
        self.ts = None
        if parser is not None:  # a forced call (tool_choice required / named) ends when it is complete
            self.ts = ForcedToolCallStream(parser, forced, single_call) if forced else ToolCallStream(parser)
        self.text = ""  # non-streaming: everything, parsed once at the end
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.finish_reason: Optional[str] = None
        self.stop_reason = None
        self.final_sent = False

    def feed(self, text: str, final: bool) -> tuple[str, str, list]:
        r, c = self.rs.feed(text, final) if self.rs is not None else ("", text)
        events: list = []
        if self.ts is not None:
            c, events = self.ts.feed(c, final)
        return r, c, events

    @property
    def forced(self) -> bool:
        return isinstance(self.ts, ForcedToolCallStream)

    @property
    def call_done(self) -> bool:
        """A forced call is complete: what the model generates after it is not wanted."""
        return self.forced and self.ts.done

    def finish_reason_out(self) -> Optional[str]:
        if self.forced:
            return "tool_calls" if self.ts.done else self.finish_reason
        if self.ts is not None and self.ts.calls:
            return "tool_calls"
        return self.finish_reason


def _ended_early(st, choices, t0: float) -> None:
    """Metrics for forced calls that ended before the engine finished them (the engine's own ends
    are counted in _observed)."""
    early = [c for c in choices if c.call_done and c.finish_reason is None]
    if early:
        st.metrics.e2e.observe(time.monotonic() - t0)
        for _ in early:
            st.metrics.finished("tool_calls")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    t0 = request.get(T0, time.monotonic())
    body = await P.read_json(request)
    model = P.check_model(body, st.config.model_names)
    stream = P.get_field(body, "stream", "bool", False)
    include_usage = P.stream_options(body, stream)
    messages = P.chat_messages(body)
    body, mcp = offer_mcp_tools(body, mcp_hub(request.app))  # --mcp-config: their tools for requests with none
    tools, tool_choice = P.chat_tools(body)
    want_logprobs = P.get_field(body, "logprobs", "bool", False)
    top_logprobs = P.get_field(body, "top_logprobs", "int", None, lo=0, hi=P.MAX_LOGPROBS)
    if top_logprobs and not want_logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    add_generation_prompt = P.get_field(body, "add_generation_prompt", "bool", True)
    continue_final = P.get_field(body, "continue_final_message", "bool", False)
    if continue_final and "add_generation_prompt" in body and add_generation_prompt:
        raise bad_request("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                          "continue_final_message")
    template_kwargs = P.template_kwargs(body)
    for key in ("enable_thinking", "reasoning_effort"):
        if body.get(key) is not None:
            template_kwargs.setdefault(key, body[key])
    if body.get("chat_template") is not None:
        raise bad_request("a per-request 'chat_template' is not accepted; start the server with --chat-template",
                          "chat_template")

    use_tools = tools if tool_choice != "none" else None
    parser = make_parser(st.tool_parser_name, tools) if use_tools else None
    forced, single_call, call_grammar = "", False, None
    if parser is not None and tool_choice != "auto":
        name = tool_choice["name"] if isinstance(tool_choice, dict) else None
        if name is None and len(use_tools) == 1:  # "required" with one tool: that tool
            name = use_tools[0]["function"]["name"]
        # One call whose arguments the tool's schema constrains (structured output), where the format
        # writes JSON arguments and the request brings no constraint of its own; else a forced prefix.
        if P.structured_outputs(body) is None and getattr(st.engine, "structured_output", False):
            call_grammar = parser.call_grammar(use_tools, name)
        forced = call_grammar[0] if call_grammar else parser.forced_prefix(name)
        single_call = name is not None or call_grammar is not None or \
            not P.get_field(body, "parallel_tool_calls", "bool", True)

    prompt_text = st.render_chat(messages, use_tools, add_generation_prompt and not continue_final, continue_final,
                                 template_kwargs)
    in_reasoning = st.reasoning and prompt_opens_reasoning(prompt_text)
    if forced and in_reasoning:
        forced, in_reasoning = "</think>\n\n" + forced, False
    ids = await L.encode(st, prompt_text + forced, "messages", generate=True, add_special_tokens=False)
    skip_special = not ((parser is not None and st.tool_markers_special) or (st.reasoning and st.think_special))
    params = P.sampling_params(body, max_model_len=st.max_model_len, default_max_tokens=None,
                               logprobs=(top_logprobs or 0) if want_logprobs else None,
                               skip_special_tokens=skip_special, vocab_size=st.vocab_size)
    if call_grammar is not None:
        params = params.clone(structured_outputs=StructuredOutputsParams(lark=call_grammar[1]))
    if params.prompt_logprobs is not None and stream:  # vLLM's rule too: a stream has no place for them
        raise bad_request("'prompt_logprobs' is not supported when streaming", "prompt_logprobs")
    L.check_seqs_per_request(st, 1, params.n)
    seats = L.Seats(st, params.n)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    rstream = await _add(st, {"prompt_token_ids": ids, "prompt": prompt_text}, params, rid, seats)
    rstream.merge = parser is None  # a tool call may end the reply mid-delta: read those a step at a time
    forced_text = forced[len("</think>\n\n"):] if forced.startswith("</think>") else forced
    choices = [_ChoiceState(st.reasoning, in_reasoning, parser, forced_text, single_call) for _ in range(params.n)]
    meta = {"id": rid, "created": int(time.time()), "model": model, "system_fingerprint": st.fingerprint}
    k = top_logprobs or 0
    try:
        if mcp is not None:
            from tallow.server.mcp_loop import ChatRounds, chat_rounds

            later = params if call_grammar is None else params.clone(structured_outputs=None)  # rounds 2+: auto
            rounds = ChatRounds(st, mcp, t0, meta, messages, use_tools, template_kwargs, later, seats, want_logprobs,
                                k, include_usage, rstream, choices, len(ids))
            return await chat_rounds(request, rounds, stream)
        if stream:
            return await _chat_stream(request, st, rstream, t0, meta, choices, len(ids), include_usage,
                                      want_logprobs, k)
        return await _chat_full(st, rstream, t0, meta, choices, len(ids), want_logprobs, k)
    finally:
        rstream.abort()  # no-op when it finished; frees the blocks when the client went away
        seats.release()


async def _chat_full(st, rstream, t0, meta, choices, n_prompt, want_logprobs, k) -> web.Response:
    result, n_out, cached, prompt_lps = await _chat_collect(st, rstream, t0, choices, want_logprobs, k)
    body = {**{"id": meta["id"], "object": "chat.completion", "created": meta["created"], "model": meta["model"]},
            "system_fingerprint": meta["system_fingerprint"], "choices": result, "usage": _usage(n_prompt, n_out, cached)}
    if prompt_lps is not None:  # vLLM's field: the rendered prompt's tokens, as in /v1/completions
        body["prompt_logprobs"] = _prompt_logprobs_json(prompt_lps)
    return _json_response(body)


def _message(c: _ChoiceState, content: str) -> dict:
    """The assistant message of a choice whose text has all been fed."""
    msg: dict[str, Any] = {"role": "assistant", "content": c.rs.content if c.rs is not None else content}
    if c.ts is not None:
        msg["content"] = c.ts.content
    if c.rs is not None and c.rs.reasoning is not None:
        msg["reasoning_content"] = c.rs.reasoning
    calls = c.ts.tool_calls() if c.ts is not None else []
    if calls:
        msg["tool_calls"] = calls
        if not (msg["content"] or "").strip():
            msg["content"] = None
    return msg


async def _chat_collect(st, rstream, t0, choices, want_logprobs, k) -> tuple[list, int, int, Any]:
    """One generation's choices (non-streaming), with its completion tokens, cached prompt tokens and
    prompt logprobs."""
    cached, prompt_lps = 0, None
    try:
        async for out in _observed(st, rstream, t0):
            cached = out.num_cached_tokens
            if out.prompt_logprobs is not None:
                prompt_lps = out.prompt_logprobs
            for o in out.outputs:
                c = choices[o.index]
                if c.call_done:
                    continue
                c.text += o.text
                c.token_ids += o.token_ids
                if o.logprobs:
                    c.logprobs += o.logprobs
                if o.finish_reason is not None:
                    c.finish_reason, c.stop_reason = o.finish_reason, o.stop_reason
                if c.forced:  # fed as it comes, to stop at the end of the call
                    c.feed(o.text, o.finish_reason is not None)
            if all(c.call_done or c.finish_reason is not None for c in choices):
                _ended_early(st, choices, t0)
                break  # the caller aborts what still runs
    except (EngineStepError, EngineDeadError) as e:
        raise _engine_error(e) from None
    result = []
    for i, c in enumerate(choices):
        _, content, _ = c.feed("", True) if c.forced else c.feed(c.text, True)
        choice = {"index": i, "message": _message(c, content),
                  "logprobs": {"content": chat_logprobs(st, c.logprobs, c.token_ids, k)} if want_logprobs else None,
                  "finish_reason": c.finish_reason_out()}
        if c.stop_reason is not None:
            choice["stop_reason"] = c.stop_reason
        result.append(choice)
    return result, sum(len(c.token_ids) for c in choices), cached, prompt_lps


async def _chat_stream(request, st, rstream, t0, meta, choices, n_prompt, include_usage, want_logprobs, k):
    resp = await _start_sse(request)
    try:
        return await _chat_events(resp, st, rstream, t0, meta, choices, n_prompt, include_usage, want_logprobs, k)
    except ConnectionResetError:  # the client went away; the caller aborts the request
        log.debug("client disconnected from %s", meta["id"])
        return resp


def _chat_frame(meta, include_usage: bool) -> _ChunkFrame:
    return _ChunkFrame({"id": meta["id"], "object": "chat.completion.chunk", "created": meta["created"],
                        "model": meta["model"], "system_fingerprint": meta["system_fingerprint"]}, include_usage)


async def _chat_events(resp, st, rstream, t0, meta, choices, n_prompt, include_usage, want_logprobs, k):
    frame = _chat_frame(meta, include_usage)
    chunk = frame.choice
    head = b"".join(chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                           "finish_reason": None}) for i in range(len(choices)))
    await resp.write(head)
    try:
        n_out, cached = await _chat_round_events(resp, st, rstream, t0, chunk, choices, want_logprobs, k)
        if include_usage:
            await resp.write(frame.usage(_usage(n_prompt, n_out, cached)))
    except (EngineStepError, EngineDeadError) as e:
        await resp.write(_sse(_engine_error(e).to_dict()))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def _end_chunk(c: _ChoiceState, index: int, finish_reason: Optional[str] = None) -> dict:
    end = {"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason or c.finish_reason_out()}
    if c.stop_reason is not None:
        end["stop_reason"] = c.stop_reason
    return end


async def _chat_round_events(resp, st, rstream, t0, chunk, choices, want_logprobs, k, defer_end: bool = False,
                             call_offset: int = 0) -> tuple[int, int]:
    """Stream one generation's deltas; returns (completion tokens, cached prompt tokens). defer_end:
    the choice's end chunk (its finish_reason) is left to the caller (the MCP rounds, which decide
    after the round whether another follows); call_offset shifts the tool calls' indexes past those
    of earlier rounds, so that clients which merge deltas by index keep every round's calls apart."""
    n_out, cached = 0, 0
    async for out in _observed(st, rstream, t0):
        cached = out.num_cached_tokens
        parts = []
        for o in out.outputs:
            c = choices[o.index]
            if c.final_sent:
                continue
            n_out += len(o.token_ids)
            r, content, events = c.feed(o.text, o.finish_reason is not None)
            final = o.finish_reason is not None or c.call_done
            lp = ({"content": chat_logprobs(st, o.logprobs, o.token_ids, k)}
                  if want_logprobs and o.token_ids else None)
            delta: dict[str, Any] = {}
            if r:
                delta["reasoning_content"] = r
            if content:
                delta["content"] = content
            if delta or lp:
                parts.append(chunk({"index": o.index, "delta": delta, "logprobs": lp, "finish_reason": None}))
            for ev in events:
                if call_offset:
                    ev = {**ev, "index": ev["index"] + call_offset}
                parts.append(chunk({"index": o.index, "delta": {"tool_calls": [ev]}, "logprobs": None,
                                    "finish_reason": None}))
            if final:
                c.finish_reason, c.stop_reason = o.finish_reason, o.stop_reason
                c.final_sent = True
                if not defer_end:
                    parts.append(chunk(_end_chunk(c, o.index)))
        if parts:
            await resp.write(b"".join(parts))
        if all(c.final_sent for c in choices):
            _ended_early(st, choices, t0)
            break  # every choice ended (a forced call may end before the engine does); the caller aborts
    return n_out, cached


# -- completions -------------------------------------------------------------------------------
async def completions(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    t0 = request.get(T0, time.monotonic())
    body = await P.read_json(request)
    model = P.check_model(body, st.config.model_names)
    stream = P.get_field(body, "stream", "bool", False)
    include_usage = P.stream_options(body, stream)
    if "prompt" not in body:
        raise bad_request("'prompt' is required", "prompt")
    prompts = P.prompt_inputs(body.get("prompt"), "prompt")
    if len(prompts) > 1024:
        raise bad_request(f"at most 1024 prompts per request, got {len(prompts)}", "prompt")
    if P.get_field(body, "suffix", "str"):
        raise bad_request("'suffix' is not supported", "suffix")
    echo = P.get_field(body, "echo", "bool", False)
    logprobs = P.get_field(body, "logprobs", "int", None, lo=0, hi=P.MAX_LOGPROBS)
    if echo and logprobs is not None and stream:
        raise bad_request("'echo' together with 'logprobs' (prompt logprobs) is not supported when streaming",
                          "echo")
    params = P.sampling_params(body, max_model_len=st.max_model_len, default_max_tokens=16, logprobs=logprobs,
                               vocab_size=st.vocab_size)
    want_prompt_lps = params.prompt_logprobs is not None  # vLLM's prompt_logprobs field in each choice
    if want_prompt_lps and stream:
        raise bad_request("'prompt_logprobs' is not supported when streaming", "prompt_logprobs")
    if echo and logprobs is not None:  # the echoed prompt's tokens carry their log-probs too
        params = params.clone(prompt_logprobs=max(params.prompt_logprobs or 0, logprobs))
    L.check_seqs_per_request(st, len(prompts), params.n)
    tok = st.tokenizer
    vocab = st.vocab_size
    for p in prompts:  # every cheap check before any prompt is tokenized
        if isinstance(p, str):
            if not p:
                raise bad_request("the prompt is empty", "prompt")
            L.check_chars(st, len(p), "prompt", generate=True)
        else:
            bad = next((t for t in p if not 0 <= t < vocab), None)
            if bad is not None:
                raise bad_request(f"prompt token id {bad} is out of range: this model's vocabulary has ids "
                                  f"0..{vocab - 1}", "prompt")
            L.check_tokens(st, len(p), "prompt", generate=True)
    texts = [p for p in prompts if isinstance(p, str)]
    encoded = iter(await L.encode_all(st, texts, "prompt", generate=True))
    inputs = [(next(encoded), p) if isinstance(p, str) else (list(p), None) for p in prompts]
    seats = L.Seats(st, len(inputs) * params.n)
    cid = f"cmpl-{uuid.uuid4().hex}"
    streams = []
    try:
        for i, (ids, text) in enumerate(inputs):
            prompt = {"prompt_token_ids": ids} if text is None else {"prompt_token_ids": ids, "prompt": text}
            streams.append(await _add(st, prompt, params, f"{cid}-{i}", seats))
            streams[-1].merge = True  # a reader behind gets one delta (one chunk) for all its waiting steps
        meta = {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
                "system_fingerprint": st.fingerprint}
        echoes = [(text if text is not None else tok.decode(ids)) if echo else "" for ids, text in inputs]
        if stream:
            return await _completion_stream(request, st, streams, t0, meta, params.n, inputs, echoes,
                                            include_usage, logprobs)
        return await _completion_full(st, streams, t0, meta, params.n, inputs, echoes, logprobs,
                                      echo and logprobs is not None, want_prompt_lps)
    finally:
        for s in streams:
            s.abort()
        seats.release()


async def _completion_full(st, streams, t0, meta, n, inputs, echoes, logprobs, echo_lps=False,
                           want_prompt_lps=False) -> web.Response:
    texts = [[e] * n for e in echoes]
    toks = [[[] for _ in range(n)] for _ in inputs]
    lps = [[[] for _ in range(n)] for _ in inputs]
    fin = [[(None, None)] * n for _ in inputs]
    prompt_lps = [None] * len(inputs)
    cached = 0
    try:
        async for k, out in _merged(st, streams, t0):
            if out.prompt_logprobs is not None:
                prompt_lps[k] = out.prompt_logprobs
            if out.finished:
                cached += out.num_cached_tokens
            for o in out.outputs:
                texts[k][o.index] += o.text
                toks[k][o.index] += o.token_ids
                if o.logprobs:
                    lps[k][o.index] += o.logprobs
                if o.finish_reason is not None:
                    fin[k][o.index] = (o.finish_reason, o.stop_reason)
    except (EngineStepError, EngineDeadError) as e:
        raise _engine_error(e) from None
    choices = []
    for k in range(len(inputs)):
        for i in range(n):
            lp = None
            if echo_lps:
                lp, offset = prompt_completion_logprobs(st, prompt_lps[k], inputs[k][0], logprobs)
                gen, _ = completion_logprobs(st, lps[k][i], toks[k][i], logprobs, len(echoes[k]))
                for key in lp:
                    lp[key] += gen[key]
            elif logprobs is not None:
                lp, _ = completion_logprobs(st, lps[k][i], toks[k][i], logprobs, len(echoes[k]))
            choice = {"index": k * n + i, "text": texts[k][i], "logprobs": lp, "finish_reason": fin[k][i][0]}
            if fin[k][i][1] is not None:
                choice["stop_reason"] = fin[k][i][1]
            if want_prompt_lps:
                choice["prompt_logprobs"] = _prompt_logprobs_json(prompt_lps[k])
            choices.append(choice)
    n_prompt = sum(len(ids) for ids, _ in inputs)
    n_out = sum(len(t) for row in toks for t in row)
    return _json_response({**meta, "choices": choices, "usage": _usage(n_prompt, n_out, cached)})


async def _completion_stream(request, st, streams, t0, meta, n, inputs, echoes, include_usage, logprobs):
    resp = await _start_sse(request)
    try:
        return await _completion_events(resp, st, streams, t0, meta, n, inputs, echoes, include_usage, logprobs)
    except ConnectionResetError:  # the client went away; the caller aborts the requests
        log.debug("client disconnected from %s", meta["id"])
        return resp


async def _completion_events(resp, st, streams, t0, meta, n, inputs, echoes, include_usage, logprobs):
    frame = _ChunkFrame(meta, include_usage)
    offsets = [[len(e)] * n for e in echoes]
    started = [[False] * n for _ in inputs]
    done = [[False] * n for _ in inputs]  # a finished completion keeps reporting its reason: send it once
    n_out, cached = 0, 0
    try:
        async for k, out in _merged(st, streams, t0):
            if out.finished:
                cached += out.num_cached_tokens
            parts = []
            for o in out.outputs:
                if done[k][o.index]:
                    continue
                done[k][o.index] = o.finish_reason is not None
                text = o.text
                if not started[k][o.index]:
                    started[k][o.index] = True
                    text = echoes[k] + text
                n_out += len(o.token_ids)
                if not (text or o.token_ids or o.finish_reason):
                    continue
                lp = None
                if logprobs is not None:
                    lp, offsets[k][o.index] = completion_logprobs(st, o.logprobs, o.token_ids, logprobs,
                                                                  offsets[k][o.index])
                choice = {"index": k * n + o.index, "text": text, "logprobs": lp, "finish_reason": o.finish_reason}
                if o.stop_reason is not None:
                    choice["stop_reason"] = o.stop_reason
                parts.append(frame.choice(choice))
            if parts:
                await resp.write(b"".join(parts))
        if include_usage:
            n_prompt = sum(len(ids) for ids, _ in inputs)
            await resp.write(frame.usage(_usage(n_prompt, n_out, cached)))
    except (EngineStepError, EngineDeadError) as e:
        await resp.write(_sse(_engine_error(e).to_dict()))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


# -- embeddings --------------------------------------------------------------------------------
async def embeddings(request: web.Request) -> web.Response:
    from tallow.engine.errors import KVCacheFullError

    st = request.app[STATE]
    body = await P.read_json(request)
    model = P.check_model(body, st.config.model_names)
    if "input" not in body:
        raise bad_request("'input' is required", "input")
    inputs = P.prompt_inputs(body.get("input"), "input")
    max_inputs = st.config.max_embedding_inputs
    if len(inputs) > max_inputs:
        raise bad_request(f"at most {max_inputs} inputs per request (--max-embedding-inputs), got {len(inputs)}",
                          "input")
    if any(isinstance(x, str) and not x for x in inputs):
        raise bad_request("'input' strings must not be empty", "input")
    fmt = P.get_field(body, "encoding_format", "str", "float", choices=("float", "base64"))
    pooling = P.get_field(body, "pooling", "str", st.config.embedding_pooling, choices=("last", "mean"))
    normalize = P.get_field(body, "normalize", "bool", True)
    dims = P.get_field(body, "dimensions", "int", None, lo=1, hi=2**31)
    if dims is not None and dims != st.hidden_size:
        raise bad_request(f"'dimensions' must be this model's hidden size ({st.hidden_size}); other sizes are not "
                          "supported", "dimensions")
    # every bound before any work: each input within the context, then the request's total (token-id inputs
    # counted, texts bounded below by their length), then the texts tokenized (off the loop when long)
    at_least = 0
    for x in inputs:
        if isinstance(x, list):
            L.check_tokens(st, len(x), "input", generate=False)
            at_least += len(x)
        else:
            L.check_chars(st, len(x), "input", generate=False)
            at_least += -(-len(x) // st.max_piece_chars)
    _check_embedding_tokens(st, at_least, estimated=any(isinstance(x, str) for x in inputs))
    encoded = iter(await L.encode_all(st, [x for x in inputs if isinstance(x, str)], "input", generate=False))
    ids = [x if isinstance(x, list) else next(encoded) for x in inputs]
    _check_embedding_tokens(st, sum(map(len, ids)))
    seats = L.Seats(st, len(ids))
    try:
        results = await st.engine.embed([{"prompt_token_ids": x} for x in ids], pooling=pooling, normalize=normalize)
    except ValueError as e:
        raise bad_request(str(e), "input") from None
    except KVCacheFullError as e:
        raise APIError(str(e), 503, code="server_busy", headers={"Retry-After": "1"}) from None
    except EngineDeadError as e:
        raise APIError(str(e), 503, code="engine_unavailable") from None
    finally:
        seats.release()
    data = []
    total = 0
    for i, (vec, n) in enumerate(results):
        total += n
        if fmt == "base64":
            emb: Any = base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode("ascii")
        else:
            emb = [float(v) for v in vec]
        data.append({"object": "embedding", "index": i, "embedding": emb})
    return _json_response({"object": "list", "data": data, "model": model,
                           "usage": {"prompt_tokens": total, "total_tokens": total}})


def _check_embedding_tokens(st, n_tokens: int, estimated: bool = False) -> None:
    cap = st.max_embedding_tokens
    if n_tokens > cap:
        has = f"at least {n_tokens}" if estimated else f"{n_tokens}"
        raise bad_request(f"the inputs have {has} tokens together; at most {cap} per request "
                          "(--max-embedding-tokens): split them over several requests", "input")
