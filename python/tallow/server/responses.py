"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}.

A request becomes what the chat handler would make of it (responses_protocol.py): chat messages rendered
by the chat template, the same tool-call parsers (ForcedToolCallStream for tool_choice required or a named
function), the same reasoning split, SamplingParams from protocol.sampling_params and the same engine
plumbing (seats, metrics, abort in a ``finally``). Its output is read one delta at a time into Responses
output items (``_Output``): a reasoning item, a message with one output_text part, function_call items, in
that order; a stream sends each change as its typed event. A finished response is kept (responses_store.py)
unless ``store`` is false, with its whole conversation, so that ``previous_response_id`` continues it and
the prompt shares the earlier one's prefix (and its KV blocks, through the prefix cache)."""
from __future__ import annotations

import copy
import logging
import time
import uuid
from typing import Any, Optional

from aiohttp import web

from tallow.engine.async_engine import EngineDeadError, EngineStepError
from tallow.engine.structured_output import StructuredOutputsParams
from tallow.server import limits as L
from tallow.server import protocol as P
from tallow.server import serving
from tallow.server.errors import APIError, bad_request
from tallow.server.keys import STATE, T0
from tallow.server.reasoning import prompt_opens_reasoning
from tallow.server.responses_protocol import ResponsesRequest, parse_request
from tallow.server.responses_store import ResponseStore
from tallow.server.tool_parsers import make_parser

log = logging.getLogger("tallow.server")

STORE = web.AppKey("tallow_responses_store", ResponseStore)


def add_routes(app: web.Application) -> None:
    app[STORE] = ResponseStore.for_this_process()
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _not_found(rid: str, param: Optional[str] = None) -> APIError:
    return APIError(f"no stored response has the id '{rid[:200]}' (it was never stored, was deleted, or was "
                    "evicted)", 404, param=param, code="response_not_found")


# -- output items as they form -------------------------------------------------------------------
class _Output:
    """The response's output items, built from reasoning / content / tool-call deltas, and (when ``record``)
    the stream events that tell each change, numbered in order."""

    def __init__(self, record: bool):
        self.record = record
        self.items: list[dict] = []
        self.events: list[dict] = []
        self.seq = 0
        self.reasoning: Optional[dict] = None  # the open reasoning item
        self.message: Optional[dict] = None  # the message item (open until closed)
        self.message_closed = False
        self.pending = ""  # leading whitespace of the reply, shown once real text follows (dropped before calls)
        self.calls: dict[int, dict] = {}  # the tool stream's call index -> its function_call item
        self.failed_calls = False
        self.reasoning_tokens = 0

    def emit(self, kind: str, **fields) -> None:
        if self.record:
            self.events.append({"type": kind, **fields, "sequence_number": self.seq})
        self.seq += 1

    def take(self) -> list[dict]:
        ev, self.events = self.events, []
        return ev

    def _add(self, item: dict) -> int:
        self.items.append(item)
        idx = len(self.items) - 1
        self.emit("response.output_item.added", output_index=idx, item=copy.deepcopy(item))
        return idx

    def _done(self, item: dict, status: str) -> None:
        item["status"] = status
        self.emit("response.output_item.done", output_index=self.items.index(item), item=copy.deepcopy(item))

    # reasoning
    def reasoning_delta(self, text: str) -> None:
        if self.reasoning is None:
            self.reasoning = {"id": _new_id("rs"), "type": "reasoning", "summary": [], "content": [],
                              "status": "in_progress"}
            idx = self._add(self.reasoning)
            part = {"type": "reasoning_text", "text": ""}
            self.emit("response.content_part.added", item_id=self.reasoning["id"], output_index=idx, content_index=0,
                      part=dict(part))
            self.reasoning["content"].append(part)
        part = self.reasoning["content"][0]
        part["text"] += text
        self.emit("response.reasoning_text.delta", item_id=self.reasoning["id"],
                  output_index=self.items.index(self.reasoning), content_index=0, delta=text)

    def _close_reasoning(self) -> None:
        item = self.reasoning
        if item is None or item["status"] != "in_progress":
            return
        idx, part = self.items.index(item), item["content"][0]
        self.emit("response.reasoning_text.done", item_id=item["id"], output_index=idx, content_index=0,
                  text=part["text"])
        self.emit("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0, part=dict(part))
        self._done(item, "completed")

    # the message
    def text_delta(self, text: str) -> None:
        if self.message_closed:
            return  # text after tool calls: the parsers give none; never reopen a message
        if self.message is None:
            if not (self.pending + text).strip():
                self.pending += text
                return
            text, self.pending = self.pending + text, ""
            self._open_message()
        part = self.message["content"][0]
        part["text"] += text
        self.emit("response.output_text.delta", item_id=self.message["id"], output_index=self.items.index(self.message),
                  content_index=0, delta=text, logprobs=[])

    def _open_message(self) -> None:
        self._close_reasoning()
        self.message = {"id": _new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                        "content": []}
        idx = self._add(self.message)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.emit("response.content_part.added", item_id=self.message["id"], output_index=idx, content_index=0,
                  part=dict(part))
        self.message["content"].append(part)

    def _close_message(self, status: str) -> None:
        item = self.message
        if item is None or self.message_closed:
            return
        self.message_closed = True
        idx, part = self.items.index(item), item["content"][0]
        self.emit("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0,
                  text=part["text"], logprobs=[])
        self.emit("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0,
                  part=copy.deepcopy(part))
        self._done(item, status)

    # function calls (ToolCallStream's deltas: the id and name first, then argument fragments)
    def call_event(self, ev: dict) -> None:
        if "id" in ev:
            self._close_reasoning()
            self._close_message("completed")
            self.pending = ""
            item = {"id": _new_id("fc"), "type": "function_call", "call_id": ev["id"], "name": ev["function"]["name"],
                    "arguments": "", "status": "in_progress"}
            self.calls[ev["index"]] = item
            self._add(item)
        frag = ev["function"].get("arguments") or ""
        if frag:
            item = self.calls[ev["index"]]
            item["arguments"] += frag
            self.emit("response.function_call_arguments.delta", item_id=item["id"],
                      output_index=self.items.index(item), delta=frag)

    def drop_calls(self, text: str) -> None:
        """A forced call that did not parse: before anything was sent, the reply is the text (as the chat path
        answers it); in a stream the call items already sent stay, closed as incomplete."""
        if self.record:
            self.failed_calls = True
            return
        self.items = [i for i in self.items if i["type"] != "function_call"]
        self.calls = {}
        self.text_delta(text)

    def finish(self, incomplete: bool) -> None:
        self._close_reasoning()
        if self.message is None and not self.calls:  # a reply of nothing (or only whitespace) is still a message
            text, self.pending = self.pending, ""
            self._open_message()
            if text:
                self.text_delta(text)
        self._close_message("incomplete" if incomplete else "completed")
        for item in self.calls.values():
            if not item["arguments"]:  # as the chat path answers a call without arguments
                self.call_event({"index": next(k for k, v in self.calls.items() if v is item),
                                 "function": {"arguments": "{}"}})
            self.emit("response.function_call_arguments.done", item_id=item["id"],
                      output_index=self.items.index(item), arguments=item["arguments"])
            self._done(item, "incomplete" if self.failed_calls else "completed")

    # the conversation's next assistant turn, as a chat message
    def assistant_message(self) -> dict:
        # content "" rather than null beside calls: simple templates (SmolLM2's) concatenate it
        text = self.message["content"][0]["text"] if self.message else ""
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning["content"][0]["text"]
        if self.calls:
            msg["tool_calls"] = [{"id": c["call_id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for c in self.calls.values()]
        return msg


# -- the handler ---------------------------------------------------------------------------------
async def create_response(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    store: ResponseStore = request.app[STORE]
    t0 = request.get(T0, time.monotonic())
    body = await P.read_json(request)
    req = parse_request(body, st.config.model_names)
    history: list[dict] = []
    if req.previous_response_id is not None:
        prev = store.get(req.previous_response_id)
        if prev is None:
            raise _not_found(req.previous_response_id, "previous_response_id")
        history = prev.conversation
    conversation = history + req.messages
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    template_kwargs = P.template_kwargs(body)

    use_tools = req.tools if req.tool_choice != "none" else None
    parser = make_parser(st.tool_parser_name, use_tools) if use_tools else None
    params = _sampling_params(st, req, parser)  # every field checked before the prompt is rendered
    forced, single_call = "", False
    if parser is not None and req.tool_choice != "auto":  # as the chat handler forces a call
        name = req.tool_choice["name"] if isinstance(req.tool_choice, dict) else None
        if name is None and len(use_tools) == 1:  # "required" with one tool: that tool
            name = use_tools[0]["function"]["name"]
        # one call whose arguments the tool's schema constrains (structured output) where the format writes JSON
        # arguments and the request brings no constraint of its own; else a forced prefix
        call_grammar = parser.call_grammar(use_tools, name) if (
            params.structured_outputs is None and getattr(st.engine, "structured_output", False)) else None
        forced = call_grammar[0] if call_grammar else parser.forced_prefix(name)
        single_call = name is not None or call_grammar is not None or not req.sampling_body["parallel_tool_calls"]
        if call_grammar is not None:
            params = params.clone(structured_outputs=StructuredOutputsParams(lark=call_grammar[1]))

    prompt_text = st.render_chat(messages, use_tools, True, False, template_kwargs)
    in_reasoning = st.reasoning and prompt_opens_reasoning(prompt_text)
    think_close = ""
    if forced and in_reasoning:
        think_close, in_reasoning = "</think>\n\n", False
    ids = await L.encode(st, prompt_text + think_close + forced, "input", generate=True, add_special_tokens=False)
    seats = L.Seats(st, 1)
    rid = _new_id("resp")
    rstream = await serving._add(st, {"prompt_token_ids": ids, "prompt": prompt_text}, params, rid, seats)
    rstream.merge = parser is None  # a tool call may end the reply mid-delta: read those a step at a time
    choice = serving._ChoiceState(st.reasoning, in_reasoning, parser, forced, single_call)
    base = {"id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "error": None, "incomplete_details": None, "model": req.model, "output": [], "usage": None, **req.echo}
    run = _Run(st, rstream, t0, choice, _Output(req.stream), base, len(ids))
    try:
        if req.stream:
            return await _stream(request, run, store, req, conversation)
        try:
            await run.generate(None)
        except (EngineStepError, EngineDeadError) as e:
            raise serving._engine_error(e) from None
        resp = run.response()
        _keep(store, req, resp, conversation, run.out)
        return serving._json_response(resp)
    finally:
        rstream.abort()  # no-op when it finished; frees the blocks when the client went away
        seats.release()


def _sampling_params(st, req: ResponsesRequest, parser):
    skip_special = not ((parser is not None and st.tool_markers_special) or (st.reasoning and st.think_special))
    kw = dict(max_model_len=st.max_model_len, default_max_tokens=None, logprobs=None,
              skip_special_tokens=skip_special, vocab_size=st.vocab_size)
    try:  # text.format arrives as the chat path's response_format: its errors name it
        return P.sampling_params(req.sampling_body, **kw)
    except APIError as e:
        if e.param == "response_format":
            e.param, e.message = "text.format", e.message.replace("response_format", "text.format")
        raise


class _Run:
    """One response's generation: the engine's deltas fed to the chat path's reasoning / tool-call state and on
    into the output items."""

    def __init__(self, st, rstream, t0, choice, out: _Output, base: dict, n_prompt: int):
        self.st, self.rstream, self.t0, self.choice, self.out, self.base = st, rstream, t0, choice, out, base
        self.n_prompt, self.n_out, self.cached = n_prompt, 0, 0
        self.finish_reason: Optional[str] = None

    async def generate(self, send) -> None:
        """Reads the request to its end (or the end of a forced call); send(events) after every delta."""
        c, out = self.choice, self.out
        async for ro in serving._observed(self.st, self.rstream, self.t0):
            self.cached = ro.num_cached_tokens
            for o in ro.outputs:
                self.n_out += len(o.token_ids)
                final = o.finish_reason is not None
                r, content, events = c.feed(o.text, final)
                if r:
                    out.reasoning_delta(r)
                    out.reasoning_tokens += len(o.token_ids)
                if content:
                    out.text_delta(content)
                for ev in events:
                    out.call_event(ev)
                if final:
                    c.finish_reason, c.stop_reason = o.finish_reason, o.stop_reason
                    self.finish_reason = o.finish_reason
            if send is not None and out.events:
                await send(out.take())
            if c.finish_reason is not None or c.call_done:
                serving._ended_early(self.st, [c], self.t0)
                break  # a forced call may end before the engine does; the handler aborts the rest
        if c.forced and c.ts.failed and out.calls:
            out.drop_calls(c.ts.content)
        incomplete = self.finish_reason == "length" and not c.call_done
        out.finish(incomplete)

    def response(self) -> dict:
        incomplete = self.finish_reason == "length" and not self.choice.call_done
        return {**self.base, "status": "incomplete" if incomplete else "completed",
                "completed_at": None if incomplete else int(time.time()),
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "output": self.out.items, "usage": self.usage()}

    def usage(self) -> dict:
        return {"input_tokens": self.n_prompt, "input_tokens_details": {"cached_tokens": self.cached},
                "output_tokens": self.n_out, "output_tokens_details": {"reasoning_tokens": self.out.reasoning_tokens},
                "total_tokens": self.n_prompt + self.n_out}


def _keep(store: ResponseStore, req: ResponsesRequest, resp: dict, conversation: list[dict], out: _Output) -> None:
    if req.store and not store.put(resp["id"], resp, conversation + [out.assistant_message()]):
        log.info("response %s is larger than the response store's byte cap: not stored", resp["id"])


# -- streaming ---------------------------------------------------------------------------------------
def _sse_event(ev: dict) -> bytes:
    return b"event: " + ev["type"].encode() + b"\ndata: " + serving._json_bytes(ev) + b"\n\n"


async def _stream(request, run: _Run, store: ResponseStore, req: ResponsesRequest, conversation) -> web.StreamResponse:
    resp = await serving._start_sse(request)
    out = run.out

    async def send(events: list[dict]) -> None:
        await resp.write(b"".join(map(_sse_event, events)))

    try:
        out.emit("response.created", response=copy.deepcopy(run.base))
        out.emit("response.in_progress", response=copy.deepcopy(run.base))
        await send(out.take())
        try:
            await run.generate(send)
        except (EngineStepError, EngineDeadError) as e:
            err = serving._engine_error(e)
            out.emit("error", code=err.code, message=err.message, param=None)
            failed = {**run.base, "status": "failed", "output": out.items, "usage": run.usage(),
                      "error": {"code": "server_error", "message": err.message}}
            out.emit("response.failed", response=failed)
            await send(out.take())
            await resp.write_eof()
            return resp
        final = run.response()
        _keep(store, req, final, conversation, out)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        out.emit(kind, response=final)
        await send(out.take())
        await resp.write_eof()
    except ConnectionResetError:  # the client went away; the handler aborts the request
        log.debug("client disconnected from %s", run.base["id"])
    return resp


# -- stored responses ------------------------------------------------------------------------------
async def get_response(request: web.Request) -> web.Response:
    rid = request.match_info["response_id"]
    if request.query.get("stream", "false").lower() not in ("false", "0", ""):
        raise bad_request("replaying a stored response as a stream is not supported", "stream")
    entry = request.app[STORE].get(rid)
    if entry is None:
        raise _not_found(rid)
    return serving._json_response(entry.response)


async def delete_response(request: web.Request) -> web.Response:
    rid = request.match_info["response_id"]
    if not request.app[STORE].delete(rid):
        raise _not_found(rid)
    return serving._json_response({"id": rid, "object": "response.deleted", "deleted": True})
