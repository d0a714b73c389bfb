"""Hugging Face-compatible chat template rendering.

Renders a model's Jinja chat template to the same string as transformers'
``tokenizer.apply_chat_template(messages, tokenize=False, ...)``, without importing transformers:

* the environment: jinja2's ImmutableSandboxedEnvironment with ``trim_blocks``, ``lstrip_blocks``
  and the ``loopcontrols`` extension, plus the ``{% generation %}`` block (rendered as its body);
* the names transformers gives a template: ``raise_exception(msg)``, ``strftime_now(fmt)``,
  a ``tojson`` filter with transformers' options (``ensure_ascii=False``, ``indent``,
  ``separators``, ``sort_keys``), and restricted ``dict`` and ``namespace`` globals;
* the inputs transformers passes: ``messages`` (keys whose value is None dropped; reasoning
  copied between ``reasoning_content``/``thinking``/``reasoning``), ``tools``, ``documents``,
  ``add_generation_prompt``, ``bos_token``/``eos_token`` and any extra keyword
  (``enable_thinking``, ``date_string``, ...), all rebuilt from plain JSON-like types.

Which template a model uses is decided by :func:`resolve_chat_template` (a ``--chat-template``
override, tokenizer_config.json's ``chat_template`` -- one string or named templates -- or the
GGUF ``tokenizer.chat_template``). A model without one raises :class:`NoChatTemplateError`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = [
    "ChatTemplate",
    "ChatTemplateError",
    "NoChatTemplateError",
    "parse_tool_call_arguments",
    "render_chat_template",
    "resolve_chat_template",
]

NO_CHAT_TEMPLATE_MESSAGE = "model has no chat template; pass --chat-template FILE"

# Message keys transformers treats as the same reasoning text; the first is the one templates read.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """A chat template could not be compiled or rendered for these inputs.

    When the template itself calls ``raise_exception(message)`` (e.g. "Conversation roles must
    alternate user/assistant/..."), ``str(error)`` is exactly the template's message.
    """


class NoChatTemplateError(ChatTemplateError):
    """The model has no chat template and none was given."""

    def __init__(self, message: str = NO_CHAT_TEMPLATE_MESSAGE):
        super().__init__(message)


# --------------------------------------------------------------------------------------------
# The Jinja environment


def _now() -> datetime:
    # One place to read the clock, so tests can freeze it.
    return datetime.now()


def _raise_exception(message):
    raise ChatTemplateError(str(message))


def _strftime_now(fmt):
    return _now().strftime(fmt)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson HTML-escapes and takes only `indent`; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _TemplateDict:
    """``dict(...)`` in a template, without the dict type's attributes."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _check_namespace_name(name) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates cannot store underscore-prefixed attributes on a namespace (got {name!r})"
        )


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore-prefixed attributes."""

    def __init__(*args, **kwargs):  # same signature trick as jinja2.utils.Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks in
    transformers; rendering a prompt only needs its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
        return caller()


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


@functools.lru_cache(maxsize=64)
def _compile(source: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template has a syntax error at line {e.lineno}: {e.message}") from None


# --------------------------------------------------------------------------------------------
# Inputs: what transformers hands a template


def _plain(value: Any) -> Any:
    """Rebuild `value` from plain JSON-like types (fresh copies), as transformers does before
    rendering: templates are untrusted code and must not see objects with methods of their own."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # str subclasses (enums, ...)
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if type(value).__module__ == "numpy" and hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        return _plain(value.item())  # numpy scalars
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models (e.g. OpenAI SDK messages)
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _prepare_messages(messages: Any) -> list[dict]:
    messages = getattr(messages, "messages", messages)
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ChatTemplateError("messages must be a list of message dicts")
    if len(messages) == 0:
        raise ChatTemplateError("cannot apply a chat template to an empty conversation; give at least one message")
    out = []
    for message in _plain(list(messages)):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"each chat message must be a dict, got {message!r}")
        # Keys set to None (OpenAI's content=None, tool_calls=None) are dropped: templates handle a
        # missing key but would print "None" or fail on a None one.
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _prepare_tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if isinstance(tools, Mapping) or not isinstance(tools, Sequence):
        raise ChatTemplateError("tools must be a list of JSON-schema dicts")
    tools = _plain(list(tools))
    for tool in tools:
        if not isinstance(tool, dict):
            raise ChatTemplateError(
                "each tool must be a JSON-schema dict, either {'type': 'function', 'function': {...}} "
                f"or {{'name': ..., 'description': ..., 'parameters': {{...}}}}; got {tool!r}"
            )
    return tools


def _prepare_documents(documents: Any) -> list[dict] | None:
    if documents is None:
        return None
    if isinstance(documents, Mapping) or not isinstance(documents, Sequence):
        raise ChatTemplateError("documents must be a list of dicts with 'title' and 'text' keys")
    documents = _plain(list(documents))
    for doc in documents:
        if not isinstance(doc, dict):
            raise ChatTemplateError("documents must be a list of dicts with 'title' and 'text' keys")
    return documents


def parse_tool_call_arguments(messages: Sequence[Mapping]) -> list[dict]:
    """Copies of `messages` where each assistant tool call's ``function.arguments`` given as a JSON
    string (the OpenAI wire format) is decoded to a dict, which is what most templates (Llama 3.x,
    Qwen, Command-R, Hermes) expect. Strings that are not a JSON object are left as they are.
    transformers does not do this itself, so :func:`render_chat_template` does not either: a
    server calls this first when its clients send OpenAI-style messages."""
    out = []
    for message in messages:
        message = dict(message)
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            new_calls = []
            for call in calls:
                fn = call.get("function") if isinstance(call, Mapping) else None
                if isinstance(fn, Mapping) and isinstance(fn.get("arguments"), str):
                    try:
                        args = json.loads(fn["arguments"])
                    except ValueError:
                        args = None
                    if isinstance(args, dict):
                        call = {**call, "function": {**fn, "arguments": args}}
                new_calls.append(call)
            message["tool_calls"] = new_calls
        out.append(message)
    return out


# --------------------------------------------------------------------------------------------
# Rendering


class ChatTemplate:
    """A compiled chat template (compiled once; ``render`` may be called from many threads)."""

    __slots__ = ("source", "name", "_template", "_variables")

    def __init__(self, source: str | None, name: str | None = None):
        if not source:
            raise NoChatTemplateError()
        if not isinstance(source, str):
            raise ChatTemplateError(f"a chat template must be a string, got {type(source).__name__}")
        self.source = source
        self.name = name
        self._template = _compile(source)
        self._variables = None

    def __repr__(self) -> str:
        name = f" {self.name!r}" if self.name else ""
        return f"<ChatTemplate{name} ({len(self.source)} chars)>"

    @property
    def variables(self) -> frozenset[str]:
        """Names the template reads from its context (e.g. ``tools``, ``enable_thinking``)."""
        if self._variables is None:
            import jinja2.meta

            ast = _environment().parse(self.source)
            self._variables = frozenset(jinja2.meta.find_undeclared_variables(ast))
        return self._variables

    def render(
        self,
        messages: Sequence[Mapping],
        *,
        tools: Sequence[Mapping] | None = None,
        documents: Sequence[Mapping] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        bos_token: str | None = "",
        eos_token: str | None = "",
        **kwargs: Any,
    ) -> str:
        """Render `messages`; see :func:`render_chat_template`."""
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError(
                "continue_final_message and add_generation_prompt cannot be used together: the first continues "
                "the last message, the second starts a new assistant message"
            )
        chat = _prepare_messages(messages)
        context = {}
        if bos_token is not None:
            context["bos_token"] = bos_token
        if eos_token is not None:
            context["eos_token"] = eos_token
        context.update(_plain(kwargs))
        context.update(
            messages=chat,
            tools=_prepare_tools(tools),
            documents=_prepare_documents(documents),
            add_generation_prompt=add_generation_prompt,
        )

        final_text = None
        if continue_final_message:
            final_text = self._tag_final_message(chat, continue_final_message)

        try:
            rendered = self._template.render(context)
        except ChatTemplateError:
            raise
        except RecursionError:
            raise ChatTemplateError("chat template recursed too deeply") from None
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as e:
            where = f"chat template {self.name!r}" if self.name else "chat template"
            raise ChatTemplateError(f"{where} failed on these messages: {type(e).__name__}: {e}") from e

        if final_text is not None:
            rendered = self._cut_after_final_message(rendered, final_text)
        return rendered

    def _tag_final_message(self, chat: list[dict], key: bool | str) -> str:
        # Mark the end of the final message's text so the rendering can be cut right after it.
        key = key if isinstance(key, str) else "content"
        last = chat[-1]
        final = last.get(key)
        if final is None:
            raise ChatTemplateError(f'continue_final_message is set but the final message has no "{key}" to continue')
        keys = [key]
        if key in _REASONING_KEYS:
            keys = [k for k in _REASONING_KEYS if last.get(k) == final]
        if not any(k in self.source for k in keys):
            raise ChatTemplateError(
                f'continue_final_message is set to "{key}" but the chat template never reads that field'
            )
        if isinstance(final, (list, tuple)):
            for block in reversed(final):
                if isinstance(block, dict) and "text" in block:
                    final = block["text"]
                    block["text"] = block["text"] + _CONTINUE_TAG
                    return final
            raise ChatTemplateError("continue_final_message is set but the final message has no text to continue")
        for k in keys:
            last[k] = last[k] + _CONTINUE_TAG
        return final

    @staticmethod
    def _cut_after_final_message(rendered: str, final_text: str) -> str:
        if final_text.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
            raise ChatTemplateError(
                "continue_final_message is set but the chat template drops part of the final message, "
                "so it cannot be continued"
            )
        at = rendered.rindex(_CONTINUE_TAG.strip())
        if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            return rendered[:at]
        return rendered[:at].rstrip()  # the template trimmed the message's trailing space


def render_chat_template(
    template: str | ChatTemplate | None,
    messages: Sequence[Mapping],
    *,
    tools: Sequence[Mapping] | None = None,
    documents: Sequence[Mapping] | None = None,
    add_generation_prompt: bool = False,
    bos_token: str | None = "",
    eos_token: str | None = "",
    **kwargs: Any,
) -> str:
    """Render a chat the way transformers' ``apply_chat_template(..., tokenize=False)`` does.

    `messages` are dicts (``role``, ``content``, and for assistant tool calls ``tool_calls``; for
    tool results ``tool_call_id``/``name``); `tools` are JSON-schema dicts, bare
    (``{"name", "description", "parameters"}``) or OpenAI-style
    (``{"type": "function", "function": {...}}``), passed to the template unchanged. A token given
    as None is left undefined in the template (as for a tokenizer without it). Extra keywords
    (``enable_thinking``, ``date_string``, ``continue_final_message``...) reach the template,
    except ``continue_final_message``, which is handled as transformers does.

    Raises NoChatTemplateError when `template` is None or empty, ChatTemplateError when the
    template rejects the conversation (``str(e)`` is the template's own message when it called
    ``raise_exception``) or fails on it.
    """
    if not isinstance(template, ChatTemplate):
        template = ChatTemplate(template)
    return template.render(
        messages,
        tools=tools,
        documents=documents,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
        **kwargs,
    )


# --------------------------------------------------------------------------------------------
# Which template a model uses


def _named_templates(value: Any, source: str) -> dict[str, str]:
    """{name: template} from a chat_template value: a string (named "default"), a list of
    {"name", "template"} dicts (tokenizer_config.json), or a {name: template} mapping."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise ChatTemplateError(f"{source}: chat templates must map names to template strings")
        return {k: v for k, v in value.items() if v}
    if isinstance(value, list):
        out = {}
        for item in value:
            if not (isinstance(item, Mapping) and isinstance(item.get("name"), str) and isinstance(item.get("template"), str)):
                raise ChatTemplateError(f"{source}: each named chat template must be {{'name': ..., 'template': ...}}")
            out[item["name"]] = item["template"]
        return out
    raise ChatTemplateError(f"{source}: chat_template must be a string or a list of named templates")


def _pick(templates: dict[str, str], name: str | None, tools: bool, source: str) -> str:
    if name is not None:
        if name in templates:
            return templates[name]
        raise ChatTemplateError(
            f"{source} has no chat template named {name!r}; it has: {', '.join(sorted(templates))}"
        )
    if tools and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    if len(templates) == 1:
        return next(iter(templates.values()))
    raise ChatTemplateError(
        f"{source} has several chat templates and no default; pick one by name: {', '.join(sorted(templates))}"
    )


def _looks_inline(text: str) -> bool:
    return "{{" in text or "{%" in text or "\n" in text


def _read_override(override: str | os.PathLike, name: str | None, tools: bool, fallback: dict[str, str]) -> str:
    if isinstance(override, str) and _looks_inline(override):
        return override
    path = os.fspath(override)
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(f"cannot read chat template file {path}: {e}") from None
        if path.endswith(".json"):
            # chat_template.json or a tokenizer_config.json: {"chat_template": str | [named]}
            try:
                data = json.loads(text)
            except ValueError as e:
                raise ChatTemplateError(f"chat template file {path} is not valid JSON: {e}") from None
            if not isinstance(data, dict) or "chat_template" not in data:
                raise ChatTemplateError(f"chat template file {path} has no \"chat_template\" key")
            templates = _named_templates(data["chat_template"], path)
            if not templates:
                raise ChatTemplateError(f"chat template file {path} has an empty chat_template")
            return _pick(templates, name, tools, path)
        if not text:
            raise ChatTemplateError(f"chat template file {path} is empty")
        return text
    if isinstance(override, str) and override in fallback:
        return fallback[override]  # the name of one of the model's own templates
    raise ChatTemplateError(f"chat template file not found: {path} (nor is it an inline Jinja template)")


def resolve_chat_template(
    tokenizer_config: Mapping | None,
    gguf_template: str | Mapping[str, str] | None,
    override: str | os.PathLike | None,
    name: str | None = None,
    *,
    tools: bool | Sequence | None = None,
) -> str | None:
    """The chat template a model uses, or None when it has none.

    Precedence: `override` (``--chat-template``: a file -- a .jinja/text file, or a .json file
    with a ``chat_template`` key --, an inline Jinja template, or the name of one of the model's
    named templates), then tokenizer_config.json's ``chat_template``, then the GGUF
    ``tokenizer.chat_template`` (a string, or ``{name: template}`` built from the
    ``tokenizer.chat_template.<name>`` keys, the plain key being "default").

    Named templates: `name` picks one (error if absent); otherwise "tool_use" when `tools` is
    truthy and it exists, else "default" (or the only one).
    """
    templates: dict[str, str] = {}
    source = "model"
    if tokenizer_config:
        templates = _named_templates(tokenizer_config.get("chat_template"), "tokenizer_config.json")
        source = "tokenizer_config.json"
    if not templates and gguf_template:
        templates = _named_templates(gguf_template, "GGUF tokenizer.chat_template")
        source = "GGUF tokenizer.chat_template"
    if override is not None and override != "":
        return _read_override(override, name, bool(tools), templates)
    if not templates:
        return None
    return _pick(templates, name, bool(tools), source)
