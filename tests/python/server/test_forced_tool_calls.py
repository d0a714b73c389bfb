"""ForcedToolCallStream: the reply to tool_choice "required" or a named function, fed piece by
piece as a stream would be. The calls end where they are complete (what a small model rambles on
with afterwards is dropped and ``done`` tells the server to stop generating); a reply that is not
a call is content."""
import json

import pytest

from tallow.server.tool_parsers import ForcedToolCallStream, make_parser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
JUNK = "\n\nThe weather in Bern is {usually} nice <b>today</b>]."


def feed(stream: ForcedToolCallStream, text: str, size: int = 2, final: bool = True):
    """Feed text in pieces; returns (content, {index: [name, arguments]}, pieces fed when done turned True)."""
    content, calls, done_at = "", {}, None
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    for k, piece in enumerate(pieces):
        c, events = stream.feed(piece, final and k == len(pieces) - 1)
        content += c
        for e in events:
            if "id" in e:
                calls[e["index"]] = [e["function"]["name"], ""]
            else:
                calls[e["index"]][1] += e["function"]["arguments"]
        if stream.done and done_at is None:
            done_at = k + 1
    return content, calls, done_at


NAMED_REST = {"hermes": '"city": "Bern"}}\n</tool_call>', "mistral": '"city": "Bern"}}]',
              "llama": '"city": "Bern"}</function>', "llama3_json": '"city": "Bern"}}',
              "qwen3_coder": "<parameter=city>\nBern\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>"
                             "\n</tool_call>",
              "json": '"city": "Bern"}}'}


@pytest.mark.parametrize("name", list(NAMED_REST))
def test_a_named_call_ends_where_it_is_complete(name):
    p = make_parser(name, TOOLS)
    s = ForcedToolCallStream(p, p.forced_prefix("get_weather"), single_call=True)
    rest = NAMED_REST[name]
    content, calls, done_at = feed(s, rest + JUNK, size=2, final=False)
    assert s.done and not s.failed and content == ""
    assert done_at is not None and done_at * 2 <= len(rest) + 2  # stopped within a piece of the call's end
    expected = {"city": "Bern", "days": 2} if name == "qwen3_coder" else {"city": "Bern"}
    assert [(n, json.loads(a)) for n, a in calls.values()] == [("get_weather", expected)]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in s.tool_calls()] == \
        [("get_weather", expected)]
    assert s.feed("more", True) == ("", [])  # nothing after done


def test_required_takes_parallel_calls_then_stops_at_other_text():
    p = make_parser("hermes", TOOLS)
    s = ForcedToolCallStream(p, p.forced_prefix(None))
    text = ('search", "arguments": {"query": "q"}}\n</tool_call>\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Bern"}}\n</tool_call>')
    content, calls, done_at = feed(s, text + JUNK, final=False)
    assert s.done and content == ""
    assert [(n, json.loads(a)) for n, a in calls.values()] == [("search", {"query": "q"}),
                                                               ("get_weather", {"city": "Bern"})]
    assert done_at * 2 < len(text) + 8


def test_required_json_array_of_calls():
    p = make_parser("json", TOOLS)
    s = ForcedToolCallStream(p, p.forced_prefix(None))
    text = 'search", "arguments": {"query": "q"}}, {"name": "get_weather", "arguments": {"city": "x"}}'
    content, calls, _ = feed(s, text + JUNK, final=False)
    assert s.done and [n for n, _ in calls.values()] == ["search", "get_weather"]


def test_single_call_when_parallel_calls_are_off():
    p = make_parser("hermes", TOOLS)
    s = ForcedToolCallStream(p, p.forced_prefix(None), single_call=True)
    text = ('search", "arguments": {"query": "q"}}\n</tool_call>\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Bern"}}\n</tool_call>')
    _, calls, _ = feed(s, text, final=False)
    assert s.done and [n for n, _ in calls.values()] == ["search"]
    assert len(s.tool_calls()) == 1


def test_the_end_of_the_reply_completes_a_call_without_its_end_tag():
    p = make_parser("llama", TOOLS)
    s = ForcedToolCallStream(p, p.forced_prefix("search"), single_call=True)
    _, calls, _ = feed(s, '"query": "q"}', final=True)
    assert s.done and [(n, json.loads(a)) for n, a in calls.values()] == [("search", {"query": "q"})]


@pytest.mark.parametrize("name,function,text", [
    ("json", None, 'Paris", "city": "Paris"}'),  # a name that is no tool
    ("hermes", "get_weather", '"city": "Par'),  # cut off by max_tokens
    ("hermes", None, "I cannot call a tool."),
])
def test_a_reply_that_is_no_call_is_content(name, function, text):
    p = make_parser(name, TOOLS)
    prefix = p.forced_prefix(function)
    s = ForcedToolCallStream(p, prefix, single_call=function is not None)
    content, calls, _ = feed(s, text, size=len(text))  # one piece: no call was streamed before the end
    assert s.failed and not s.done
    assert content == prefix + text and s.content == prefix + text
    assert calls == {} and s.tool_calls() == []
