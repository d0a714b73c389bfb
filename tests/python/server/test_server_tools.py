"""Tool calling and reasoning end to end: the openai client against the server driving a scripted
engine whose output text is fixed (one piece per step), in every parser format; tool_choice
none/auto/required/named; several calls per message; streamed tool-call deltas (name first, then
argument fragments) and finish_reason "tool_calls"; <think> split into reasoning_content; a model
step that fails; a full queue."""
import json
import re
import threading

import pytest

openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")

from server_harness import CHAT_TEMPLATE, pieces  # noqa: E402
from tallow.server.keys import STATE  # noqa: E402

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                                                      "days": {"type": "integer"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object",
                                                                       "properties": {"query": {"type": "string"}}}}},
]
MSGS = [{"role": "user", "content": "t5 t6"}]


def stream_tool_calls(chunks, choice: int = 0):
    """(content, {index: [id, name, arguments]}, finish reasons, argument fragments) of one choice from
    streamed chunks, checking that a call's first delta carries its id and name and the later ones
    only argument fragments."""
    content, calls, finishes, fragments = "", {}, [], 0
    for ch in chunks:
        for c in ch.choices:
            if c.index != choice:
                continue
            d = c.delta
            content += d.content or ""
            for t in d.tool_calls or []:
                if t.id is not None:
                    assert t.index not in calls and t.function.name and t.type == "function"
                    calls[t.index] = [t.id, t.function.name, t.function.arguments or ""]
                else:
                    assert t.index in calls, "arguments before the name"
                    assert t.function.name is None
                    calls[t.index][2] += t.function.arguments
                    fragments += 1
            if c.finish_reason:
                finishes.append(c.finish_reason)
    return content, calls, finishes, fragments


OUTPUTS = {
    "hermes": 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
              '<tool_call>\n{"name": "search", "arguments": {"query": "umbrella"}}\n</tool_call>',
    "mistral": 'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
               '{"name": "search", "arguments": {"query": "umbrella"}}]',
    "llama": 'Checking.<function=get_weather>{"city": "Paris", "days": 2}</function>'
             '<function=search>{"query": "umbrella"}</function>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
                   '{"name": "search", "parameters": {"query": "umbrella"}}',
    "qwen3_coder": "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                   "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=search>\n"
                   "<parameter=query>\numbrella\n</parameter>\n</function>\n</tool_call>",
    "json": '```json\n[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
            '{"name": "search", "arguments": {"query": "umbrella"}}]\n```',
}
EXPECTED = [("get_weather", {"city": "Paris", "days": 2}), ("search", {"query": "umbrella"})]


@pytest.mark.parametrize("parser", list(OUTPUTS))
def test_tool_calls_in_every_format(scripted, parser):
    s = scripted(tool_parser=parser)
    text = OUTPUTS[parser]
    s.script(text, text)
    r = s.client.chat.completions.create(model="scripted", messages=MSGS, tools=TOOLS)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == EXPECTED
    assert all(c.type == "function" and c.id for c in msg.tool_calls)
    assert len({c.id for c in msg.tool_calls}) == 2
    expected_content = "Checking." if text.startswith("Checking.") else None
    assert (msg.content.strip() if msg.content else None) == expected_content

    content, calls, finishes, fragments = stream_tool_calls(
        s.client.chat.completions.create(model="scripted", messages=MSGS, tools=TOOLS, stream=True))
    assert finishes == ["tool_calls"]
    assert [(calls[i][1], json.loads(calls[i][2])) for i in sorted(calls)] == EXPECTED
    assert [calls[i][2] for i in sorted(calls)] == [c.function.arguments for c in msg.tool_calls]
    assert fragments >= 2  # arguments arrive in pieces
    assert content.strip() == (expected_content or "")


def test_tools_are_rendered_and_parser_detected_from_the_template(scripted):
    template = CHAT_TEMPLATE + "{% if tools %} <tool_call> {% endif %}"  # a Hermes-style template
    s = scripted(template=template)
    assert s.srv.app[STATE].tool_parser_name == "hermes"
    s.script(OUTPUTS["hermes"])
    r = s.client.chat.completions.create(model="scripted", messages=MSGS, tools=TOOLS, tool_choice="auto")
    assert len(r.choices[0].message.tool_calls) == 2
    assert "t6 get_weather search" in s.encoded[-1]  # the template saw the tools


def test_tool_choice_none_leaves_tools_out_and_does_not_parse(scripted):
    s = scripted(tool_parser="hermes")
    s.script(OUTPUTS["hermes"])
    r = s.client.chat.completions.create(model="scripted", messages=MSGS, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == OUTPUTS["hermes"]
    assert r.choices[0].finish_reason == "stop"
    assert "get_weather" not in s.encoded[-1]


@pytest.mark.parametrize("parser", ["hermes", "mistral", "llama", "llama3_json", "qwen3_coder", "json"])
def test_named_function_is_forced_by_the_prompt(scripted, parser):
    from tallow.server.tool_parsers import make_parser

    s = scripted(tool_parser=parser)
    prefix = make_parser(parser).forced_prefix("get_weather")
    rest = {"hermes": '"city": "Oslo"}}\n</tool_call>', "mistral": '"city": "Oslo"}}]',
            "llama": '"city": "Oslo"}</function>', "llama3_json": '"city": "Oslo"}}',
            "qwen3_coder": "<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>",
            "json": '"city": "Oslo"}}'}[parser]
    s.script(rest, rest)
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = s.client.chat.completions.create(model="scripted", messages=MSGS, tools=TOOLS, tool_choice=choice)
    assert s.encoded[-1].endswith(prefix)
    calls = r.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert r.choices[0].message.content is None and r.choices[0].finish_reason == "tool_calls"
    content, streamed, finishes, _ = stream_tool_calls(
        s.client.chat.completions.create(model="scripted", messages=MSGS, tools=TOOLS, tool_choice=choice,
                                         stream=True))
    assert [(v[1], json.loads(v[2])) for v in streamed.values()] == [("get_weather", {"city": "Oslo"})]
    assert content == "" and finishes == ["tool_calls"]


def test_tool_choice_required(scripted):
    s = scripted(tool_parser="hermes")
    s.script('search", "arguments": {"query": "x"}}\n</tool_call>')
    r = s.client.chat.completions.create(model="scripted", messages=MSGS, tools=TOOLS, tool_choice="required")
    assert s.encoded[-1].endswith('<tool_call>\n{"name": "')
    assert r.choices[0].message.tool_calls[0].function.name == "search"


# -- forced calls: a small model goes on after the call (the demo model did), or writes no call ----
RAMBLE = ["\n\nThe", " weather", " in", " Paris", " is", " {nice}", " </tool_call>", "."] * 4
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_named_tool_choice_returns_tool_calls_and_stops_generating(scripted):
    s = scripted(tool_parser="json")
    call = pieces('"city": "Paris"}}')
    s.script(call + RAMBLE, call + RAMBLE)
    r = s.client.chat.completions.create(model="scripted", messages=MSGS, tools=TOOLS, tool_choice=NAMED)
    assert s.encoded[-1].endswith('{"name": "get_weather", "arguments": {')
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert len(msg.tool_calls) == 1 and msg.tool_calls[0].type == "function" and msg.tool_calls[0].id
    assert (msg.tool_calls[0].function.name, json.loads(msg.tool_calls[0].function.arguments)) == \
        ("get_weather", {"city": "Paris"})
    assert r.usage.completion_tokens == len(call)  # the ramble after the call was never generated
    s.srv.wait_idle()  # and the request is gone from the engine, its blocks free
    content, calls, finishes, fragments = stream_tool_calls(s.client.chat.completions.create(
        model="scripted", messages=MSGS, tools=TOOLS, tool_choice=NAMED, stream=True))
    assert content == "" and finishes == ["tool_calls"] and fragments >= 2
    assert [(v[1], json.loads(v[2])) for v in calls.values()] == [("get_weather", {"city": "Paris"})]
    s.srv.wait_idle()
    metrics = requests.get(s.srv.base_url + "/metrics").text
    assert re.search(r'tallow:request_success_total\{[^}]*finished_reason="tool_calls"[^}]*\} 2\.0', metrics)


def test_forced_calls_of_several_choices_end_each_on_their_own(scripted):
    s = scripted(tool_parser="hermes")
    short, long = pieces('"city": "Oslo"}}\n</tool_call>') + RAMBLE, pieces('"city": "Rome", "days": 3}}') + RAMBLE
    s.script((short, long), (short, long))
    r = s.client.chat.completions.create(model="scripted", messages=MSGS, tools=TOOLS, tool_choice=NAMED, n=2)
    assert [json.loads(c.message.tool_calls[0].function.arguments) for c in r.choices] == \
        [{"city": "Oslo"}, {"city": "Rome", "days": 3}]
    assert [c.finish_reason for c in r.choices] == ["tool_calls", "tool_calls"]
    chunks = list(s.client.chat.completions.create(model="scripted", messages=MSGS, tools=TOOLS, tool_choice=NAMED,
                                                   n=2, stream=True))
    for i, city in enumerate(["Oslo", "Rome"]):
        content, calls, finishes, _ = stream_tool_calls(chunks, choice=i)
        assert content == "" and finishes == ["tool_calls"] and json.loads(calls[0][2])["city"] == city
    s.srv.wait_idle()


def test_required_returns_tool_calls_to_the_openai_client(scripted):
    s = scripted(tool_parser="hermes")
    two = ('search", "arguments": {"query": "x"}}\n</tool_call>\n<tool_call>\n'
           '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    s.script(pieces(two) + RAMBLE, pieces(two) + RAMBLE)
    r = s.client.chat.completions.create(model="scripted", messages=MSGS, tools=TOOLS, tool_choice="required")
    assert s.encoded[-1].endswith('<tool_call>\n{"name": "')  # two tools: the model picks
    fn = r.choices[0].message.tool_calls[0].function
    assert (fn.name, json.loads(fn.arguments)) == ("search", {"query": "x"})
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["search", "get_weather"]
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    content, calls, finishes, _ = stream_tool_calls(s.client.chat.completions.create(
        model="scripted", messages=MSGS, tools=TOOLS, tool_choice="required", stream=True))
    assert content == "" and finishes == ["tool_calls"]
    assert [(v[1], json.loads(v[2])) for v in calls.values()] == [("search", {"query": "x"}),
                                                                  ("get_weather", {"city": "Oslo"})]
    s.srv.wait_idle()


def test_required_with_one_tool_or_parallel_calls_off(scripted):
    s = scripted(tool_parser="hermes")
    s.script('"city": "Rome"}}\n</tool_call>')
    r = s.client.chat.completions.create(model="scripted", messages=MSGS, tools=TOOLS[:1], tool_choice="required")
    assert s.encoded[-1].endswith('{"name": "get_weather", "arguments": {')  # one tool: that one
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    two = ('search", "arguments": {"query": "x"}}\n</tool_call>\n<tool_call>\n'
           '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    s.script(two)
    r = s.client.chat.completions.create(model="scripted", messages=MSGS, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["search"]
    assert r.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("max_tokens,finish", [(None, "stop"), (4, "length")])
def test_forced_reply_that_is_no_call_is_content(scripted, max_tokens, finish):
    """The model writes no call (here an unknown function, or a call cut off by max_tokens): the
    text is the content, with the finish reason as generated; no 500."""
    s = scripted(tool_parser="json")
    text = 'Paris", "city": "Paris"}' if max_tokens is None else '"city": "Paris", "days": 3}}'
    s.script(text, text)
    prefix = '{"name": "' if max_tokens is None else '{"name": "get_weather", "arguments": {'
    generated = text if max_tokens is None else "".join(pieces(text)[:max_tokens])
    choice = "required" if max_tokens is None else NAMED
    r = s.client.chat.completions.create(model="scripted", messages=MSGS, tools=TOOLS, tool_choice=choice,
                                         max_tokens=max_tokens)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == prefix + generated and r.choices[0].finish_reason == finish
    chunks = list(s.client.chat.completions.create(model="scripted", messages=MSGS, tools=TOOLS, tool_choice=choice,
                                                   max_tokens=max_tokens, stream=True))
    content, calls, finishes, _ = stream_tool_calls(chunks)
    assert finishes == [finish]
    if max_tokens is None:  # nothing looked like a call: all of it comes as content
        assert content == prefix + generated and calls == {}
    else:  # the call's start was streamed as it came; it cannot be taken back
        assert content == "" and [v[1] for v in calls.values()] == ["get_weather"]


def test_tool_choice_errors(scripted):
    s = scripted(tool_parser="hermes")
    with pytest.raises(openai.BadRequestError, match="not in 'tools'"):
        s.client.chat.completions.create(model="scripted", messages=MSGS, tools=TOOLS,
                                         tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="required needs 'tools'"):
        s.client.chat.completions.create(model="scripted", messages=MSGS, tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="tools"):
        s.client.chat.completions.create(model="scripted", messages=MSGS, tools=[{"type": "function"}])


def test_plain_reply_with_tools_available(scripted):
    s = scripted(tool_parser="hermes")
    s.script("No tool needed: it is sunny.", "No tool needed: it is sunny.")
    r = s.client.chat.completions.create(model="scripted", messages=MSGS, tools=TOOLS)
    assert r.choices[0].message.content == "No tool needed: it is sunny."
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    content, calls, finishes, _ = stream_tool_calls(
        s.client.chat.completions.create(model="scripted", messages=MSGS, tools=TOOLS, stream=True))
    assert content == "No tool needed: it is sunny." and not calls and finishes == ["stop"]


def test_n_choices_each_parse_their_own_calls(scripted):
    s = scripted(tool_parser="hermes")
    s.script(OUTPUTS["hermes"])
    chunks = list(s.client.chat.completions.create(model="scripted", messages=MSGS, tools=TOOLS, n=2, stream=True))
    for i in range(2):
        content, calls, finishes, _ = stream_tool_calls(chunks, choice=i)
        assert finishes == ["tool_calls"] and content == "Checking."
        assert [(calls[k][1], json.loads(calls[k][2])) for k in sorted(calls)] == EXPECTED


def test_choices_that_finish_at_different_steps(scripted):
    """n = 2 where one choice ends earlier: each choice gets exactly one finish chunk, in chat and in
    completions, streamed and not."""
    s = scripted()
    short, long = ["a", "b"], ["c", "d", "e", "f"]
    s.script((short, long), (short, long), (short, long), (short, long))
    r = s.client.chat.completions.create(model="scripted", messages=MSGS, n=2)
    assert [c.message.content for c in r.choices] == ["ab", "cdef"]
    chunks = list(s.client.chat.completions.create(model="scripted", messages=MSGS, n=2, stream=True))
    finishes = [(c.index, c.finish_reason) for ch in chunks for c in ch.choices if c.finish_reason]
    assert sorted(finishes) == [(0, "stop"), (1, "stop")]
    text = {0: "", 1: ""}
    for ch in chunks:
        for c in ch.choices:
            text[c.index] += c.delta.content or ""
    assert text == {0: "ab", 1: "cdef"}
    r = s.client.completions.create(model="scripted", prompt="t5", n=2)
    assert [c.text for c in r.choices] == ["ab", "cdef"]
    chunks = list(s.client.completions.create(model="scripted", prompt="t5", n=2, stream=True))
    finishes = [(c.index, c.finish_reason) for ch in chunks for c in ch.choices if c.finish_reason]
    assert sorted(finishes) == [(0, "stop"), (1, "stop")]


# -- reasoning ---------------------------------------------------------------------------------
THINK_TEMPLATE = CHAT_TEMPLATE + ("{% if enable_thinking is defined and not enable_thinking %} t8{% endif %}"
                                  "{# models of this family wrap reasoning in <think>...</think> #}")


def test_reasoning_content_is_split_off(scripted):
    s = scripted(template=THINK_TEMPLATE)
    assert s.srv.app[STATE].reasoning
    out = ["<think>", "\nThe user", " greets me.", "\n</think>", "\n\n", "Hello", " there!"]
    s.script(out, out)
    r = s.client.chat.completions.create(model="scripted", messages=MSGS)
    msg = r.choices[0].message
    assert msg.content == "Hello there!"
    assert msg.model_extra["reasoning_content"] == "\nThe user greets me.\n"
    reasoning, content = "", ""
    for ch in s.client.chat.completions.create(model="scripted", messages=MSGS, stream=True):
        for c in ch.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            content += c.delta.content or ""
    assert (reasoning, content) == ("\nThe user greets me.\n", "Hello there!")


def test_reasoning_opened_by_the_prompt_and_enable_thinking(scripted):
    template = THINK_TEMPLATE + "{% if add_generation_prompt %} <think>\n{% endif %}"  # DeepSeek-R1 style
    s = scripted(template=template)
    s.script("Short thought.</think>Answer.", "x")
    r = s.client.chat.completions.create(model="scripted", messages=MSGS)
    assert r.choices[0].message.model_extra["reasoning_content"] == "Short thought."
    assert r.choices[0].message.content == "Answer."
    s.client.chat.completions.create(model="scripted", messages=MSGS,
                                     extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert " t8" in s.encoded[-1]


def test_reasoning_then_tool_call(scripted):
    s = scripted(template=THINK_TEMPLATE + " <tool_call>")
    s.script("<think>I need the weather.</think>\n" + OUTPUTS["hermes"][len("Checking."):])
    r = s.client.chat.completions.create(model="scripted", messages=MSGS, tools=TOOLS)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == "I need the weather."
    assert [c.function.name for c in msg.tool_calls] == ["get_weather", "search"]
    assert r.choices[0].finish_reason == "tool_calls"


def test_no_reasoning_split_without_think_in_the_template(scripted):
    s = scripted()
    s.script("<think>x</think>y")
    r = s.client.chat.completions.create(model="scripted", messages=MSGS)
    assert r.choices[0].message.content == "<think>x</think>y"
    assert "reasoning_content" not in (r.choices[0].message.model_extra or {})


# -- failures ----------------------------------------------------------------------------------
def test_a_failed_step_is_a_500_without_traceback(scripted):
    s = scripted()
    s.engine.fail_next_step = True
    r = requests.post(s.srv.base_url + "/v1/chat/completions", json={"messages": MSGS})
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["code"] == "engine_error" and "Traceback" not in r.text and "scripted failure" not in r.text
    s.engine.fail_next_step = True
    r = requests.post(s.srv.base_url + "/v1/chat/completions", json={"messages": MSGS, "stream": True})
    events = [e for e in r.text.split("\n\n") if e]
    assert json.loads(events[-2][len("data: "):])["error"]["code"] == "engine_error"
    assert events[-1] == "data: [DONE]"
    assert s.client.chat.completions.create(model="scripted", messages=MSGS).choices[0].message.content == \
        "Hello world!"  # the server goes on


def test_full_queue_is_503(scripted):
    s = scripted(max_pending=1)
    gate = threading.Event()
    real_step = s.engine.step

    def slow_step():
        gate.wait(10)
        return real_step()

    s.engine.step = slow_step
    first = []
    t = threading.Thread(target=lambda: first.append(
        requests.post(s.srv.base_url + "/v1/chat/completions", json={"messages": MSGS})))
    t.start()
    try:
        for _ in range(200):
            if s.srv.engine.num_unfinished:
                break
            threading.Event().wait(0.01)
        r = requests.post(s.srv.base_url + "/v1/chat/completions", json={"messages": MSGS})
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy"
        assert r.headers.get("Retry-After") == "1"
    finally:
        gate.set()
        t.join(10)
    assert first[0].status_code == 200


def test_a_dead_engine_is_503(scripted):
    s = scripted()

    def die():
        raise KeyboardInterrupt("the step thread is gone")

    s.engine.step = die
    r = requests.post(s.srv.base_url + "/v1/chat/completions", json={"messages": MSGS})
    assert r.status_code == 503
    assert requests.get(s.srv.base_url + "/health").status_code == 503
    r = requests.post(s.srv.base_url + "/v1/chat/completions", json={"messages": MSGS})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
