"""Chat template rendering against transformers' own (test-only reference).

Every template in ../shared/data/chat-templates is rendered on a set of conversations (system,
multi-turn, tool calls with dict and JSON-string arguments, tool results, parallel calls,
reasoning, non-alternating roles, content parts) under every combination of tools (none,
OpenAI-style, bare schemas), documents, add_generation_prompt, bos/eos tokens and extra
template keywords; tallow's string must equal transformers' exactly, and where transformers
raises (the template rejects the conversation) tallow must raise ChatTemplateError.
"""

import copy
import dataclasses
import datetime as _dt
import enum
import itertools
import json

import jinja2
import numpy as np
import pytest

from conftest import data_dir
from tallow.tokenizer import chat_template as ct
from tallow.tokenizer.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    NoChatTemplateError,
    parse_tool_call_arguments,
    render_chat_template,
    resolve_chat_template,
)

ctu = pytest.importorskip("transformers.utils.chat_template_utils", reason="transformers is the reference")
if not hasattr(ctu, "render_jinja_template"):
    pytest.skip("installed transformers has no render_jinja_template", allow_module_level=True)

FROZEN_NOW = _dt.datetime(2025, 3, 14, 15, 9, 26)


class _FrozenDatetime(_dt.datetime):
    @classmethod
    def now(cls, tz=None):
        return FROZEN_NOW


@pytest.fixture(autouse=True)
def frozen_clock(monkeypatch):
    """strftime_now reads the same fixed instant in tallow and in transformers."""
    monkeypatch.setattr(ct, "_now", lambda: FROZEN_NOW)
    monkeypatch.setattr(ctu, "datetime", _FrozenDatetime)


def reference(template, messages, *, tools=None, documents=None, add_generation_prompt=False,
              bos_token="", eos_token="", continue_final_message=False, **kwargs):
    """transformers' apply_chat_template(tokenize=False) for a tokenizer whose special tokens are
    bos_token/eos_token (None: the tokenizer has no such token)."""
    conv = copy.deepcopy(messages)
    if hasattr(ctu, "_normalize_chat_messages"):
        conv = ctu._normalize_chat_messages(conv)
    special = {k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v is not None}
    out, _ = ctu.render_jinja_template(
        conversations=[conv], tools=copy.deepcopy(tools), documents=copy.deepcopy(documents),
        chat_template=template, add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message, **{**special, **kwargs},
    )
    return out[0]


def outcome(fn, *args, **kwargs):
    try:
        return "ok", fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - both sides' failures are compared below
        return "err", e


def assert_same(template, messages, label="", **kw):
    """tallow == transformers, or both raise. Returns "ok" or "err"."""
    snapshot = copy.deepcopy(messages)
    ref_kind, ref = outcome(reference, template, messages, **kw)
    our_kind, ours = outcome(render_chat_template, template, messages, **kw)
    assert messages == snapshot, "render_chat_template modified the caller's messages"
    where = f"{label} {sorted(k for k, v in kw.items() if v)}"
    if ref_kind == "ok":
        assert our_kind == "ok", f"{where}: transformers rendered but tallow raised {ours!r}"
        assert ours == ref, f"{where}: output differs"
    else:
        assert our_kind == "err", f"{where}: transformers raised {ref!r} but tallow rendered {ours!r}"
        assert isinstance(ours, ChatTemplateError), f"{where}: tallow raised {type(ours).__name__}: {ours}"
        if type(ref) is jinja2.exceptions.TemplateError:  # the template's raise_exception(...)
            assert str(ours) == str(ref), where
    return ref_kind


# ------------------------------------------------------------------------------------------
# Conversations

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris or Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"},
            },
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search_web",
        "description": "Search the web and return the top results.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "What to search for"},
                "max_results": {"type": "integer", "description": "How many results to return"},
                "sites": {"type": "array", "items": {"type": "string"}, "description": "Sites to restrict to"},
            },
            "required": ["query"],
        },
        "return": {"type": "array", "items": {"type": "string"}, "description": "Result snippets"},
    },
}
OPENAI_TOOLS = [WEATHER, SEARCH]
BARE_TOOLS = [WEATHER["function"], SEARCH["function"]]
DOCUMENTS = [
    {"title": "Paris weather", "text": "Paris is mild in spring; 21 °C is typical in May."},
    {"title": "Zürich", "text": "Zürich lies on Lake Zürich."},
]

SYSTEM = {"role": "system", "content": "You are a terse assistant."}
ARGS = {"city": "Paris", "unit": "celsius"}
RESULT = '{"temperature": 21, "condition": "sunny"}'


def _call(args, id_="call12345", name="get_weather"):
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": args}}


def _tool_turn(args, content=""):
    msg = {"role": "assistant", "tool_calls": [_call(args)], "tool_plan": "I will look up the weather."}
    if content is not None:
        msg["content"] = content
    else:
        msg["content"] = None  # OpenAI clients send content: null with tool calls
    return [
        SYSTEM,
        {"role": "user", "content": "What's the weather in Paris?"},
        msg,
        {"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": RESULT},
        {"role": "assistant", "content": "It is 21 °C and sunny in Paris."},
    ]


CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hello! How are you?"}],
    "system_user": [SYSTEM, {"role": "user", "content": "What's 2+2?"}],
    "multi_turn": [
        SYSTEM,
        {"role": "user", "content": "What's 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And times 3?"},
    ],
    "multi_turn_no_system": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the chicken cross the road?"},
    ],
    "unicode_whitespace": [
        {"role": "user", "content": "  Ünïcödé — 世界 ✓ \"quotes\" <b>&amp;</b>\n\n"},
        {"role": "assistant", "content": "\nПривет 👋 "},
        {"role": "user", "content": "tab\tand\\backslash"},
    ],
    "tool_call_dict_args": _tool_turn(ARGS),
    "tool_call_json_args": _tool_turn(json.dumps(ARGS)),
    "tool_call_null_content_json_args": _tool_turn(json.dumps(ARGS), content=None),
    "tool_call_null_content_dict_args": _tool_turn(ARGS, content=None),
    "tool_result_last": _tool_turn(ARGS)[:-1],
    "tool_result_last_json_args": _tool_turn(json.dumps(ARGS), content=None)[:-1],
    "parallel_tool_calls": [
        {"role": "user", "content": "Weather in Paris and news about it?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [_call(ARGS, "call12345"), _call({"query": "Paris news", "max_results": 3}, "call67890", "search_web")],
        },
        {"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": RESULT},
        {"role": "tool", "tool_call_id": "call67890", "name": "search_web", "content": '["A", "B", "C"]'},
    ],
    "reasoning": [
        {"role": "user", "content": "What's 2+2?"},
        {"role": "assistant", "content": "<think>\n2 plus 2 is 4.\n</think>\n\n4", "reasoning_content": "2 plus 2 is 4."},
        {"role": "user", "content": "Sure?"},
    ],
    "non_alternating": [
        {"role": "user", "content": "Hi"},
        {"role": "user", "content": "Anyone there?"},
    ],
    "content_parts": [{"role": "user", "content": [{"type": "text", "text": "Describe this."}]}],
}

EXTRA_KWARGS = {
    "none": {},
    "template_vars": {
        "functions": json.dumps(BARE_TOOLS),  # firefunction-v2 reads these two
        "datetime": "2025-03-14",
        "date_string": "01 Jan 2025",  # Llama 3.x
        "builtin_tools": ["brave_search", "wolfram_alpha"],
        "tools_in_user_message": False,
        "enable_citations": True,  # Command R7B
        "enable_thinking": False,
    },
}

TEMPLATE_DIR = data_dir() / "chat-templates"
TEMPLATES = sorted(p.name for p in TEMPLATE_DIR.glob("*.jinja")) if TEMPLATE_DIR.is_dir() else ["<missing>"]


def load_template(shared_data, name):
    path = shared_data / "chat-templates" / name
    if not path.is_file():
        pytest.skip(f"chat template {path} not found")
    return path.read_text(encoding="utf-8")


@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("template_name", TEMPLATES)
def test_matches_transformers(shared_data, template_name, conversation):
    template = load_template(shared_data, template_name)
    messages = CONVERSATIONS[conversation]
    kinds = []
    for tools, documents, agp, (bos, eos), extra in itertools.product(
        (None, OPENAI_TOOLS, BARE_TOOLS),
        (None, DOCUMENTS),
        (False, True),
        (("", ""), ("<s>", "</s>"), (None, None)),
        EXTRA_KWARGS,
    ):
        kinds.append(assert_same(
            template, messages, label=f"{template_name}/{conversation}/{extra}/bos={bos!r}",
            tools=tools, documents=documents, add_generation_prompt=agp, bos_token=bos, eos_token=eos,
            **EXTRA_KWARGS[extra],
        ))
    print(f"{template_name} {conversation}: {kinds.count('ok')} rendered, {kinds.count('err')} rejected by both")


@pytest.mark.parametrize("template_name", TEMPLATES)
def test_template_renders_basic_chat(shared_data, template_name):
    """Each template renders a plain chat (so the comparison above is not only of errors), and
    the tokens and generation prompt reach it."""
    template = load_template(shared_data, template_name)
    messages = [{"role": "user", "content": "Hello there"}]
    kw = dict(add_generation_prompt=True, bos_token="<s>", eos_token="</s>", **EXTRA_KWARGS["template_vars"])
    rendered = []
    for tools in (None, OPENAI_TOOLS):  # tool_use templates need tools
        if assert_same(template, messages, label=template_name, tools=tools, **kw) == "ok":
            rendered.append(render_chat_template(template, messages, tools=tools, **kw))
    assert rendered, f"{template_name} rendered no plain chat"
    assert all("Hello there" in r for r in rendered)


@pytest.mark.parametrize("template_name", TEMPLATES)
def test_matches_apply_chat_template(shared_data, template_name):
    """The reference above is what a real transformers tokenizer's apply_chat_template gives."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    template = load_template(shared_data, template_name)
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>")),
        bos_token="<s>", eos_token="</s>",
    )
    tok.chat_template = template
    for name in ("system_user", "multi_turn", "tool_call_dict_args", "tool_call_null_content_json_args"):
        messages = CONVERSATIONS[name]
        for tools, agp in ((None, True), (OPENAI_TOOLS, False)):
            kw = dict(tools=tools, add_generation_prompt=agp, **EXTRA_KWARGS["template_vars"])
            ref_kind, ref = outcome(tok.apply_chat_template, messages, tokenize=False, **kw)
            our_kind, ours = outcome(render_chat_template, template, messages, bos_token="<s>", eos_token="</s>", **kw)
            assert our_kind == ref_kind, (name, ref, ours)
            if ref_kind == "ok":
                assert ours == ref, name


# ------------------------------------------------------------------------------------------
# The environment: globals, filters, sandbox


def test_raise_exception_surfaces_template_message():
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('First message must be from the user, got ' + messages[0].role) }}{% endif %}ok"
    with pytest.raises(ChatTemplateError) as info:
        render_chat_template(template, [{"role": "assistant", "content": "x"}])
    assert str(info.value) == "First message must be from the user, got assistant"
    assert isinstance(info.value, ValueError)
    assert render_chat_template(template, [{"role": "user", "content": "x"}]) == "ok"


def test_raise_exception_from_real_template(shared_data):
    template = load_template(shared_data, "google-gemma-2-2b-it.jinja")
    with pytest.raises(ChatTemplateError, match="^System role not supported$"):
        render_chat_template(template, CONVERSATIONS["system_user"])
    with pytest.raises(ChatTemplateError, match="^Conversation roles must alternate user/assistant/user/assistant/...$"):
        render_chat_template(template, CONVERSATIONS["non_alternating"])


@pytest.mark.parametrize("template", [None, ""])
def test_missing_template(template):
    with pytest.raises(NoChatTemplateError, match="model has no chat template; pass --chat-template FILE"):
        render_chat_template(template, [{"role": "user", "content": "hi"}])
    with pytest.raises(NoChatTemplateError):
        ChatTemplate(template)
    assert issubclass(NoChatTemplateError, ChatTemplateError)


def test_syntax_error_is_clear():
    with pytest.raises(ChatTemplateError, match="syntax error at line 2"):
        ChatTemplate("{% for m in messages %}\n{{ m.content }\n{% endfor %}")


def test_failure_inside_template_is_chat_template_error():
    # content is a list here; "+" on str and list fails in the template
    with pytest.raises(ChatTemplateError, match="failed on these messages"):
        render_chat_template("{{ 'x' + messages[0].content }}", CONVERSATIONS["content_parts"])
    with pytest.raises(ChatTemplateError):
        render_chat_template("{{ messages[0].content + undefined_thing }}", [{"role": "user", "content": "x"}])


def test_empty_and_malformed_inputs():
    t = "{{ messages | length }}"
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        render_chat_template(t, [])
    with pytest.raises(ChatTemplateError, match="must be a dict"):
        render_chat_template(t, ["hello"])
    with pytest.raises(ChatTemplateError, match="JSON-schema"):
        render_chat_template(t, [{"role": "user", "content": "x"}], tools=["get_weather"])
    with pytest.raises(ChatTemplateError, match="documents"):
        render_chat_template(t, [{"role": "user", "content": "x"}], documents=["text"])


@pytest.mark.parametrize("expr", [
    "{{ data | tojson }}",
    "{{ data | tojson(indent=2) }}",
    "{{ data | tojson(indent=4, sort_keys=true) }}",
    "{{ data | tojson(separators=(',', ':')) }}",
    "{{ data | tojson(ensure_ascii=true) }}",
    "{{ messages[0] | tojson }}",
    "{{ tools | map(attribute='function') | list | tojson(indent=2) }}",
])
def test_tojson(expr):
    data = {"z": "Zürich <b> & 'q' \"dq\"", "a": [1, 2.5, None, True], "n": {"k": "世界"}}
    messages = [{"role": "user", "content": "é"}]
    kw = dict(tools=OPENAI_TOOLS, data=data)
    out = render_chat_template(expr, messages, **kw)
    assert out == reference(expr, messages, **kw)
    if expr == "{{ data | tojson }}":
        assert out == json.dumps(data, ensure_ascii=False)  # no HTML escaping, no \u escapes


def test_strftime_now():
    template = "{{ strftime_now('%d %b %Y %H:%M') }}"
    assert render_chat_template(template, [{"role": "user", "content": "x"}]) == "14 Mar 2025 15:09"


def test_strftime_now_reads_the_clock(monkeypatch):
    monkeypatch.setattr(ct, "_now", _dt.datetime.now)
    before = _dt.datetime.now()
    out = render_chat_template("{{ strftime_now('%Y-%m-%d %H:%M:%S') }}", [{"role": "user", "content": "x"}])
    after = _dt.datetime.now()
    got = _dt.datetime.strptime(out, "%Y-%m-%d %H:%M:%S")
    assert before.replace(microsecond=0) <= got <= after


def test_llama32_date_line_uses_clock_or_date_string(shared_data):
    template = load_template(shared_data, "meta-llama-Llama-3.2-3B-Instruct.jinja")
    msgs = CONVERSATIONS["system_user"]
    assert "Today Date: 14 Mar 2025\n" in render_chat_template(template, msgs)
    assert "Today Date: 02 Feb 2024\n" in render_chat_template(template, msgs, date_string="02 Feb 2024")


def test_globals_dict_namespace_loopcontrols_generation():
    template = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{% if loop.index > 3 %}{% break %}{% endif %}"
        "{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
        "{{ ns.n }}{{ dict(a=1, b=2) | tojson }}{{ dict.fromkeys(['x', 'y'], 0) | tojson }}"
        "\n  {% if add_generation_prompt %}\n  GEN\n  {% endif %}\n"
    )
    msgs = CONVERSATIONS["multi_turn"] + CONVERSATIONS["multi_turn_no_system"]
    for agp in (False, True):
        out = render_chat_template(template, msgs, add_generation_prompt=agp)
        assert out == reference(template, msgs, add_generation_prompt=agp)
    assert out.startswith("[What's 2+2?][4.]3{\"a\": 1, \"b\": 2}{\"x\": 0, \"y\": 0}")
    assert out.endswith("  GEN\n")  # trim_blocks + lstrip_blocks


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__ }}{{ messages.append(1) }}",
    "{% set x = {} %}{{ x.update({'a': 1}) }}",
    "{% set ns = namespace() %}{% set ns._private = 1 %}",
    "{{ namespace(_x=1) }}",
    "{{ dict.__class__.__init__.__globals__ }}",
    "{{ raise_exception.__globals__ }}",
])
def test_sandbox(template):
    msgs = [{"role": "user", "content": "x"}]
    ref_kind, ref = outcome(reference, template, msgs)
    our_kind, ours = outcome(render_chat_template, template, msgs)
    assert our_kind == ref_kind
    if our_kind == "ok":
        assert ours == ref and "function" not in ours and "class" not in ours
    else:
        assert isinstance(ours, ChatTemplateError)


def test_extra_kwargs_reach_template():
    template = "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{{ messages[-1].content }}{{ custom.x }}"
    msgs = [{"role": "user", "content": "hi"}]
    assert render_chat_template(template, msgs, enable_thinking=False, custom={"x": 1}) == "<think></think>hi1"
    assert render_chat_template(template, msgs, custom={"x": 2}) == "hi2"


def test_tokens_none_are_undefined():
    template = "{{ bos_token is defined }} {{ eos_token is defined }} [{{ bos_token }}]"
    msgs = [{"role": "user", "content": "hi"}]
    assert render_chat_template(template, msgs, bos_token=None, eos_token=None) == "False False []"
    assert render_chat_template(template, msgs, bos_token="<s>") == "True True [<s>]"


def test_none_keys_dropped_and_reasoning_aliased():
    template = (
        "{% for m in messages %}{{ m.role }}:{{ m.content is defined }}:{{ m.tool_calls is defined }}:"
        "{{ m.reasoning_content }}|{{ m.thinking }}|{{ m.reasoning }};{% endfor %}"
    )
    msgs = [
        {"role": "assistant", "content": None, "tool_calls": None, "reasoning": "r1"},
        {"role": "assistant", "content": "a", "thinking": "t2"},
        {"role": "assistant", "content": "b", "reasoning_content": "rc3", "thinking": "t3"},
    ]
    snapshot = copy.deepcopy(msgs)
    out = render_chat_template(template, msgs)
    assert out == reference(template, msgs)
    assert out == "assistant:False:False:r1|r1|r1;assistant:True:False:t2|t2|;assistant:True:False:rc3|t3|;"
    assert msgs == snapshot


class Color(str, enum.Enum):
    RED = "red"


@dataclasses.dataclass
class Msg:
    role: str
    content: str


def test_rich_inputs_become_plain_data():
    template = "{% for m in messages %}{{ m.role }}={{ m.content }}/{{ m.n }}/{{ m.f }}/{{ m.b }}/{{ m.obj }};{% endfor %}{{ color }}"
    msgs = [
        {"role": "user", "content": Color.RED, "n": np.int64(3), "f": np.float32(0.5), "b": np.bool_(False), "obj": object()},
        Msg("assistant", "ok"),
    ]
    out = render_chat_template(template, msgs, color=Color.RED)
    assert out == reference(template, msgs, color=Color.RED)
    assert out == "user=red/3/0.5/False/<object>;assistant=ok////;red"


def test_continue_final_message(shared_data):
    template = load_template(shared_data, "Qwen-Qwen2.5-7B-Instruct.jinja")
    msgs = [{"role": "user", "content": "Write a haiku."}, {"role": "assistant", "content": "Autumn moonlight "}]
    out = render_chat_template(template, msgs, continue_final_message=True)
    assert out == reference(template, msgs, continue_final_message=True)
    assert out.endswith("<|im_start|>assistant\nAutumn moonlight ")
    with pytest.raises(ChatTemplateError, match="cannot be used together"):
        render_chat_template(template, msgs, continue_final_message=True, add_generation_prompt=True)


def test_chat_template_object_is_compiled_once():
    source = "{{ messages[0].content }}!"
    a, b = ChatTemplate(source), ChatTemplate(source)
    assert a._template is b._template
    assert a.render([{"role": "user", "content": "hi"}]) == "hi!"
    assert render_chat_template(a, [{"role": "user", "content": "yo"}]) == "yo!"
    assert "messages" in a.variables


def test_parse_tool_call_arguments():
    msgs = _tool_turn(json.dumps(ARGS))
    parsed = parse_tool_call_arguments(msgs)
    assert parsed[2]["tool_calls"][0]["function"]["arguments"] == ARGS
    assert msgs[2]["tool_calls"][0]["function"]["arguments"] == json.dumps(ARGS)  # input untouched
    assert parsed[0] == msgs[0] and parsed[3] == msgs[3]
    odd = [{"role": "assistant", "tool_calls": [_call("not json"), _call("[1, 2]")]}]
    assert parse_tool_call_arguments(odd) == odd


# ------------------------------------------------------------------------------------------
# Which template


DEFAULT_T = "{{ 'default' }}"
TOOL_T = "{{ 'tool_use' }}"
RAG_T = "{{ 'rag' }}"


def test_resolve_from_tokenizer_config():
    assert resolve_chat_template({"chat_template": DEFAULT_T}, None, None) == DEFAULT_T
    named = {"chat_template": [{"name": "default", "template": DEFAULT_T}, {"name": "tool_use", "template": TOOL_T},
                               {"name": "rag", "template": RAG_T}]}
    assert resolve_chat_template(named, None, None) == DEFAULT_T
    assert resolve_chat_template(named, None, None, tools=[WEATHER]) == TOOL_T
    assert resolve_chat_template(named, None, None, tools=[]) == DEFAULT_T
    assert resolve_chat_template(named, None, None, "rag") == RAG_T
    assert resolve_chat_template(named, None, None, "rag", tools=True) == RAG_T
    with pytest.raises(ChatTemplateError, match="no chat template named 'nope'.*default, rag, tool_use"):
        resolve_chat_template(named, None, None, "nope")
    no_default = {"chat_template": [{"name": "tool_use", "template": TOOL_T}, {"name": "rag", "template": RAG_T}]}
    with pytest.raises(ChatTemplateError, match="no default"):
        resolve_chat_template(no_default, None, None)
    assert resolve_chat_template(no_default, None, None, tools=True) == TOOL_T
    with pytest.raises(ChatTemplateError, match="tokenizer_config.json"):
        resolve_chat_template({"chat_template": [{"name": "x"}]}, None, None)


def test_resolve_precedence_and_gguf():
    cfg = {"chat_template": DEFAULT_T}
    assert resolve_chat_template(cfg, "{{ 'gguf' }}", None) == DEFAULT_T
    assert resolve_chat_template({"bos_token": "<s>"}, "{{ 'gguf' }}", None) == "{{ 'gguf' }}"
    assert resolve_chat_template(None, "{{ 'gguf' }}", None) == "{{ 'gguf' }}"
    assert resolve_chat_template(None, {"default": DEFAULT_T, "tool_use": TOOL_T}, None, tools=True) == TOOL_T
    assert resolve_chat_template(cfg, "{{ 'gguf' }}", "{{ 'inline' }}") == "{{ 'inline' }}"
    assert resolve_chat_template(None, None, None) is None
    assert resolve_chat_template({}, "", "") is None
    assert resolve_chat_template({"chat_template": None}, None, None) is None


def test_resolve_override(tmp_path):
    cfg = {"chat_template": [{"name": "default", "template": DEFAULT_T}, {"name": "rag", "template": RAG_T}]}
    jinja = tmp_path / "my template.jinja"
    jinja.write_text("{{ 'from file' }}\n", encoding="utf-8")
    assert resolve_chat_template(cfg, None, str(jinja)) == "{{ 'from file' }}\n"
    assert resolve_chat_template(cfg, None, jinja) == "{{ 'from file' }}\n"  # PathLike
    js = tmp_path / "chat_template.json"
    js.write_text(json.dumps({"chat_template": [{"name": "default", "template": "A"}, {"name": "tool_use", "template": "B"}]}))
    assert resolve_chat_template(None, None, str(js)) == "A"
    assert resolve_chat_template(None, None, str(js), tools=True) == "B"
    assert resolve_chat_template(cfg, None, "rag") == RAG_T  # a name of the model's own templates
    with pytest.raises(ChatTemplateError, match="not found: .*missing.jinja"):
        resolve_chat_template(cfg, None, str(tmp_path / "missing.jinja"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ChatTemplateError, match="not valid JSON"):
        resolve_chat_template(None, None, str(bad))


def test_resolved_none_gives_clear_error():
    template = resolve_chat_template({"bos_token": "<s>"}, None, None)
    assert template is None
    with pytest.raises(NoChatTemplateError) as info:
        render_chat_template(template, [{"role": "user", "content": "hi"}])
    assert "--chat-template" in str(info.value)
