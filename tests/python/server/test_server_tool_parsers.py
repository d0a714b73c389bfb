"""Tool-call parsers on realistic model outputs of each format, whole and streamed in every
fragmentation: the streamed content and argument fragments must add up to the whole-text result,
a call's name must come before its arguments, and the arguments must be the JSON the model wrote."""
import json

import pytest

from conftest import data_dir
from tallow.server.tool_parsers import (PARSERS, ToolCallStream, detect_parser, make_parser, parse_tool_calls)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string"}, "days": {"type": "integer"},
                                          "unit": {"type": "string", "enum": ["c", "f"]}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "limit": {"type": "number"}, "exact": {"type": "boolean"},
        "filters": {"type": "object"}, "tags": {"type": "array"}}}}},
]

# (parser, model output, expected content, expected [(name, arguments as a dict)])
CASES = [
    # Qwen2.5 / Hermes: content first, two calls, nested and escaped JSON
    ("hermes", 'I will check both cities.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
               '"days": 3}}\n</tool_call>\n<tool_call>\n{"name": "search", "arguments": {"query": "say \\"hi\\" '
               '{not json}", "filters": {"lang": ["fr", "en"]}}}\n</tool_call>',
     "I will check both cities.\n",
     [("get_weather", {"city": "Paris", "days": 3}), ("search", {"query": 'say "hi" {not json}',
                                                                  "filters": {"lang": ["fr", "en"]}})]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich 東京 🌧"}}\n</tool_call>', "",
     [("get_weather", {"city": "Zürich 東京 🌧"})]),
    ("hermes", "The weather is nice today.", "The weather is nice today.", []),
    ("hermes", "Use <tool_call> tags? No.", "Use <tool_call> tags? No.", []),  # not JSON after the tag: content
    # Mistral v3 / Nemo: a JSON array after [TOOL_CALLS]
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, {"name": "search",'
                ' "arguments": {"query": "rain", "limit": 5}}]', "",
     [("get_weather", {"city": "Paris", "unit": "c"}), ("search", {"query": "rain", "limit": 5})]),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "search", "arguments": "{\\"query\\": \\"a\\\\nb\\"}"}]', "Sure. ",
     [("search", {"query": "a\nb"})]),  # arguments given as a JSON string
    # Mistral v11+: name[ARGS]{...}, with and without [CALL_ID]
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]search[CALL_ID]a1B2c3D4e[ARGS]{"query": "x"}',
     "", [("get_weather", {"city": "Oslo"}), ("search", {"query": "x"})]),
    # Llama 3.1 custom format / Functionary v3.1
    ("llama", 'Checking.<function=get_weather>{"city": "Lima", "days": 2}</function>\n'
              '<function=search>{"query": "llama <b>html</b>"}</function>', "Checking.",
     [("get_weather", {"city": "Lima", "days": 2}), ("search", {"query": "llama <b>html</b>"})]),
    ("llama", "<function=search></function>", "", [("search", {})]),
    # Llama 3.x JSON
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome"}}', "", [("get_weather", {"city": "Rome"})]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "search", '
                    '"parameters": {"query": "pasta", "exact": true}}', "",
     [("get_weather", {"city": "Rome"}), ("search", {"query": "pasta", "exact": True})]),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call
    ("llama3_json", '{"name": "Alice", "parameters": {}}', '{"name": "Alice", "parameters": {}}', []),  # unknown tool
    ("llama3_json", "It is sunny in Rome.", "It is sunny in Rome.", []),
    # Qwen3-Coder XML: parameter values typed by the schema
    ("qwen3_coder", 'Let me look.\n<tool_call>\n<function=search>\n<parameter=query>\nfind "x" < y\n</parameter>\n'
                    "<parameter=limit>\n2.5\n</parameter>\n<parameter=exact>\nTrue\n</parameter>\n<parameter=filters>\n"
                    '{"a": [1, 2]}\n</parameter>\n<parameter=tags>\n["t1"]\n</parameter>\n</function>\n</tool_call>\n'
                    "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\n7\n"
                    "</parameter>\n</function>\n</tool_call>",
     "Let me look.\n",
     [("search", {"query": 'find "x" < y', "limit": 2.5, "exact": True, "filters": {"a": [1, 2]}, "tags": ["t1"]}),
      ("get_weather", {"city": "42", "days": 7})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nmulti\nline\n</parameter>\n</function>\n"
                    "</tool_call>", "", [("get_weather", {"city": "multi\nline"})]),
    # generic JSON
    ("json", '```json\n{"name": "search", "arguments": {"query": "q"}}\n```', "", [("search", {"query": "q"})]),
    ("json", '[{"name": "search", "arguments": {"query": "a"}}, {"name": "get_weather", "arguments": {"city": "b"}}]',
     "", [("search", {"query": "a"}), ("get_weather", {"city": "b"})]),
    ("json", '{"tool_calls": [{"name": "search", "arguments": {"query": "w"}}]}', "", [("search", {"query": "w"})]),
    ("json", "Plain answer with {braces}.", "Plain answer with {braces}.", []),
]


def streamed(name, text, cuts, prefix=""):
    """Feed text in pieces split at cuts; returns (content, [(name, args)], events) and checks the
    shape of the tool-call deltas."""
    s = ToolCallStream(make_parser(name, TOOLS), prefix)
    content, calls, events = "", {}, []
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    for k, piece in enumerate(pieces + [""]):
        c, evs = s.feed(piece, final=k == len(pieces))
        content += c
        for e in evs:
            events.append(e)
            i = e["index"]
            if "id" in e:  # the first delta of a call: id, type and name, no arguments yet
                assert i == len(calls) and e["type"] == "function" and e["function"]["arguments"] == ""
                assert e["function"]["name"]
                calls[i] = [e["function"]["name"], ""]
            else:
                assert set(e) == {"index", "function"} and set(e["function"]) == {"arguments"}
                assert i in calls, "arguments before the name"
                calls[i][1] += e["function"]["arguments"]
    return content, [tuple(calls[i]) for i in sorted(calls)], events


def check(name, text, content, expected, got_content, got_calls):
    assert got_content == content
    assert [n for n, _ in got_calls] == [n for n, _ in expected]
    for (_, args), (_, exp) in zip(got_calls, expected):
        assert json.loads(args) == exp


@pytest.mark.parametrize("name,text,content,expected", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_whole_text(name, text, content, expected):
    got_content, calls = parse_tool_calls(make_parser(name, TOOLS), text)
    check(name, text, content, expected, got_content, [(c["function"]["name"], c["function"]["arguments"])
                                                         for c in calls])
    ids = [c["id"] for c in calls]
    assert len(set(ids)) == len(ids)
    if name == "mistral":
        assert all(len(i) == 9 and i.isalnum() for i in ids)


@pytest.mark.parametrize("name,text,content,expected", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_streamed_one_character_at_a_time(name, text, content, expected):
    got_content, calls, _ = streamed(name, text, list(range(1, len(text))))
    check(name, text, content, expected, got_content, calls)
    if expected:  # arguments arrive in fragments, not only at the end
        frags = [e for e in streamed(name, text, list(range(1, len(text))))[2] if "id" not in e]
        assert len(frags) >= len(expected)


@pytest.mark.parametrize("name,text,content,expected", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_streamed_in_random_chunks(name, text, content, expected, rng):
    for _ in range(20):
        k = int(rng.integers(1, max(2, len(text) // 3)))
        cuts = sorted(set(int(c) for c in rng.integers(1, len(text), k))) if len(text) > 1 else []
        got_content, calls, _ = streamed(name, text, cuts)
        check(name, text, content, expected, got_content, calls)


@pytest.mark.parametrize("name,text,content,expected", CASES[:1] + CASES[4:5] + CASES[7:8],
                         ids=["hermes", "mistral", "llama"])
def test_every_single_split_point(name, text, content, expected):
    for cut in range(1, len(text)):
        got_content, calls, _ = streamed(name, text, [cut])
        check(name, text, content, expected, got_content, calls)


def test_arguments_are_the_models_own_json_text():
    text = '<tool_call>\n{"name": "search", "arguments": {"query":"a",  "limit" : 3}}\n</tool_call>'
    _, calls = parse_tool_calls(make_parser("hermes", TOOLS), text)
    assert calls[0]["function"]["arguments"] == '{"query":"a",  "limit" : 3}'
    _, streamed_calls, _ = streamed("hermes", text, list(range(1, len(text), 2)))
    assert streamed_calls[0][1] == '{"query":"a",  "limit" : 3}'


@pytest.mark.parametrize("name", ["hermes", "mistral", "llama", "llama3_json", "qwen3_coder", "json"])
def test_forced_prefix_plus_model_output(name):
    """tool_choice required / a named function: the prompt ends with the start of a call and the
    model only writes the rest; parsing sees both."""
    p = make_parser(name, TOOLS)
    prefix = p.forced_prefix("get_weather")
    rest = {"hermes": '"city": "Bern"}}\n</tool_call>', "mistral": '"city": "Bern"}}]',
            "llama": '"city": "Bern"}</function>', "llama3_json": '"city": "Bern"}}',
            "qwen3_coder": "<parameter=city>\nBern\n</parameter>\n</function>\n</tool_call>",
            "json": '"city": "Bern"}}'}[name]
    content, calls = parse_tool_calls(p, rest, prefix=prefix)
    assert content == ""
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Bern"})]
    # required (no name): the model picks the function
    prefix = p.forced_prefix(None)
    rest = {"hermes": 'search", "arguments": {"query": "q"}}</tool_call>', "mistral": 'search", "arguments": {"query": "q"}}]',
            "llama": 'search>{"query": "q"}</function>', "llama3_json": 'search", "parameters": {"query": "q"}}',
            "qwen3_coder": "search>\n<parameter=query>\nq\n</parameter>\n</function>",
            "json": 'search", "arguments": {"query": "q"}}'}[name]
    content, calls = parse_tool_calls(make_parser(name, TOOLS), rest, prefix=prefix)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("search", {"query": "q"})]


@pytest.mark.parametrize("name,text", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),  # cut off by max_tokens
    ("hermes", '<tool_call>\n{"arguments": {"city": "x"}}\n</tool_call>'),  # no name
    ("mistral", "[TOOL_CALLS]not json at all"),
    ("llama", "<function=get_weather"),
    ("qwen3_coder", "<tool_call>\n<function="),
    ("json", '{"name": "search", "arguments": {"query": "q"'),
])
def test_malformed_calls_become_content_when_not_streamed(name, text):
    content, calls = parse_tool_calls(make_parser(name, TOOLS), text)
    assert calls == [] and content == text


def test_a_truncated_stream_keeps_what_was_sent():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    content, calls, _ = streamed("hermes", text, list(range(1, len(text))))
    assert content == "" and calls == [("get_weather", '{"city": "Par')]


def test_text_that_might_start_a_marker_is_held_back():
    s = ToolCallStream(make_parser("hermes", TOOLS))
    assert s.feed("Hi <tool") == ("Hi ", [])
    assert s.feed("box>") == ("<toolbox>", [])
    s = ToolCallStream(make_parser("llama3_json", TOOLS))
    assert s.feed("<|python") == ("", [])
    assert s.feed('_tag|>{"name": "search", "para') == ("", [{"index": 0, "id": s.calls[0].id, "type": "function",
                                                              "function": {"name": "search", "arguments": ""}}])


def test_parser_names_and_unknown():
    assert {"hermes", "qwen", "mistral", "llama", "llama3_json", "qwen3_coder", "json"} <= set(PARSERS)
    with pytest.raises(ValueError, match="unknown tool parser"):
        make_parser("nope")


@pytest.mark.parametrize("template,family,expected", [
    ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", "llama", "hermes"),
    ("Qwen-Qwen2.5-7B-Instruct.jinja", "qwen2", "hermes"),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral", "mistral"),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama", "llama3_json"),
    ("meta-llama-Llama-3.2-3B-Instruct.jinja", "llama", "llama3_json"),
    ("meetkai-functionary-medium-v3.1.jinja", "llama", "llama"),
    ("google-gemma-2-2b-it.jinja", "gemma2", "json"),
])
def test_detect_from_real_templates(template, family, expected):
    path = data_dir() / "chat-templates" / template
    if not path.is_file():
        pytest.skip(f"{path} not found (set TALLOW_TEST_DATA)")
    assert detect_parser(path.read_text(), family) == expected


def test_detect_by_family_and_qwen3_coder():
    assert detect_parser(None, "qwen3") == "hermes"
    assert detect_parser(None, "mistral") == "mistral"
    assert detect_parser(None, "llama") == "json"
    assert detect_parser("... <tool_call>\n<function=name>\n<parameter=x> ...", "qwen3_moe") == "qwen3_coder"
