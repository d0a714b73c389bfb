"""Tool-call parsers: model output text -> (content, tool calls), for whole texts and for streams.

Formats (names for --enforce-parser):
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Mistral v3 / Nemo) and
  ``[TOOL_CALLS]name[ARGS]{...}`` (v11+; ``name[CALL_ID]id[ARGS]{...}`` too), several calls per message.
- ``llama``: Llama 3.1's custom format ``<function=name>{...}</function>`` (also Functionary v3.1).
- ``llama3_json``: Llama 3.x JSON, ``{"name": ..., "parameters": {...}}``, optionally after
  ``<|python_tag|>``, several separated by ``;``.
- ``hermes`` (alias ``qwen``): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes 2/3,
  Qwen 2.5 / 3).
- ``qwen3_coder``: ``<tool_call><function=name><parameter=p>value</parameter>...</function></tool_call>``;
  values are typed by the tool's JSON schema.
- ``json``: generic JSON: the reply is a call object, an array of them or ``{"tool_calls": [...]}``,
  optionally in a ```json fence.

Every parser has one method, ``parse(text, final)``, returning the content and the calls seen so far.
While streaming (final=False) it must be *prefix-stable*: the content and each call's arguments
text only ever grow, so a stream can send the difference after each delta (``ToolCallStream``).
Arguments are the model's own JSON text (not re-serialised), so the concatenated argument
fragments of a stream equal the non-streamed arguments exactly.
"""
from __future__ import annotations

import dataclasses
import json
import math
import secrets
import string
from typing import Any, Optional

__all__ = ["PARSERS", "ToolParser", "ToolCallStream", "ForcedToolCallStream", "PartialCall", "make_parser",
           "detect_parser", "parser_names", "parse_tool_calls"]

_WS = " \t\r\n"


@dataclasses.dataclass
class PartialCall:
    name: Optional[str] = None  # None until the whole name is known
    args: str = ""  # arguments JSON text known so far (grows while streaming)
    done: bool = False
    id: Optional[str] = None


# -- JSON scanning helpers ---------------------------------------------------------------------
def _skip_ws(s: str, i: int) -> int:
    n = len(s)
    while i < n and s[i] in _WS:
        i += 1
    return i


def _scan_string(s: str, i: int) -> Optional[int]:
    """s[i] is '"': the index after the closing quote, or None when the string is unfinished."""
    j, n = i + 1, len(s)
    while j < n:
        c = s[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def _scan_value(s: str, i: int, final: bool) -> Optional[int]:
    """End (exclusive) of the JSON value starting at s[i], or None when it is unfinished."""
    n = len(s)
    if i >= n:
        return None
    c = s[i]
    if c == '"':
        return _scan_string(s, i)
    if c in "{[":
        depth, j = 0, i
        while j < n:
            c = s[j]
            if c == '"':
                e = _scan_string(s, j)
                if e is None:
                    return None
                j = e
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < n and s[j] not in ",}] \t\r\n;":
        j += 1
    if j == n and not final:
        return None  # a number or literal may go on
    return j if j > i else None


def _partial_string(raw: str) -> str:
    """The decoded text of an unfinished JSON string literal (raw starts after the opening quote),
    stopping before an unfinished escape."""
    out, i, n = [], 0, len(raw)
    while i < n:
        c = raw[i]
        if c == "\\":
            if i + 1 >= n:
                break
            e = raw[i + 1]
            if e == "u":
                if i + 6 > n:
                    break
                try:
                    cp = int(raw[i + 2:i + 6], 16)
                except ValueError:
                    break
                if 0xD800 <= cp < 0xDC00:  # a surrogate pair needs its second half
                    if i + 12 > n:
                        break
                    try:
                        out.append(json.loads('"' + raw[i:i + 12] + '"'))
                    except ValueError:
                        break
                    i += 12
                    continue
                out.append(chr(cp))
                i += 6
                continue
            out.append({"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f"}.get(e, e))
            i += 2
            continue
        out.append(c)
        i += 1
    return "".join(out)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _partial_suffix(text: str, markers) -> int:
    """Length of the longest end of text that is the start of a marker (it may become one)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), 0, -1):
            if k > best and text.endswith(m[:k]):
                best = k
                break
    return best


def _args_value(s: str, vs: int, ve: Optional[int]) -> str:
    """Arguments text from the value at s[vs:ve] (ve None: unfinished)."""
    if vs >= len(s):
        return ""
    if s[vs] == '"':  # arguments given as a JSON string holding JSON
        if ve is not None:
            try:
                v = json.loads(s[vs:ve])
            except ValueError:
                return ""
            return v if isinstance(v, str) else json.dumps(v)
        return _partial_string(s[vs + 1:])
    if ve is None:
        return s[vs:] if s[vs] in "{[" else ""
    raw = s[vs:ve]
    return "{}" if raw == "null" else raw


_NAME_KEYS = ("name",)
_ARG_KEYS = ("arguments", "parameters")


def parse_call_object(s: str, i: int, final: bool) -> tuple[PartialCall, Optional[int], bool]:
    """Parse the call object starting at s[i] == '{'. Returns (call so far, end index or None when
    unfinished, ok): ok is False when the text is not a call object."""
    call = PartialCall()
    j = _skip_ws(s, i + 1)
    args_seen = False
    n = len(s)
    while True:
        if j >= n:
            return call, None, True
        if s[j] == "}":
            call.done = True
            if not args_seen:
                call.args = "{}"
            return call, j + 1, call.name is not None
        if s[j] != '"':
            return call, None, False
        ke = _scan_string(s, j)
        if ke is None:
            return call, None, True
        try:
            key = json.loads(s[j:ke])
        except ValueError:
            return call, None, False
        j = _skip_ws(s, ke)
        if j >= n:
            return call, None, True
        if s[j] != ":":
            return call, None, False
        vs = _skip_ws(s, j + 1)
        if vs >= n:
            return call, None, True
        ve = _scan_value(s, vs, final)
        if key in _NAME_KEYS and call.name is None:
            if ve is not None:
                try:
                    name = json.loads(s[vs:ve])
                except ValueError:
                    return call, None, False
                if not isinstance(name, str):
                    return call, None, False
                call.name = name
        elif key in _ARG_KEYS and not args_seen:
            args_seen = True
            call.args = _args_value(s, vs, ve)
        elif key == "id" and ve is not None:
            try:
                cid = json.loads(s[vs:ve])
            except ValueError:
                cid = None
            if isinstance(cid, str) and cid:
                call.id = cid
        if ve is None:
            return call, None, True
        j = _skip_ws(s, ve)
        if j >= n:
            return call, None, True
        if s[j] == ",":
            j = _skip_ws(s, j + 1)
        elif s[j] != "}":
            return call, None, False


# -- parsers -----------------------------------------------------------------------------------
class ToolParser:
    name = "base"
    markers: tuple[str, ...] = ()
    # What may follow a complete call when another call comes next: closing text (an end tag, a
    # separator) and the start of the next call. A forced reply ends at anything else.
    closers: tuple[str, ...] = ()
    openers: tuple[str, ...] = ()

    def __init__(self, tools: Optional[list[dict]] = None):
        self.tools: dict[str, dict] = {}
        for t in tools or []:
            fn = t.get("function", t) if isinstance(t, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                self.tools[fn["name"]] = fn

    def parse(self, text: str, final: bool) -> tuple[str, list[PartialCall]]:
        raise NotImplementedError

    def forced_prefix(self, function: Optional[str]) -> str:
        """Text appended to the prompt to make the model call a tool (tool_choice required, or the
        named function): the start of a call in this format; for a named function, up to the "{"
        that opens its arguments (OpenAI's arguments are an object; small models otherwise drift)."""
        raise NotImplementedError

    def call_frame(self) -> Optional[tuple[str, str, str]]:
        """(text before a call's function name, between the name and the JSON arguments, after them)
        where this format writes arguments as one JSON object; None where it does not."""
        return None

    def call_grammar(self, tools: list[dict], function: Optional[str]) -> Optional[tuple[str, str]]:
        """(prompt suffix, Lark grammar of the rest) that constrains a forced reply to one call of one
        of the tools (or the named one) with arguments valid against the tool's JSON schema
        (structured output; engine/structured_output.py). None for formats without JSON arguments."""
        frame = self.call_frame()
        if frame is None:
            return None
        from tallow.engine.structured_output import lark_literal, with_whitespace_bound

        head, mid, tail = frame
        fns = [t["function"] for t in tools if function is None or t["function"]["name"] == function]
        rules = []
        for k, fn in enumerate(fns):
            schema = fn.get("parameters") or {"type": "object"}
            rules.append(f"call_{k}: {lark_literal(fn['name'] + mid)} %json "
                         f"{json.dumps(with_whitespace_bound(schema))} {lark_literal(tail)}")
        start = "start: " + " | ".join(f"call_{k}" for k in range(len(fns)))
        return head, "\n".join([start] + rules) + "\n"

    @staticmethod
    def new_call_id() -> str:
        return "call_" + secrets.token_hex(12)

    # shared: content before the first marker, held back while a marker may be starting
    def _split(self, text: str, final: bool) -> tuple[str, int]:
        at = min((i for i in (text.find(m) for m in self.markers) if i >= 0), default=-1)
        if at < 0:
            keep = len(text) if final else len(text) - _partial_suffix(text, self.markers)
            return text[:keep], -1
        return text[:at], at

    @staticmethod
    def _finish(text: str, content: str, calls: list[PartialCall], ok: bool, final: bool):
        if final and (not ok or not calls or any(c.name is None or not c.done for c in calls)):
            return text, []  # not a well-formed (or a cut-off) call: the whole reply is content
        return content, calls


class HermesParser(ToolParser):
    """<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call> (repeated)."""
    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"
    markers = openers = (start,)
    closers = (end,)

    def parse(self, text, final):
        content, at = self._split(text, final)
        if at < 0:
            return content, []
        calls, ok, pos = [], True, at
        while pos >= 0:
            p = _skip_ws(text, pos + len(self.start))
            if p >= len(text):
                break
            if text[p] != "{":
                ok = False
                break
            call, end, good = parse_call_object(text, p, final)
            if not good:
                ok = False
                break
            calls.append(call)
            if end is None:
                break
            pos = text.find(self.start, end)
        return self._finish(text, content, calls, ok, final)

    def forced_prefix(self, function):
        return '<tool_call>\n{"name": "' + (f'{function}", "arguments": {{' if function else "")

    def call_frame(self):
        return '<tool_call>\n{"name": "', '", "arguments": ', '}\n</tool_call>'


class MistralParser(ToolParser):
    """[TOOL_CALLS][{...}, ...]  or  [TOOL_CALLS]name[ARGS]{...} (also name[CALL_ID]id[ARGS]{...})."""
    name = "mistral"
    start = "[TOOL_CALLS]"
    markers = (start,)
    openers = (start, "{")
    closers = (",", "]")
    _ALNUM = string.ascii_letters + string.digits

    @classmethod
    def new_call_id(cls) -> str:  # Mistral's templates insist on 9 alphanumeric characters
        return "".join(secrets.choice(cls._ALNUM) for _ in range(9))

    def parse(self, text, final):
        content, at = self._split(text, final)
        if at < 0:
            return content, []
        calls: list[PartialCall] = []
        ok = True
        pos = at
        while pos >= 0:
            p = _skip_ws(text, pos + len(self.start))
            if p >= len(text):
                break
            if text[p] == "[":
                ok = self._parse_array(text, p, final, calls)
                break
            if text[p] == "{":
                call, end, good = parse_call_object(text, p, final)
                ok = good
                if good:
                    calls.append(call)
                if not good or end is None:
                    break
                pos = text.find(self.start, end)
                continue
            # name[ARGS]{...}
            a = text.find("[ARGS]", p)
            if a < 0:
                if final:
                    ok = False
                break
            head = text[p:a]
            cid = None
            if "[CALL_ID]" in head:
                head, cid = head.split("[CALL_ID]", 1)
            call = PartialCall(name=head.strip(), id=(cid or "").strip() or None)
            if not call.name:
                ok = False
                break
            vs = _skip_ws(text, a + len("[ARGS]"))
            ve = _scan_value(text, vs, final)
            call.args = _args_value(text, vs, ve)
            calls.append(call)
            if ve is None:
                break
            call.done = True
            pos = text.find(self.start, ve)
        return self._finish(text, content, calls, ok, final)

    @staticmethod
    def _parse_array(text, p, final, calls) -> bool:
        j = _skip_ws(text, p + 1)
        while j < len(text):
            if text[j] == "]":
                return True
            if text[j] != "{":
                return False
            call, end, good = parse_call_object(text, j, final)
            if not good:
                return False
            calls.append(call)
            if end is None:
                return True
            j = _skip_ws(text, end)
            if j < len(text) and text[j] == ",":
                j = _skip_ws(text, j + 1)
        return True

    def forced_prefix(self, function):
        return '[TOOL_CALLS][{"name": "' + (f'{function}", "arguments": {{' if function else "")

    def call_frame(self):
        return '[TOOL_CALLS][{"name": "', '", "arguments": ', '}]'


class LlamaFunctionParser(ToolParser):
    """<function=name>{...}</function> (Llama 3.1 custom tools, Functionary v3.1)."""
    name = "llama"
    start, end = "<function=", "</function>"
    markers = openers = (start,)
    closers = (end,)

    def parse(self, text, final):
        content, at = self._split(text, final)
        if at < 0:
            return content, []
        calls, ok, pos = [], True, at
        while pos >= 0:
            gt = text.find(">", pos)
            if gt < 0:
                if final:
                    ok = False
                break
            name = text[pos + len(self.start):gt].strip()
            if not name or "\n" in name:
                ok = False
                break
            call = PartialCall(name=name)
            calls.append(call)
            bs = _skip_ws(text, gt + 1)
            close = text.find(self.end, bs)
            if close < 0:
                cut = len(text) if final else len(text) - _partial_suffix(text, (self.end,))
                call.args = text[bs:max(cut, bs)].rstrip()
                if final:  # </function> left out: fine if the arguments are whole
                    call.args = call.args or "{}"
                    call.done = _is_json(call.args)
                break
            call.args = text[bs:close].rstrip() or "{}"
            call.done = True
            pos = text.find(self.start, close)
        return self._finish(text, content, calls, ok, final)

    def forced_prefix(self, function):
        return "<function=" + (f"{function}>{{" if function else "")

    def call_frame(self):
        return "<function=", ">", "</function>"


class _JsonReplyParser(ToolParser):
    """Shared by llama3_json and json: the whole reply is JSON call(s) or it is plain content."""
    prefixes: tuple[str, ...] = ()  # optional text before the JSON (e.g. <|python_tag|>)
    arg_key = "arguments"

    def _lead(self, text: str) -> tuple[int, bool]:
        """(index of the first JSON character after optional prefixes, still undecided)."""
        p = _skip_ws(text, 0)
        for pre in self.prefixes:
            if text.startswith(pre, p):
                p = _skip_ws(text, p + len(pre))
            elif pre.startswith(text[p:]) and p < len(text):
                return p, True  # a prefix may be starting
        return p, p >= len(text)

    def _known(self, name: Optional[str]) -> bool:
        return not self.tools or name in self.tools

    def parse(self, text, final):
        p, undecided = self._lead(text)
        if undecided:
            return (text, []) if final else ("", [])
        if text[p] not in "{[":
            return text, []  # an ordinary reply
        calls: list[PartialCall] = []
        ok = self._parse_calls(text, p, final, calls)
        if not ok or any(c.name is not None and not self._known(c.name) for c in calls):
            return text, []  # JSON, but not tool calls: the reply is content (this never changes later)
        if final and (not calls or any(c.name is None or not c.done for c in calls)):
            return text, []
        return "", calls

    def _parse_calls(self, text, p, final, calls) -> bool:
        if text[p] == "[":
            return MistralParser._parse_array(text, p, final, calls)
        while p < len(text):
            if text[p] == "`" and calls:
                return True  # a closing code fence
            if text[p] != "{":
                return False
            call, end, good = parse_call_object(text, p, final)
            if not good:
                return self._wrapped(text, p, final, calls)
            calls.append(call)
            if end is None:
                return True
            p = _skip_ws(text, end)
            if p < len(text) and text[p] in ";,":
                p = _skip_ws(text, p + 1)
        return True

    def _wrapped(self, text, p, final, calls) -> bool:
        return False

    def forced_prefix(self, function):
        return '{"name": "' + (f'{function}", "{self.arg_key}": {{' if function else "")

    def call_frame(self):
        return '{"name": "', f'", "{self.arg_key}": ', "}"


class Llama3JsonParser(_JsonReplyParser):
    """{"name": "f", "parameters": {...}} (optionally after <|python_tag|>; several joined by ;)."""
    name = "llama3_json"
    prefixes = ("<|python_tag|>",)
    markers = openers = ("<|python_tag|>", "{")
    closers = (";", ",")
    arg_key = "parameters"


class JsonParser(_JsonReplyParser):
    """A JSON call object, an array of them or {"tool_calls": [...]}, optionally in a ```json fence."""
    name = "json"
    prefixes = ("```json", "```")
    markers = ("```", "{", "[")
    openers = ("{",)
    closers = (",", ";", "]", "}", "```")

    def _lead(self, text):
        p = _skip_ws(text, 0)
        if text.startswith("```", p):
            nl = text.find("\n", p)
            if nl < 0:
                return p, True
            return _skip_ws(text, nl + 1), _skip_ws(text, nl + 1) >= len(text)
        if p < len(text) and "```".startswith(text[p:]):
            return p, True
        return p, p >= len(text)

    def _wrapped(self, text, p, final, calls) -> bool:
        # {"tool_calls": [ {...}, ... ]}
        j = _skip_ws(text, p + 1)
        key = '"tool_calls"'
        if not text.startswith(key, j):
            return False
        j = _skip_ws(text, j + len(key))
        if j >= len(text) or text[j] != ":":
            return j >= len(text)
        j = _skip_ws(text, j + 1)
        if j >= len(text):
            return True
        if text[j] != "[":
            return False
        return MistralParser._parse_array(text, j, final, calls)


class Qwen3CoderParser(ToolParser):
    """<tool_call>\\n<function=name>\\n<parameter=p>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>"""
    name = "qwen3_coder"
    markers = openers = ("<tool_call>", "<function=")
    closers = ("</function>", "</tool_call>")

    def parse(self, text, final):
        content, at = self._split(text, final)
        if at < 0:
            return content, []
        calls: list[PartialCall] = []
        ok = True
        pos = text.find("<function=", at)
        while pos >= 0:
            gt = text.find(">", pos)
            if gt < 0:
                ok = not final
                break
            name = text[pos + len("<function="):gt].strip()
            if not name or "\n" in name:
                ok = False
                break
            call = PartialCall(name=name)
            calls.append(call)
            params: list[str] = []
            p = gt + 1
            closed = False
            while True:
                p = _skip_ws(text, p)
                if text.startswith("<parameter=", p):
                    pg = text.find(">", p)
                    if pg < 0:
                        break
                    pname = text[p + len("<parameter="):pg].strip()
                    vs = pg + 1
                    ends = [e for e in (text.find("</parameter>", vs), text.find("<parameter=", vs),
                                        text.find("</function>", vs)) if e >= 0]
                    if not ends:
                        if final:  # an unterminated last parameter
                            params.append(self._param(name, pname, text[vs:]))
                            p = len(text)
                        break
                    ve = min(ends)
                    params.append(self._param(name, pname, text[vs:ve]))
                    p = ve + len("</parameter>") if text.startswith("</parameter>", ve) else ve
                    continue
                if text.startswith("</function>", p):
                    closed = True
                    p += len("</function>")
                break
            call.args = "{" + ", ".join(params) + ("}" if closed or final else "")
            call.done = closed or final
            if not closed:
                break
            pos = text.find("<function=", p)
        return self._finish(text, content, calls, ok, final)

    def _param(self, fn: str, pname: str, raw: str) -> str:
        if raw.startswith("\n"):
            raw = raw[1:]
        if raw.endswith("\n"):
            raw = raw[:-1]
        return json.dumps(pname, ensure_ascii=False) + ": " + json.dumps(self._convert(fn, pname, raw),
                                                                          ensure_ascii=False)

    def _convert(self, fn: str, pname: str, raw: str) -> Any:
        schema = ((self.tools.get(fn) or {}).get("parameters") or {})
        prop = (schema.get("properties") or {}).get(pname) if isinstance(schema, dict) else None
        kind = prop.get("type") if isinstance(prop, dict) else None
        kinds = kind if isinstance(kind, list) else [kind]
        if "string" in kinds:
            return raw
        v = raw.strip()
        if v.lower() in ("null", "none") and (kind is None or "null" in kinds):
            return None
        if "integer" in kinds:
            try:
                return int(v)
            except ValueError:
                pass
        if "number" in kinds:
            try:
                f = float(v)
            except ValueError:
                pass
            else:
                if math.isfinite(f):
                    return int(f) if f.is_integer() and "." not in v and "e" not in v.lower() else f
        if "boolean" in kinds and v.lower() in ("true", "false"):
            return v.lower() == "true"
        if kind is None or any(k in ("object", "array") for k in kinds):
            try:
                return json.loads(v)
            except ValueError:
                pass
        return raw

    def forced_prefix(self, function):
        return "<tool_call>\n<function=" + (f"{function}>\n" if function else "")


PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser, "qwen": HermesParser, "mistral": MistralParser, "llama": LlamaFunctionParser,
    "llama3_json": Llama3JsonParser, "qwen3_coder": Qwen3CoderParser, "json": JsonParser,
}


def parser_names() -> list[str]:
    return list(PARSERS)


def make_parser(name: str, tools: Optional[list[dict]] = None) -> ToolParser:
    try:
        return PARSERS[name](tools)
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; choose one of {', '.join(PARSERS)}") from None


def detect_parser(chat_template: Optional[str], family: Optional[str] = None) -> str:
    """The parser for a model: from what its chat template teaches the model, else its family."""
    t = chat_template or ""
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<parameter=" in t and "<function=" in t:
        return "qwen3_coder"
    if "<tool_call>" in t:
        return "hermes"
    if "<function=" in t:
        return "llama"
    if "<|start_header_id|>" in t and ("<|python_tag|>" in t or '"parameters"' in t):
        return "llama3_json"
    from tallow.models.registry import tool_parser_hint

    return tool_parser_hint(family) or "json"  # e.g. a Llama-architecture model whose template is not Llama 3's


# -- streaming ---------------------------------------------------------------------------------
@dataclasses.dataclass
class _Sent:
    id: str
    name: str
    args: str = ""


class ToolCallStream:
    """Feeds output text deltas to a parser and returns what is new: a content delta and tool-call
    deltas in OpenAI's stream shape (a call's id and name first, with empty arguments; then its
    argument fragments). ``prefix`` is text forced into the prompt that the parser must see."""

    def __init__(self, parser: ToolParser, prefix: str = ""):
        self.parser = parser
        self.text = prefix
        self.content = ""
        self.calls: list[_Sent] = []

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        self.text += delta
        content, calls = self.parser.parse(self.text, final)
        out = ""
        # Content is what comes before the first call: once a call is sent it is complete (a
        # malformed call found later does not turn the raw text into content).
        if not self.calls and content.startswith(self.content):
            out = content[len(self.content):]
            self.content = content
        return out, self._events(calls)

    def _events(self, calls: list[PartialCall]) -> list[dict]:
        """Tool-call deltas for what is new in calls since the last feed."""
        events: list[dict] = []
        for k, c in enumerate(calls):
            if k >= len(self.calls):
                if c.name is None:
                    break
                sent = _Sent(c.id or self.parser.new_call_id(), c.name)
                self.calls.append(sent)
                events.append({"index": k, "id": sent.id, "type": "function",
                               "function": {"name": c.name, "arguments": ""}})
            sent = self.calls[k]
            if len(c.args) > len(sent.args) and c.args.startswith(sent.args):
                events.append({"index": k, "function": {"arguments": c.args[len(sent.args):]}})
                sent.args = c.args
        return events

    def tool_calls(self) -> list[dict]:
        """The calls in OpenAI's message shape."""
        return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.args or "{}"}}
                for c in self.calls]


class ForcedToolCallStream(ToolCallStream):
    """The reply to tool_choice "required" or a named function. The prompt ends with the start of a
    call (``parser.forced_prefix``), so the reply is call(s): no content is streamed while it may
    still be a call, and ``done`` turns True once the calls are complete and what follows cannot
    start another (``single_call``: after the first call). The caller then ends the request, which
    guided decoding would have done (tallow has none), so what a small model rambles on with
    afterwards is dropped. A final reply that does not parse into a call is content (``failed``),
    with the finish reason as generated; tool-call deltas already streamed cannot be taken back."""

    _ENDS = "}]>"  # a call is complete only after one of these (JSON, an array, an end tag)

    def __init__(self, parser: ToolParser, prefix: str, single_call: bool = False):
        super().__init__(parser, prefix)
        self.single_call = single_call
        self.done = False
        self.failed = False
        self._cut: Optional[tuple[int, list[PartialCall]]] = None  # (end, calls) of the last complete calls
        self._scanned = len(prefix)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        if self.done or self.failed:
            return "", []
        self.text += delta
        calls = self._scan()
        if self.done or not final:
            return "", self._events(calls)
        _, calls = self.parser.parse(self.text, True)
        if self._cut is not None and len(calls) < len(self._cut[1]):
            calls = self._cut[1]  # what follows the complete calls does not parse: drop it
        if calls:
            self.done = True
            return "", self._events(calls[:1] if self.single_call else calls)
        self.failed = True
        self.content = self.text
        return ("" if self.calls else self.text), []

    def _scan(self) -> list[PartialCall]:
        """The calls to send now; sets ``done`` when the reply should end."""
        text, parse = self.text, self.parser.parse
        for i in range(self._scanned, len(text)):
            if text[i] not in self._ENDS:
                continue
            _, calls = parse(text[:i + 1], False)
            if calls and all(c.done and c.name is not None for c in calls) and \
                    (self._cut is None or len(calls) > len(self._cut[1])):
                self._cut = (i + 1, calls)
                if self.single_call:
                    self.done = True
                    return calls[:1]
        self._scanned = len(text)
        _, calls = parse(text, False)
        if self._cut is not None and (len(calls) < len(self._cut[1]) or not self._may_continue(text[self._cut[0]:])):
            self.done = True
            return self._cut[1]
        return calls

    def _may_continue(self, rest: str) -> bool:
        """Whether the text after complete calls may still become another call."""
        closers, s = self.parser.closers, rest
        while True:
            s = s.lstrip(_WS)
            c = next((c for c in closers if s.startswith(c)), None)
            if c is None:
                break
            s = s[len(c):]
        return not s or any(m.startswith(s) or s.startswith(m) for m in self.parser.openers + closers)

    def tool_calls(self) -> list[dict]:
        return [] if self.failed else super().tool_calls()


def parse_tool_calls(parser: ToolParser, text: str, prefix: str = "") -> tuple[str, list[dict]]:
    """Whole-text parsing: (content, calls in OpenAI's message shape)."""
    stream = ToolCallStream(parser, prefix)
    stream.feed(text, final=True)
    return stream.content, stream.tool_calls()
