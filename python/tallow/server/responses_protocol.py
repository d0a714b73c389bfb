"""OpenAI Responses API request bodies -> the chat path's values: input items become chat messages,
Responses-style function tools become chat tools, text.format becomes response_format, and the
sampling fields become the body that protocol.sampling_params reads. Every problem is an APIError 400
naming the field; nothing here touches HTTP or the engine."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from tallow.server import protocol as P
from tallow.server.errors import bad_request
from tallow.server.request_body import json_type

# vLLM's sampling extensions that its Responses endpoint also takes (extra_body): passed on as they are
_SAMPLING_EXTRAS = ("top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "seed", "stop",
                    "stop_token_ids", "ignore_eos", "min_tokens", "logit_bias", "skip_special_tokens",
                    "include_stop_str_in_output", "structured_outputs", "guided_json", "guided_regex",
                    "guided_choice", "guided_grammar")
_TEXT_PART_TYPES = ("input_text", "output_text", "text")
_ROLES = ("user", "system", "developer", "assistant")


@dataclasses.dataclass
class ResponsesRequest:
    model: str
    messages: list[dict]  # this request's input as chat messages (validated by protocol.chat_messages)
    instructions: Optional[str]
    tools: Optional[list[dict]]  # chat shape: {"type": "function", "function": {...}}
    tool_choice: Any  # chat's: "none", "auto", "required" or {"name": ...}
    stream: bool
    store: bool
    previous_response_id: Optional[str]
    sampling_body: dict  # what protocol.sampling_params reads (chat field names)
    echo: dict  # the request's fields as the Response object repeats them


def parse_request(body: dict, model_names: list[str]) -> ResponsesRequest:
    model = P.check_model(body, model_names)
    for name, why in (("background", "background responses are not supported"),
                      ("conversation", "conversations are not supported; use previous_response_id"),
                      ("prompt", "prompt templates are not supported; send 'input'")):
        if body.get(name) not in (None, False):
            raise bad_request(f"'{name}': {why}", name)
    if body.get("top_logprobs"):
        raise bad_request("'top_logprobs' is not supported on /v1/responses; use /v1/chat/completions", "top_logprobs")
    stream = P.get_field(body, "stream", "bool", False)
    store = P.get_field(body, "store", "bool", True)
    instructions = P.get_field(body, "instructions", "str")
    prev = P.get_field(body, "previous_response_id", "str")
    metadata = P.get_field(body, "metadata", "dict")
    if metadata is not None and (len(metadata) > 16 or not all(isinstance(k, str) and isinstance(v, str)
                                                               for k, v in metadata.items())):
        raise bad_request("'metadata' must map at most 16 string keys to string values", "metadata")
    reasoning = P.get_field(body, "reasoning", "dict")  # accepted; the effort is the model's own
    parallel = P.get_field(body, "parallel_tool_calls", "bool", True)
    user = P.get_field(body, "user", "str")
    if "input" not in body or body["input"] is None:
        raise bad_request("'input' is required: a string or an array of input items", "input")
    messages = input_messages(body["input"])
    resp_tools = _response_tools(body)
    tools, tool_choice = P.chat_tools({"tools": [{"type": "function", "function": _chat_function(t)}
                                                 for t in resp_tools] or None,
                                       "tool_choice": _chat_tool_choice(body.get("tool_choice"))})
    max_out = P.get_field(body, "max_output_tokens", "int", lo=1, hi=2**63)
    sampling = {k: body[k] for k in _SAMPLING_EXTRAS if k in body}
    sampling.update(temperature=body.get("temperature"), top_p=body.get("top_p"), max_tokens=max_out,
                    parallel_tool_calls=parallel)
    text = P.get_field(body, "text", "dict", {})
    fmt = _text_format(text)
    if fmt is not None:
        sampling["response_format"] = fmt
    echo = {
        "instructions": instructions, "max_output_tokens": max_out, "metadata": metadata or {},
        "parallel_tool_calls": parallel, "previous_response_id": prev,
        "reasoning": {"effort": (reasoning or {}).get("effort"), "summary": None},
        "store": store, "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "text": {"format": text.get("format") or {"type": "text"}},
        "tool_choice": _echo_tool_choice(tool_choice), "tools": resp_tools, "truncation": "disabled", "user": user,
    }
    return ResponsesRequest(model, messages, instructions, tools, tool_choice, stream, store, prev, sampling, echo)


# -- input items -----------------------------------------------------------------------------------
def input_messages(value: Any) -> list[dict]:
    """'input' (a string or a list of items) -> validated chat messages. Function calls join the assistant
    message before them (or make one); their outputs become tool messages; reasoning items are dropped
    (chat templates leave earlier turns' thinking out)."""
    if isinstance(value, str):
        return P.chat_messages({"messages": [{"role": "user", "content": value}]})
    if not isinstance(value, list) or not value:
        raise bad_request(f"'input' must be a string or a non-empty array of input items, got {json_type(value)}",
                          "input")
    msgs: list[dict] = []
    for i, item in enumerate(value):
        p = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"'{p}' must be an input item object", p)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise bad_request(f"'{p}.role' must be one of {', '.join(_ROLES)}; got {str(role)[:40]!r}", f"{p}.role")
            msgs.append({"role": role, "content": _content(item.get("content"), f"{p}.content")})
        elif kind == "function_call":
            call = {"id": _str(item, "call_id", p), "type": "function",
                    "function": {"name": _str(item, "name", p), "arguments": _str(item, "arguments", p)}}
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})  # "": simple templates add it
        elif kind == "function_call_output":
            out = item.get("output")
            text = out if isinstance(out, str) else _content(out, f"{p}.output")
            msgs.append({"role": "tool", "tool_call_id": _str(item, "call_id", p), "content": text})
        elif kind == "reasoning":
            continue
        else:
            raise bad_request(f"input items of type {str(kind)[:40]!r} are not supported: only message, "
                              "function_call, function_call_output and reasoning", f"{p}.type")
    return P.chat_messages({"messages": msgs})


def _str(item: dict, key: str, p: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise bad_request(f"'{p}.{key}' must be a string, got {json_type(v)}", f"{p}.{key}")
    return v


def _content(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"'{param}' must be a string or an array of content parts, got {json_type(content)}", param)
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PART_TYPES and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise bad_request(f"'{param}[{k}]': content parts of type {str(kind)[:40]!r} are not supported by this "
                              "model: only input_text and output_text", param)
    return "".join(texts)


# -- tools -------------------------------------------------------------------------------------------
def _response_tools(body: dict) -> list[dict]:
    """Responses-style function tools ({"type": "function", "name", "description", "parameters"}), as echoed."""
    tools = P.get_field(body, "tools", "list", [])
    out = []
    for k, t in enumerate(tools):
        p = f"tools[{k}]"
        if not isinstance(t, dict):
            raise bad_request(f"'{p}' must be a tool object", p)
        kind = t.get("type")
        if kind != "function":
            raise bad_request(f"tools of type {str(kind)[:40]!r} are not supported: only 'function' tools", p)
        if isinstance(t.get("function"), dict):  # the chat shape sent here by mistake
            raise bad_request(f"'{p}': Responses tools put name, description and parameters at the top level, not "
                              "under 'function'", p)
        name = t.get("name")
        if not isinstance(name, str) or not P._NAME_RE.match(name):
            raise bad_request(f"'{p}.name' must be 1-128 letters, digits, _ . : or -", f"{p}.name")
        for key, kind in (("description", str), ("parameters", dict)):
            if t.get(key) is not None and not isinstance(t[key], kind):
                raise bad_request(f"'{p}.{key}' must be {'a string' if kind is str else 'a JSON schema object'}",
                                  f"{p}.{key}")
        # strict is echoed as sent: the arguments follow the schema only as far as the model does
        out.append({"type": "function", "name": name, "description": t.get("description"),
                    "parameters": t.get("parameters"), "strict": t.get("strict")})
    return out


def _chat_function(t: dict) -> dict:
    fn = {"name": t["name"]}
    for key in ("description", "parameters"):
        if t.get(key) is not None:
            fn[key] = t[key]
    return fn


def _chat_tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "function":
            return {"type": "function", "function": {"name": choice.get("name")}}
        raise bad_request(f"'tool_choice' of type {str(kind)[:40]!r} is not supported: use none, auto, required or "
                          "{'type': 'function', 'name': ...}", "tool_choice")
    raise bad_request(f"'tool_choice' must be a string or an object, got {json_type(choice)}", "tool_choice")


def _echo_tool_choice(choice: Any) -> Any:
    return {"type": "function", "name": choice["name"]} if isinstance(choice, dict) else choice


# -- text.format ---------------------------------------------------------------------------------------
def _text_format(text: dict) -> Optional[dict]:
    """text.format -> the chat path's response_format (None for plain text)."""
    fmt = P.get_field(text, "format", "dict", param="text.format")
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("'text.format.schema' must be a JSON schema object", "text.format.schema")
        spec = {"name": fmt.get("name") or "response", "schema": fmt["schema"], "strict": fmt.get("strict", False)}
        if fmt.get("description") is not None:
            spec["description"] = fmt["description"]
        return {"type": "json_schema", "json_schema": spec}
    raise bad_request(f"'text.format.type' must be text, json_object or json_schema; got {str(kind)[:40]!r}",
                      "text.format")
