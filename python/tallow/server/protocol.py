"""OpenAI request bodies -> validated values (SamplingParams, chat messages, tools); every problem
is an APIError 400 naming the field. No HTTP or engine calls here."""
from __future__ import annotations

import math
import re
from typing import Any, Optional

from tallow.engine.sampling_params import SamplingParams
from tallow.engine.structured_output import StructuredOutputsParams
from tallow.server.errors import APIError, bad_request
from tallow.server.request_body import json_type as _json_type
from tallow.server.request_body import read_json  # noqa: F401 - the handlers call it as P.read_json

_MISSING = object()
MAX_N = 128
MAX_STOP = 64
MAX_LOGPROBS = 20
_INT64 = 2**63


# -- typed fields ------------------------------------------------------------------------------
def get_field(body: dict, name: str, kind: str, default: Any = None, *, lo=None, hi=None, lo_open: bool = False,
              choices=None, param: Optional[str] = None) -> Any:
    """body[name] checked as kind (int, float, bool, str, list, dict); null or absent gives default."""
    param = param or name
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if kind == "int":
        if isinstance(v, float) and v.is_integer() and abs(v) < 2**53:
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool):
            raise bad_request(f"'{param}' must be an integer, got {_json_type(v)}", param)
    elif kind == "float":
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise bad_request(f"'{param}' must be a number, got {_json_type(v)}", param)
        v = float(v)
        if not math.isfinite(v):
            raise bad_request(f"'{param}' must be a finite number", param)
    elif kind == "bool":
        if not isinstance(v, bool):
            raise bad_request(f"'{param}' must be a boolean, got {_json_type(v)}", param)
    elif kind == "str":
        if not isinstance(v, str):
            raise bad_request(f"'{param}' must be a string, got {_json_type(v)}", param)
    elif kind == "list":
        if not isinstance(v, list):
            raise bad_request(f"'{param}' must be an array, got {_json_type(v)}", param)
    elif kind == "dict":
        if not isinstance(v, dict):
            raise bad_request(f"'{param}' must be an object, got {_json_type(v)}", param)
    else:  # pragma: no cover
        raise AssertionError(kind)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise bad_request(f"'{param}' must be {'>' if lo_open else '>='} {lo}, got {v}", param)
    if hi is not None and v > hi:
        raise bad_request(f"'{param}' must be <= {hi}, got {v}", param)
    if choices is not None and v not in choices:
        raise bad_request(f"'{param}' must be one of {', '.join(map(str, choices))}; got {v!r}", param)
    return v


class ServedNames(list):
    """The served model names (--served-model-name) and whether a request must name one of them
    (--strict-model-name); ServerConfig holds its model_names as one, so every check_model honours it."""

    def __init__(self, names, strict: bool = False):
        super().__init__(names)
        self.strict = strict


def check_model(body: dict, names: list[str]) -> str:
    """The model name a response reports: the request's when it names a served model (vLLM), the first
    served name when it names none, or names another model and the server is not strict (candle-vllm and
    llama-server answer any name with their one model); strict: 404 for another model."""
    model = body.get("model")
    if model is None:
        return names[0]
    if not isinstance(model, str):
        raise bad_request(f"'model' must be a string, got {_json_type(model)}", "model")
    if model not in names:
        if not getattr(names, "strict", False):
            return names[0]
        raise APIError(f"the model '{model[:200]}' does not exist; this server serves: {', '.join(names)}", 404,
                       type="invalid_request_error", param="model", code="model_not_found")
    return model


def _stop_list(body: dict) -> Optional[list[str]]:
    stop = body.get("stop")
    if stop is None:
        return None
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list):
        raise bad_request(f"'stop' must be a string or an array of strings, got {_json_type(stop)}", "stop")
    if len(stop) > MAX_STOP:
        raise bad_request(f"'stop' may hold at most {MAX_STOP} strings, got {len(stop)}", "stop")
    for s in stop:
        if not isinstance(s, str):
            raise bad_request(f"'stop' must be a string or an array of strings; found {_json_type(s)}", "stop")
        if not s:
            raise bad_request("'stop' strings must not be empty", "stop")
    return stop or None


def sampling_params(body: dict, *, max_model_len: int, default_max_tokens: Optional[int], logprobs: Optional[int],
                    skip_special_tokens: bool = True, vocab_size: int = 0) -> SamplingParams:
    """The sampling fields shared by chat and completions (OpenAI's plus vLLM's extensions); token ids
    (logit_bias) are checked against vocab_size when it is given."""
    max_tokens = get_field(body, "max_completion_tokens", "int", lo=1, hi=_INT64)
    if max_tokens is None:
        max_tokens = get_field(body, "max_tokens", "int", lo=1, hi=_INT64)
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens is not None:
        max_tokens = min(max_tokens, max_model_len)
    seed = get_field(body, "seed", "int", lo=-_INT64, hi=2**64 - 1)
    if seed is not None:
        seed &= _INT64 - 1  # the engine's generators take non-negative seeds
    stop_token_ids = get_field(body, "stop_token_ids", "list")
    if stop_token_ids is not None and not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31
                                              for t in stop_token_ids):
        raise bad_request("'stop_token_ids' must be an array of token ids", "stop_token_ids")
    kw = dict(
        n=get_field(body, "n", "int", 1, lo=1, hi=MAX_N),
        # unset (None): the model's generation_config.json or the usual default (engine's InputProcessor)
        temperature=get_field(body, "temperature", "float", None, lo=0.0, hi=2.0),
        top_p=get_field(body, "top_p", "float", None, lo=0.0, hi=1.0, lo_open=True),
        top_k=get_field(body, "top_k", "int", None, lo=-1, hi=2**31),
        min_p=get_field(body, "min_p", "float", None, lo=0.0, hi=1.0),
        repetition_penalty=get_field(body, "repetition_penalty", "float", None, lo=0.0, hi=100.0, lo_open=True),
        frequency_penalty=get_field(body, "frequency_penalty", "float", None, lo=-2.0, hi=2.0),
        presence_penalty=get_field(body, "presence_penalty", "float", None, lo=-2.0, hi=2.0),
        seed=seed,
        max_tokens=max_tokens,
        min_tokens=get_field(body, "min_tokens", "int", 0, lo=0, hi=_INT64),
        stop=_stop_list(body),
        stop_token_ids=stop_token_ids,
        ignore_eos=get_field(body, "ignore_eos", "bool", False),
        logprobs=logprobs,
        skip_special_tokens=get_field(body, "skip_special_tokens", "bool", skip_special_tokens),
        include_stop_str_in_output=get_field(body, "include_stop_str_in_output", "bool", False),
    )
    if kw["max_tokens"] is not None and kw["min_tokens"] > kw["max_tokens"]:
        raise bad_request(f"'min_tokens' ({kw['min_tokens']}) must not exceed max_tokens ({kw['max_tokens']})",
                          "min_tokens")
    kw["logit_bias"] = _logit_bias(body, vocab_size)
    kw["structured_outputs"] = structured_outputs(body)
    kw["prompt_logprobs"] = get_field(body, "prompt_logprobs", "int", None, lo=0, hi=MAX_LOGPROBS)  # vLLM's
    best_of = get_field(body, "best_of", "int", lo=1, hi=MAX_N)
    if best_of is not None and best_of != kw["n"]:
        raise bad_request("'best_of' other than n is not supported", "best_of")
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        raise bad_request(str(e)) from None


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs(body: dict) -> Optional[StructuredOutputsParams]:
    """The output constraint of a request, from OpenAI's response_format (json_object, json_schema),
    vLLM's structured_outputs object or its older guided_json / guided_regex / guided_choice /
    guided_grammar fields; at most one of them. Grammars are checked later, against the tokenizer."""
    found: list[tuple[str, dict]] = []
    rf = get_field(body, "response_format", "dict")
    if rf is not None:
        kind = rf.get("type", "text")
        if kind == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            schema = js.get("schema") if isinstance(js, dict) else None
            if not isinstance(schema, dict):
                raise bad_request("response_format json_schema needs 'json_schema': {'name': ..., 'schema': {...}}",
                                  "response_format")
            found.append(("response_format", {"json": schema}))
        elif kind != "text":
            raise bad_request(f"response_format type must be text, json_object or json_schema; got "
                              f"{str(kind)[:40]!r}", "response_format")
    so = get_field(body, "structured_outputs", "dict")
    if so is not None:
        fields = {k: v for k, v in so.items() if k in ("json", "regex", "choice", "grammar", "json_object")
                  and v not in (None, False)}
        if len(fields) != 1:
            raise bad_request("'structured_outputs' needs exactly one of json, regex, choice, grammar, json_object",
                              "structured_outputs")
        found.append(("structured_outputs", fields))
    for name, key in _GUIDED.items():
        if body.get(name) is not None:
            found.append((name, {key: body[name]}))
    if not found:
        return None
    if len(found) > 1:
        raise bad_request(f"only one output constraint per request; got {', '.join(n for n, _ in found)}",
                          found[1][0])
    name, fields = found[0]
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as e:
        raise bad_request(f"'{name}': {e}", name) from None


def _logit_bias(body: dict, vocab_size: int) -> Optional[dict[int, float]]:
    """logit_bias as {token id: bias}: JSON keys are strings of token ids (below vocab_size when it is
    given), values numbers in [-100, 100]."""
    raw = get_field(body, "logit_bias", "dict")
    if not raw:
        return None
    out = {}
    for k, v in raw.items():
        if not (isinstance(k, str) and k.isascii() and k.isdigit() and len(k) < 19):
            raise bad_request(f"'logit_bias' keys must be token ids (strings of digits), got {k!r}", "logit_bias")
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or not -100 <= v <= 100:
            raise bad_request(f"'logit_bias' values must be numbers in [-100, 100], got {_json_type(v)} "
                              f"{v!r} for token {k}", "logit_bias")
        if vocab_size and int(k) >= vocab_size:
            raise bad_request(f"'logit_bias' token id {k} is out of range: this model's vocabulary has ids "
                              f"0..{vocab_size - 1}", "logit_bias")
        out[int(k)] = float(v)
    return out


def stream_options(body: dict, stream: bool) -> bool:
    """include_usage of stream_options (only valid with stream)."""
    opts = get_field(body, "stream_options", "dict")
    if opts is None:
        return False
    if not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    return bool(get_field(opts, "include_usage", "bool", False, param="stream_options.include_usage"))


# -- chat messages -----------------------------------------------------------------------------
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")


def _content_text(content: Any, param: str) -> Optional[str]:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
                continue
            if not isinstance(part, dict):
                raise bad_request(f"'{param}[{k}]' must be a content part object", param)
            kind = part.get("type")
            if kind in ("text", "input_text"):
                text = part.get("text")
                if not isinstance(text, str):
                    raise bad_request(f"'{param}[{k}].text' must be a string", param)
                parts.append(text)
            elif kind == "refusal" and isinstance(part.get("refusal"), str):
                parts.append(part["refusal"])
            else:
                raise bad_request(f"content parts of type {str(kind)[:40]!r} are not supported by this model: "
                                  "only text", param)
        return "\n".join(parts)
    raise bad_request(f"'{param}' must be a string, an array of content parts or null; got {_json_type(content)}",
                      param)


def chat_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("'messages' must be a non-empty array of message objects", "messages")
    out = []
    for i, m in enumerate(msgs):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"'{p}' must be an object with 'role' and 'content'", p)
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"'{p}.role' must be one of {', '.join(ROLES)}; got {str(role)[:40]!r}", f"{p}.role")
        msg = {k: v for k, v in m.items() if k not in ("role", "content")}
        msg["role"] = "system" if role == "developer" else role
        content = _content_text(m.get("content"), f"{p}.content")
        if content is None and role not in ("assistant",):
            raise bad_request(f"'{p}.content' is required for {role} messages", f"{p}.content")
        # an assistant turn of tool calls only: "" rather than None, which some templates cannot render
        # (SmolLM2's applies a string filter) and every template treats alike when testing for content
        msg["content"] = "" if content is None else content
        if "name" in m and m["name"] is not None and not isinstance(m["name"], str):
            raise bad_request(f"'{p}.name' must be a string", f"{p}.name")
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = _history_tool_calls(m["tool_calls"], f"{p}.tool_calls")
        if role == "tool" and m.get("tool_call_id") is not None and not isinstance(m["tool_call_id"], str):
            raise bad_request(f"'{p}.tool_call_id' must be a string", f"{p}.tool_call_id")
        for key in ("reasoning_content", "reasoning"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise bad_request(f"'{p}.{key}' must be a string", f"{p}.{key}")
        out.append(msg)
    return out


_RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                             "tokenize", "chat_template", "bos_token", "eos_token"}


def template_kwargs(body: dict) -> dict:
    """chat_template_kwargs: extra variables for the chat template (e.g. enable_thinking)."""
    kw = dict(get_field(body, "chat_template_kwargs", "dict", {}))
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(kw))
    if reserved:
        raise bad_request(f"'chat_template_kwargs' may not set {', '.join(reserved)}", "chat_template_kwargs")
    return kw


def _history_tool_calls(calls: Any, param: str) -> list[dict]:
    if not isinstance(calls, list):
        raise bad_request(f"'{param}' must be an array", param)
    out = []
    for k, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"'{param}[{k}]' must be {{'id', 'type': 'function', 'function': {{'name', "
                              "'arguments'}}}", param)
        args = fn.get("arguments", "{}")
        if not isinstance(args, (str, dict)):
            raise bad_request(f"'{param}[{k}].function.arguments' must be a JSON string", param)
        call = {"type": "function", **c, "function": {**fn, "arguments": args}}
        if call.get("id") is not None and not isinstance(call["id"], str):
            raise bad_request(f"'{param}[{k}].id' must be a string", param)
        out.append(call)
    return out


def chat_tools(body: dict) -> tuple[Optional[list[dict]], Any]:
    """(tools, tool_choice) where tool_choice is "none", "auto", "required" or a function name."""
    tools = body.get("tools")
    if tools is None:
        functions = body.get("functions")  # the legacy field
        if isinstance(functions, list):
            tools = [{"type": "function", "function": f} for f in functions]
    choice = body.get("tool_choice")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("'tools' must be an array of {'type': 'function', 'function': {...}}", "tools")
        if not tools:
            tools = None
    checked = []
    for k, t in enumerate(tools or []):
        p = f"tools[{k}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise bad_request(f"'{p}' must be {{'type': 'function', 'function': {{'name', 'description', "
                              "'parameters'}}}}", p)
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise bad_request(f"'{p}.function.name' must be 1-128 letters, digits, _ . : or -", f"{p}.function.name")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad_request(f"'{p}.function.parameters' must be a JSON schema object", f"{p}.function.parameters")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise bad_request(f"'{p}.function.description' must be a string", f"{p}.function.description")
        checked.append({"type": "function", "function": fn})
    tools = checked or None
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_request("'tool_choice' must be none, auto, required or {'type': 'function', 'function': "
                              "{'name': ...}}", "tool_choice")
        if choice == "required" and not tools:
            raise bad_request("'tool_choice' required needs 'tools'", "tool_choice")
        return tools, choice
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise bad_request("'tool_choice' must name a function: {'type': 'function', 'function': {'name': ...}}",
                              "tool_choice")
        if not tools or name not in {t["function"]["name"] for t in tools}:
            raise bad_request(f"'tool_choice' names the function {name[:100]!r}, which is not in 'tools'", "tool_choice")
        return tools, {"name": name}
    raise bad_request("'tool_choice' must be a string or an object", "tool_choice")


def prompt_inputs(value: Any, param: str = "prompt") -> list:
    """A completions prompt / embeddings input: a string, an array of strings, an array of token
    ids, or an array of arrays of token ids -> a list of (str | list[int])."""
    def is_ids(v):
        return isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v)

    if isinstance(value, str):
        return [value]
    if is_ids(value):
        return [value]
    if isinstance(value, list) and value:
        out = []
        for k, item in enumerate(value):
            if isinstance(item, str) or is_ids(item):
                out.append(item)
            else:
                raise bad_request(f"'{param}[{k}]' must be a string or an array of token ids", param)
        return out
    raise bad_request(f"'{param}' must be a non-empty string, an array of strings or an array of token ids", param)
