"""POST /v1/responses (OpenAI's Responses API) through the official openai client: against a tiny random
Llama (greedy text equal to the chat endpoint's for the same conversation, streaming events in order,
previous_response_id reusing the earlier prompt's KV blocks, store, GET / DELETE, 400s and 404s, a client
that leaves mid-stream) and against a scripted engine whose text is fixed (function tools, reasoning, a
failed step)."""
import json

import pytest

openai = pytest.importorskip("openai")
aiohttp = pytest.importorskip("aiohttp")
requests = pytest.importorskip("requests")

from server_harness import CHAT_TEMPLATE, ServerThread, disconnect_mid_stream, pieces, write_tiny_llama  # noqa: E402
from tallow.engine.args import EngineArgs  # noqa: E402
from tallow.engine.engine import LLMEngine  # noqa: E402

USER = "t11 t12 t13"
# long enough that its rendered prompt fills two 16-token KV blocks, which a follow-up finds in the prefix cache
LONG_USER = " ".join(f"t{40 + i}" for i in range(40))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = write_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", seed=7)
    srv = ServerThread(LLMEngine(EngineArgs(model=str(model_dir), num_kv_blocks=64)), model_names=["tiny"])
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    server.wait_idle()  # after every test: no request left, every block free


def chat(client, messages, n_tokens):
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=n_tokens, temperature=0,
                                          extra_body={"ignore_eos": True})


def respond(client, n_tokens, **kw):
    return client.responses.create(model="tiny", max_output_tokens=n_tokens, temperature=0,
                                   extra_body={"ignore_eos": True}, **kw)


# -- text ------------------------------------------------------------------------------------------
def test_plain_text_is_the_chat_reply(client):
    r = respond(client, 8, input=USER)
    ref = chat(client, [{"role": "user", "content": USER}], 8)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert r.output_text == ref.choices[0].message.content and r.output_text
    [msg] = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "output_text"
    assert r.usage.input_tokens == ref.usage.prompt_tokens
    assert r.usage.output_tokens == 8 and r.usage.total_tokens == r.usage.input_tokens + 8
    # cut off by max_output_tokens: incomplete, as OpenAI reports it
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert msg.status == "incomplete"


def test_a_reply_that_ends_itself_is_completed(client):
    r = client.responses.create(model="tiny", input=USER, max_output_tokens=200, temperature=0)
    ref = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": USER}], max_tokens=200,
                                         temperature=0)
    finish = ref.choices[0].finish_reason
    assert r.output_text == ref.choices[0].message.content
    assert r.status == ("incomplete" if finish == "length" else "completed")
    assert r.usage.output_tokens == ref.usage.completion_tokens


def test_instructions_and_input_items_are_the_chat_messages(client):
    r = respond(client, 6, instructions="t9 t10", input=USER)
    ref = chat(client, [{"role": "system", "content": "t9 t10"}, {"role": "user", "content": USER}], 6)
    assert r.output_text == ref.choices[0].message.content
    assert r.usage.input_tokens == ref.usage.prompt_tokens and r.instructions == "t9 t10"
    items = [{"role": "developer", "content": "t9 t10"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "t11 "},
                                                            {"type": "input_text", "text": "t12"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "t30 t31"}]},
             {"role": "user", "content": "t13"}]
    r = respond(client, 6, input=items)
    ref = chat(client, [{"role": "system", "content": "t9 t10"}, {"role": "user", "content": "t11 t12"},
                        {"role": "assistant", "content": "t30 t31"}, {"role": "user", "content": "t13"}], 6)
    assert r.output_text == ref.choices[0].message.content
    assert r.usage.input_tokens == ref.usage.prompt_tokens


# -- streaming -------------------------------------------------------------------------------------
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added"]
TEXT_END = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def test_streaming_events_in_order_and_deltas_add_up(client):
    whole = respond(client, 12, input=USER)
    events = list(respond(client, 12, input=USER, stream=True))
    kinds = [e.type for e in events]
    n_deltas = kinds.count("response.output_text.delta")
    assert kinds == TEXT_EVENTS + ["response.output_text.delta"] * n_deltas + TEXT_END + ["response.incomplete"]
    assert n_deltas >= 2
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response
    assert deltas == done.text == final.output_text == whole.output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    rid = events[0].response.id
    assert final.id == rid and final.usage.output_tokens == 12
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}


def test_the_sdk_stream_helper_ends_a_cut_off_reply_with_response_incomplete(client):
    """The SDK's stream helper accumulates the events; a reply cut off by max_output_tokens ends with
    response.incomplete (get_final_response is for response.completed, see the scripted tests)."""
    with client.responses.stream(model="tiny", input=USER, max_output_tokens=10, temperature=0,
                                 extra_body={"ignore_eos": True}) as stream:
        events = list(stream)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == text and text


# -- previous_response_id, store, GET, DELETE -------------------------------------------------------
def test_previous_response_id_continues_and_reuses_the_prefix_cache(client):
    first = respond(client, 5, input=LONG_USER)
    second = respond(client, 5, input="t20 t21", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    ref = chat(client, [{"role": "user", "content": LONG_USER}, {"role": "assistant", "content": first.output_text},
                        {"role": "user", "content": "t20 t21"}], 5)
    assert second.output_text == ref.choices[0].message.content
    assert second.usage.input_tokens == ref.usage.prompt_tokens
    # the first prompt's full blocks (the conversation so far, rendered as before) come from the prefix cache
    assert second.usage.input_tokens_details.cached_tokens >= 32
    assert second.usage.input_tokens_details.cached_tokens <= first.usage.input_tokens
    third = respond(client, 5, input="t22", previous_response_id=second.id)
    assert third.usage.input_tokens > second.usage.input_tokens  # the whole chain, not only the last turn
    assert third.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens_details.cached_tokens


def test_retrieve_and_delete(client):
    r = respond(client, 4, input=USER, metadata={"k": "v"})
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.metadata == {"k": "v"}
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        respond(client, 4, input=USER, previous_response_id=r.id)


def test_store_false_is_not_kept(client):
    r = respond(client, 4, input=USER, store=False)
    assert r.store is False and r.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        respond(client, 4, input=USER, previous_response_id=r.id)
    assert e.value.status_code == 404 and e.value.body["param"] == "previous_response_id"


def test_unknown_previous_response_id_is_404(client, server):
    r = requests.post(server.base_url + "/v1/responses", json={"input": "t5", "previous_response_id": "resp_nope"})
    assert r.status_code == 404
    err = r.json()["error"]
    assert "resp_nope" in err["message"] and err["param"] == "previous_response_id"


def test_the_store_is_a_bounded_lru():
    from tallow.server.responses_store import ResponseStore

    s = ResponseStore(max_entries=2, max_bytes=10_000)
    s.put("a", {"x": 1}, [])
    s.put("b", {"x": 2}, [])
    assert s.get("a") is not None  # a is now the most recently used
    s.put("c", {"x": 3}, [])
    assert s.get("b") is None and s.get("a") is not None and len(s) == 2
    assert not s.put("huge", {"x": "y" * 20_000}, [])  # larger than the byte cap alone
    s.put("d", {"x": "y" * 6_000}, [])
    s.put("e", {"x": "y" * 6_000}, [])  # evicts until the bytes fit: d goes, though there is room for 2 entries
    assert s.get("d") is None and s.get("e") is not None and s.nbytes <= 10_000
    assert s.delete("e") and not s.delete("e") and s.get("c") is None
    assert s.nbytes == 0 and len(s) == 0


def test_api_processes_share_one_store_on_disk(tmp_path):
    """--api-server-count N: each process opens the store in the directory tallow serve made; what one keeps,
    another finds (previous_response_id reaches whichever process the kernel picks) and can delete."""
    import multiprocessing

    from tallow.server.responses_store import ResponseStore

    d = str(tmp_path / "responses")
    first = ResponseStore(directory=d)
    assert first.put("resp_1", {"id": "resp_1", "output": ["x" * 100]}, [{"role": "user", "content": "hi"}])
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:  # another process, as an extra API server is
        seen = pool.apply(_read_and_keep, (d,))
    assert seen == ({"id": "resp_1", "output": ["x" * 100]}, [{"role": "user", "content": "hi"}])
    got = first.get("resp_2")
    assert got is not None and got.response == {"id": "resp_2"} and got.conversation == []
    assert first.delete("resp_1") and ResponseStore(directory=d).get("resp_1") is None
    small = ResponseStore(max_bytes=2_000_000, directory=str(tmp_path / "small"))
    for k in range(40):  # 40 x ~100 KB into a 2 MB store: the least recently used go
        assert small.put(f"r{k}", {"x": "y" * 100_000}, [])
    assert small.get("r39") is not None and small.get("r0") is None
    assert not small.put("huge", {"x": "y" * 2_100_000}, [])


def _read_and_keep(directory):
    from tallow.server.responses_store import ResponseStore

    s = ResponseStore(directory=directory)
    entry = s.get("resp_1")
    s.put("resp_2", {"id": "resp_2"}, [])
    return entry.response, entry.conversation


# -- bad requests ----------------------------------------------------------------------------------
@pytest.mark.parametrize("body,param,words", [
    ({}, "input", "required"),
    ({"input": []}, "input", "non-empty"),
    ({"input": 5}, "input", "string"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "item_reference"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content",
     "input_image"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "role"),
    ({"input": "t5", "tools": [{"type": "web_search"}]}, "tools[0]", "web_search"),
    ({"input": "t5", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0]", "top level"),
    ({"input": "t5", "tools": [{"type": "function", "name": "a b"}]}, "tools[0].name", "letters"),
    ({"input": "t5", "tools": [{"type": "function", "name": "f", "parameters": []}]}, "tools[0].parameters", "schema"),
    ({"input": "t5", "tool_choice": "required"}, "tool_choice", "tools"),
    ({"input": "t5", "tool_choice": {"type": "file_search"}}, "tool_choice", "file_search"),
    ({"input": "t5", "max_output_tokens": 0}, "max_output_tokens", ">= 1"),
    ({"input": "t5", "temperature": 5}, "temperature", "<= 2"),
    ({"input": "t5", "text": {"format": {"type": "xml"}}}, "text.format", "xml"),
    ({"input": "t5", "text": {"format": {"type": "json_schema", "name": "x", "schema": 3}}}, "text.format.schema",
     "schema"),
    ({"input": "t5", "background": True}, "background", "background"),
    ({"input": "t5", "metadata": {"k": 1}}, "metadata", "string"),
    ({"input": "t5", "model": 5}, "model", "string"),
])
def test_bad_fields_are_400_naming_the_field(server, body, param, words):
    r = requests.post(server.base_url + "/v1/responses", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_too_long_input_is_refused_before_generating(server):
    r = requests.post(server.base_url + "/v1/responses", json={"input": "t5 " * 600})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


# -- a client that leaves ------------------------------------------------------------------------
def test_client_disconnect_mid_stream_aborts_and_frees_blocks(server):
    body = {"model": "tiny", "input": USER, "max_output_tokens": 480, "stream": True, "ignore_eos": True}
    disconnect_mid_stream(server, "/v1/responses", body, after_events=6)
    assert server.call(_seats(server)) == 0


async def _seats(server):
    from tallow.server.keys import STATE

    return server.app[STATE].seqs_in_flight


# -- tools, reasoning and failures on a scripted engine ------------------------------------------------
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
         {"type": "function", "name": "search", "parameters": {"type": "object",
                                                               "properties": {"query": {"type": "string"}}}}]
RAMBLE = ["\n\nThe", " weather", " is", " {nice}", "."] * 4


def test_named_function_round_trip(scripted):
    s = scripted(structured_output=True, tool_parser="json")
    call = pieces('get_weather", "arguments": {"city": "Paris"}}')
    s.script(call + RAMBLE, "It is t5 sunny.")
    r = s.client.responses.create(model="scripted", input="t5 t6", tools=TOOLS,
                                  tool_choice={"type": "function", "name": "get_weather"})
    # the call is forced as the chat endpoint forces it: its start in the prompt, the rest constrained by a grammar
    assert s.prompt().endswith('t6 get_weather search t4{"name": "')
    grammar = s.engine.params[-1].structured_outputs.lark
    assert "get_weather" in grammar and "search" not in grammar
    [fc] = r.output
    assert fc.type == "function_call" and fc.name == "get_weather" and json.loads(fc.arguments) == {"city": "Paris"}
    assert fc.call_id and fc.id.startswith("fc_") and fc.status == "completed" and r.status == "completed"
    assert r.usage.output_tokens == len(call)  # the ramble after the call was never generated
    assert r.tool_choice.type == "function" and r.tool_choice.name == "get_weather"
    assert [t.name for t in r.tools] == ["get_weather", "search"]
    s.srv.wait_idle()
    # the second turn: the function's output continues the stored conversation
    r2 = s.client.responses.create(model="scripted", previous_response_id=r.id, tools=TOOLS,
                                   input=[{"type": "function_call_output", "call_id": fc.call_id, "output": "t7 t8"}])
    assert r2.output_text == "It is t5 sunny." and r2.status == "completed"
    prompt = s.prompt()
    # the stored turn (the call, as the chat template renders an assistant tool call) then the output, then the tools
    assert prompt == ('t2 user t5 t6 t3 t2 assistant  t5 get_weather {"city": "Paris"} t3 t2 tool t7 t8 t3 '
                      't6 get_weather search t4')


def test_function_call_history_in_the_input_renders_like_chat(scripted):
    s = scripted(structured_output=True, tool_parser="json")
    s.script("done", "done")
    items = [{"role": "user", "content": "t5 t6"},
             {"type": "function_call", "call_id": "call_1", "name": "search", "arguments": '{"query": "q"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "t9"}]
    s.client.responses.create(model="scripted", input=items, tools=TOOLS)
    via_responses = s.prompt()
    s.client.chat.completions.create(model="scripted", tools=[{"type": "function", "function": {
        k: v for k, v in t.items() if k != "type"}} for t in TOOLS], messages=[
        {"role": "user", "content": "t5 t6"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"query": "q"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "t9"}])
    assert via_responses == s.prompt()


def test_required_streams_function_call_events(scripted):
    s = scripted(structured_output=True, tool_parser="hermes")
    text = 'search", "arguments": {"query": "umbrella"}}\n</tool_call>'
    s.script(pieces(text) + RAMBLE, pieces(text) + RAMBLE)
    whole = s.client.responses.create(model="scripted", input="t5", tools=TOOLS, tool_choice="required",
                                      parallel_tool_calls=False)
    s.srv.wait_idle()
    events = list(s.client.responses.create(model="scripted", input="t5", tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, stream=True))
    kinds = [e.type for e in events]
    n = kinds.count("response.function_call_arguments.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added"] + \
        ["response.function_call_arguments.delta"] * n + \
        ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert n >= 2
    added = events[2].item
    assert added.type == "function_call" and added.name == "search" and added.arguments == ""
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = events[-3]
    assert args == done.arguments == events[-1].response.output[0].arguments == whole.output[0].arguments
    assert json.loads(args) == {"query": "umbrella"}
    assert {e.item_id for e in events if hasattr(e, "item_id")} == {added.id}


def test_a_forced_call_cut_off_is_text_or_an_incomplete_call(scripted):
    """The demo model rambles inside a forced call's arguments until max_output_tokens: the whole reply is then
    the message text, as the chat endpoint answers it; a stream has sent the call already and closes it incomplete."""
    s = scripted(structured_output=True, tool_parser="json")
    cut = pieces('get_weather", "arguments": {"city": "Paris", "note": "it rains a lot and')
    s.script(cut, cut)
    kw = dict(model="scripted", input="t5", tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"},
              max_output_tokens=len(cut) - 1)
    r = s.client.responses.create(**kw)
    assert [o.type for o in r.output] == ["message"] and r.status == "incomplete"
    assert r.output_text == '{"name": "' + "".join(cut[:-1])
    events = list(s.client.responses.create(stream=True, **kw))
    assert events[-1].type == "response.incomplete"
    [fc] = events[-1].response.output
    assert fc.type == "function_call" and fc.status == "incomplete"
    assert fc.name == "get_weather" and fc.arguments.startswith('{"city": "Paris"')
    sent = "".join(cut[:-1])
    assert sent[sent.index("{"):].startswith(fc.arguments)  # the arguments so far (a partial string held back)


def test_auto_tools_give_a_message_then_calls(scripted):
    s = scripted(structured_output=True, tool_parser="hermes")
    out = ('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
           '<tool_call>\n{"name": "search", "arguments": {"query": "umbrella"}}\n</tool_call>')
    s.script(out, out)
    r = s.client.responses.create(model="scripted", input="t5", tools=TOOLS)
    assert [o.type for o in r.output] == ["message", "function_call", "function_call"]
    assert r.output[0].content[0].text == "Checking."
    assert [(o.name, json.loads(o.arguments)) for o in r.output[1:]] == [("get_weather", {"city": "Paris"}),
                                                                         ("search", {"query": "umbrella"})]
    with s.client.responses.stream(model="scripted", input="t5", tools=TOOLS) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert [(o.type, getattr(o, "arguments", None)) for o in final.output] == \
        [(o.type, getattr(o, "arguments", None)) for o in r.output]


THINK_TEMPLATE = CHAT_TEMPLATE + "{# models of this family wrap reasoning in <think>...</think> #}"


def test_reasoning_is_its_own_output_item(scripted):
    s = scripted(structured_output=True, template=THINK_TEMPLATE)
    out = ["<think>", "\nThe user", " greets me.", "\n</think>", "\n\n", "Hello", " there!"]
    s.script(out, out)
    r = s.client.responses.create(model="scripted", input="t5", reasoning={"effort": "low"})
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "\nThe user greets me.\n" and r.output_text == "Hello there!"
    assert r.usage.output_tokens_details.reasoning_tokens >= 3
    events = list(s.client.responses.create(model="scripted", input="t5", stream=True))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (reasoning, text) == ("\nThe user greets me.\n", "Hello there!")
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"]


def test_a_failed_step_is_an_error_event_and_a_500(scripted):
    s = scripted(structured_output=True)
    s.engine.fail_next_step = True
    r = requests.post(s.srv.base_url + "/v1/responses", json={"input": "t5"})
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
    s.engine.fail_next_step = True
    events = list(s.client.responses.create(model="scripted", input="t5", stream=True))
    assert [e.type for e in events][-2:] == ["error", "response.failed"]
    assert events[-2].code == "engine_error" and "scripted failure" not in events[-2].message
    assert events[-1].response.status == "failed"
    assert s.client.responses.create(model="scripted", input="t5").output_text == "Hello world!"  # it goes on


def test_text_format_becomes_the_chat_paths_response_format(scripted):
    s = scripted(structured_output=True)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    s.script('{"a": 1}', '{"a": 2}')
    fmt = {"type": "json_schema", "name": "x", "schema": schema, "strict": True}
    r = s.client.responses.create(model="scripted", input="t5", text={"format": fmt})
    assert s.engine.params[-1].structured_outputs.json == schema
    assert r.text.format.type == "json_schema" and r.output_text == '{"a": 1}'
    s.client.responses.create(model="scripted", input="t5", text={"format": {"type": "json_object"}})
    assert s.engine.params[-1].structured_outputs.json_object


# -- the demo model (SmolLM2-135M-Instruct): valid JSON and tool arguments, a conversation ------------
from engine_models import DEMO_MODEL_MISSING, demo_gguf  # noqa: E402

GGUF = demo_gguf()
WEATHER = [{"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                           "required": ["city"], "additionalProperties": False}}]


@pytest.fixture(scope="module")
def demo():
    if GGUF is None:
        pytest.skip(DEMO_MODEL_MISSING)
    srv = ServerThread(LLMEngine(EngineArgs(model=GGUF, max_model_len=2048)), model_names=["demo"])
    yield openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    srv.wait_idle()
    srv.stop()


def test_demo_instructions_and_a_follow_up(demo):
    r = demo.responses.create(model="demo", instructions="Answer in one sentence.", temperature=0,
                              input="What is the capital of France?", max_output_tokens=40)
    assert "Paris" in r.output_text and r.status == "completed"
    r2 = demo.responses.create(model="demo", previous_response_id=r.id, input="And of Italy?", temperature=0,
                               max_output_tokens=40)
    assert "Rome" in r2.output_text


def test_demo_json_schema_output_validates(demo):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    r = demo.responses.create(model="demo", input="Describe a person as JSON.", temperature=0, max_output_tokens=100,
                              text={"format": {"type": "json_schema", "name": "person", "schema": schema}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)


def test_demo_required_tool_round_trip_streaming_and_not(demo):
    jsonschema = pytest.importorskip("jsonschema")
    r = demo.responses.create(model="demo", input="What is the weather in Paris?", tools=WEATHER,
                              tool_choice="required", temperature=0, max_output_tokens=60)
    [fc] = r.output
    assert fc.type == "function_call" and fc.name == "get_weather" and r.status == "completed"
    jsonschema.validate(json.loads(fc.arguments), WEATHER[0]["parameters"])
    events = list(demo.responses.create(model="demo", input="What is the weather in Paris?", tools=WEATHER,
                                        tool_choice="required", temperature=0, max_output_tokens=60, stream=True))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert events[-1].type == "response.completed" and args == fc.arguments
    r2 = demo.responses.create(model="demo", previous_response_id=r.id, tools=WEATHER, temperature=0,
                               max_output_tokens=40,
                               input=[{"type": "function_call_output", "call_id": fc.call_id, "output": "sunny, 24 C"}])
    assert r2.output_text and r2.output[-1].type in ("message", "function_call")


def test_demo_chat_structured_output_and_tool_history(demo):
    """The chat endpoint on the same server: response_format json_schema and guided_choice hold at temperature 1,
    a required call's arguments validate, and a history whose assistant turn is tool calls with content null
    renders (SmolLM2's template cannot take a null content)."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = WEATHER[0]["parameters"]
    for _ in range(3):
        r = demo.chat.completions.create(model="demo", messages=[{"role": "user", "content": "A city as JSON."}],
                                         temperature=1.0, max_tokens=400, response_format={
                                             "type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        r = demo.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Pick one."}],
                                         temperature=1.0, max_tokens=10, extra_body={"guided_choice": ["yes", "no"]})
        assert r.choices[0].message.content in ("yes", "no")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": schema}}]
    r = demo.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                     tools=tools, tool_choice="required", temperature=1.0, max_tokens=400)
    [call] = r.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), schema)
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 20 C"}]
    r = demo.chat.completions.create(model="demo", messages=history, tools=tools, temperature=0, max_tokens=30)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
