"""The MCP tool rounds of a chat request: generate; when the model calls MCP tools, run them, append
the assistant's tool_calls message and one ``tool`` message per result to the conversation, and
generate again, until the model answers without an MCP call or ``--mcp-max-rounds`` rounds of tool
calls have run.

- A request that brings no ``tools`` (and whose tool_choice is not "none") is offered the MCP
  servers' tools; its tool_choice (e.g. naming an MCP tool) holds for the first round only, later
  rounds are "auto". A request with tools of its own never enters the rounds.
- A call to a tool that is not an MCP tool (or a message that mixes them) ends the rounds: the
  message is returned with finish_reason "tool_calls", as without MCP.
- At the cap the last message is returned as generated (its MCP calls not run) with finish_reason
  "length".
- A failed tool (its server died, hung past its timeout, or answered an error) becomes a tool message
  saying so, fed back to the model; the server is started again for the next call.
- Non-streaming: the final message, plus ``mcp_rounds``: per round, the assistant ``message`` (with
  its tool_calls) and the ``tool_results`` (the tool messages fed back, each with ``is_error``).
- Streaming: each round's deltas as usual (tool-call indexes continue across rounds), then per tool
  result one chunk whose delta is ``{"role": "tool", "tool_call_id", "name", "content", "is_error"}``,
  then ``{"role": "assistant", "content": ""}`` and the next round; one finish_reason and one
  ``data: [DONE]`` at the end. Usage (both modes) is the sum over rounds.
Each round is its own engine request (``<id>-r<k>``) with the first round's sampling parameters.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from aiohttp import web

from tallow.engine.async_engine import EngineDeadError, EngineStepError
from tallow.server import limits as L
from tallow.server import serving as S
from tallow.server.errors import APIError
from tallow.server.mcp_tools import McpHub
from tallow.server.reasoning import prompt_opens_reasoning
from tallow.server.tool_parsers import make_parser


@dataclasses.dataclass
class ChatRounds:
    """What the rounds after the first need from the chat handler, and the first round as started."""
    st: Any
    hub: McpHub
    t0: float
    meta: dict
    messages: list
    tools: list
    template_kwargs: dict
    params: Any  # the later rounds' (the first round's, less a forced call's constraint)
    seats: Any
    want_logprobs: bool
    k: int
    include_usage: bool
    rstream: Any  # the first round, already queued (the handler aborts it)
    choices: list
    n_prompt: int
    streams: list = dataclasses.field(default_factory=list)  # later rounds' streams, aborted at the end


class _Totals:
    def __init__(self):
        self.prompt, self.out, self.cached = 0, 0, 0

    def usage(self) -> dict:
        return S._usage(self.prompt, self.out, self.cached)


def _mcp_calls(hub: McpHub, msg: dict) -> list:
    """The message's tool calls when every one is an MCP tool's, else [] (the rounds end)."""
    calls = msg.get("tool_calls") or []
    return calls if calls and all(hub.owns(c["function"]["name"]) for c in calls) else []


async def _run_calls(hub: McpHub, calls: list) -> list[dict]:
    results = await asyncio.gather(*(hub.call(c["function"]["name"], c["function"]["arguments"]) for c in calls))
    return [{"role": "tool", "tool_call_id": c["id"], "name": c["function"]["name"], "content": r.content,
             "is_error": r.is_error} for c, r in zip(calls, results)]


def _conversation_turn(msg: dict, tool_msgs: list) -> list:
    """The assistant message and tool results as the chat template reads them."""
    assistant = {"role": "assistant", "content": msg.get("content"), "tool_calls": msg["tool_calls"]}
    return [assistant] + [{k: v for k, v in t.items() if k != "is_error"} for t in tool_msgs]


async def _next_round(r: ChatRounds, conv: list, index: int) -> tuple[Any, list, int]:
    """Queue round `index` on the conversation so far: (its stream, its choice state, prompt tokens)."""
    st = r.st
    parser = make_parser(st.tool_parser_name, r.tools)
    prompt_text = st.render_chat(conv, r.tools, True, False, r.template_kwargs)
    in_reasoning = st.reasoning and prompt_opens_reasoning(prompt_text)
    ids = await L.encode(st, prompt_text, "messages", generate=True, add_special_tokens=False)
    rstream = await S._add(st, {"prompt_token_ids": ids, "prompt": prompt_text}, r.params,
                           f"{r.meta['id']}-r{index}", r.seats)
    rstream.merge = False  # a tool call may end the reply mid-delta
    r.streams.append(rstream)
    return rstream, [S._ChoiceState(st.reasoning, in_reasoning, parser, "")], len(ids)


def _finish(r: ChatRounds) -> None:
    for s in r.streams:
        s.abort()


async def chat_rounds(request: web.Request, r: ChatRounds, stream: bool) -> web.StreamResponse:
    try:
        if stream:
            return await _rounds_stream(request, r)
        return await _rounds_full(r)
    finally:
        _finish(r)


async def _rounds_full(r: ChatRounds) -> web.Response:
    st, hub = r.st, r.hub
    conv = list(r.messages)
    rounds: list[dict] = []
    totals = _Totals()
    rstream, choices, n_prompt = r.rstream, r.choices, r.n_prompt
    for index in range(hub.max_rounds + 1):
        try:
            result, n_out, cached, prompt_lps = await S._chat_collect(st, rstream, r.t0, choices, r.want_logprobs,
                                                                      r.k)
        except (EngineStepError, EngineDeadError) as e:
            raise S._engine_error(e) from None
        rstream.abort()
        totals.prompt += n_prompt
        totals.out += n_out
        totals.cached += cached
        choice = result[0]
        calls = _mcp_calls(hub, choice["message"])
        if not calls or index == hub.max_rounds:
            if calls:  # the cap: the calls are not run
                choice["finish_reason"] = "length"
            break
        tool_msgs = await _run_calls(hub, calls)
        rounds.append({"message": choice["message"], "tool_results": tool_msgs})
        conv += _conversation_turn(choice["message"], tool_msgs)
        rstream, choices, n_prompt = await _next_round(r, conv, index + 1)
    m = r.meta
    body = {"id": m["id"], "object": "chat.completion", "created": m["created"], "model": m["model"],
            "system_fingerprint": m["system_fingerprint"], "choices": [choice], "usage": totals.usage(),
            "mcp_rounds": rounds}
    if prompt_lps is not None:
        body["prompt_logprobs"] = S._prompt_logprobs_json(prompt_lps)
    return S._json_response(body)


async def _rounds_stream(request: web.Request, r: ChatRounds) -> web.StreamResponse:
    resp = await S._start_sse(request)
    try:
        return await _round_events(resp, r)
    except ConnectionResetError:  # the client went away; the rounds' streams are aborted by the caller
        return resp


async def _round_events(resp, r: ChatRounds) -> web.StreamResponse:
    st, hub = r.st, r.hub
    frame = S._chat_frame(r.meta, r.include_usage)
    chunk = frame.choice
    opening = chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None})
    await resp.write(opening)
    conv = list(r.messages)
    totals = _Totals()
    rstream, choices, n_prompt = r.rstream, r.choices, r.n_prompt
    offset = 0
    try:
        for index in range(hub.max_rounds + 1):
            n_out, cached = await S._chat_round_events(resp, st, rstream, r.t0, chunk, choices, r.want_logprobs,
                                                       r.k, defer_end=True, call_offset=offset)
            rstream.abort()
            totals.prompt += n_prompt
            totals.out += n_out
            totals.cached += cached
            c = choices[0]
            msg = S._message(c, c.ts.content if c.ts is not None else "")
            calls = _mcp_calls(hub, msg)
            if not calls or index == hub.max_rounds:
                await resp.write(chunk(S._end_chunk(c, 0, "length" if calls else None)))
                break
            offset += len(calls)
            tool_msgs = await _run_calls(hub, calls)
            await resp.write(b"".join(chunk({"index": 0, "delta": t, "logprobs": None, "finish_reason": None})
                                      for t in tool_msgs))
            conv += _conversation_turn(msg, tool_msgs)
            rstream, choices, n_prompt = await _next_round(r, conv, index + 1)
            await resp.write(opening)
        if r.include_usage:
            await resp.write(frame.usage(totals.usage()))
    except (EngineStepError, EngineDeadError) as e:
        await resp.write(S._sse(S._engine_error(e).to_dict()))
    except APIError as e:  # a later round that cannot be queued (e.g. the conversation outgrew the context)
        await resp.write(S._sse(e.to_dict()))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp
