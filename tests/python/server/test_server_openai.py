"""The server with the official openai client, against a tiny random Llama on 127.0.0.1: every
endpoint, streaming and not, usage, n, logprobs, stop, seed, embeddings, metrics; 16 concurrent
clients and clients that disconnect midway, with every KV block back in the pool afterwards."""
import asyncio
import base64
import json
import socket

import numpy as np
import pytest

openai = pytest.importorskip("openai")
aiohttp = pytest.importorskip("aiohttp")
requests = pytest.importorskip("requests")

from server_harness import ServerThread, disconnect_mid_stream, write_tiny_llama  # noqa: E402
from tallow import LLM, SamplingParams  # noqa: E402
from tallow.engine.args import EngineArgs  # noqa: E402
from tallow.engine.engine import LLMEngine  # noqa: E402

MESSAGES = [{"role": "system", "content": "t9 t10"}, {"role": "user", "content": "t11 t12 t13"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", seed=7)


@pytest.fixture(scope="module")
def server(model_dir):
    eng = LLMEngine(EngineArgs(model=str(model_dir), num_kv_blocks=64))
    srv = ServerThread(eng, model_names=["tiny", "tiny-alias"], model_root=str(model_dir))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(str(model_dir), num_kv_blocks=64)


@pytest.fixture
def client(server):
    yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    server.wait_idle()  # after every test: no request left, every block free


def greedy_reference(offline, ids, n_tokens):
    out = offline.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True))
    return out[0].outputs[0]


def chat_ids(offline, messages):
    return offline.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True)


# -- models, health, version -------------------------------------------------------------------
def test_models(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny", "tiny-alias"]
    assert models.data[0].owned_by == "tallow" and models.data[0].max_model_len == 512
    assert client.models.retrieve("tiny-alias").id == "tiny-alias"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_health_and_version(server):
    import tallow

    assert requests.get(server.base_url + "/health").json() == {"status": "ok"}
    assert requests.get(server.base_url + "/version").json() == {"version": tallow.__version__}


# -- chat --------------------------------------------------------------------------------------
def test_chat_matches_the_offline_engine(client, offline):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    ref = greedy_reference(offline, chat_ids(offline, MESSAGES), 12)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "tiny"
    assert r.system_fingerprint.startswith("fp_") and r.created > 0
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == len(chat_ids(offline, MESSAGES))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_chat_stream_equals_non_stream_and_ends_with_usage(client, server):
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])
    # the raw stream ends with data: [DONE]
    raw = requests.post(server.base_url + "/v1/chat/completions", json={**kw, "stream": True, "extra_body": None},
                        stream=True)
    assert raw.headers["Content-Type"].startswith("text/event-stream")
    body = raw.content.decode()
    events = [e for e in body.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_chat_n_seed_and_sampling_parameters(client):
    kw = dict(model="tiny-alias", messages=MESSAGES, max_tokens=8, n=3, temperature=1.0, top_p=0.9, seed=1234,
              presence_penalty=0.5, frequency_penalty=0.3,
              extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1, "ignore_eos": True})
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert a.model == "tiny-alias"
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]  # seeded
    assert len({c.message.content for c in a.choices}) > 1  # n independent samples
    assert a.usage.completion_tokens == 24
    streamed = {}
    for ch in client.chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert [streamed[i] for i in range(3)] == [c.message.content for c in a.choices]


def test_max_completion_tokens_wins_over_max_tokens(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, max_completion_tokens=5,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the best token was taken
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        lps = [t.logprob for t in entry.top_logprobs]
        assert lps == sorted(lps, reverse=True)
    assert "".join(" " + e.token for e in content) == r.choices[0].message.content
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True,
                                                 extra_body={"ignore_eos": True}))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]


def test_stop_strings(client):
    kw = dict(model="tiny", messages=MESSAGES, temperature=0, extra_body={"ignore_eos": True})
    text = client.chat.completions.create(max_tokens=16, **kw).choices[0].message.content
    stop_word = text.split()[5]
    expected = text[:text.index(stop_word)]  # cut right before the first occurrence
    for stop in (stop_word, [stop_word, "t999"]):
        r = client.chat.completions.create(max_tokens=16, stop=stop, **kw)
        assert r.choices[0].finish_reason == "stop"
        assert r.choices[0].message.content == expected
        assert r.choices[0].model_extra.get("stop_reason") == stop_word
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(max_tokens=16, stop=stop_word, stream=True, **kw) if c.choices)
    assert streamed == expected


# -- completions -------------------------------------------------------------------------------
def test_completions(client, offline):
    r = client.completions.create(model="tiny", prompt="t5 t6 t7", max_tokens=7, temperature=0,
                                  extra_body={"ignore_eos": True})
    ref = greedy_reference(offline, offline.get_tokenizer().encode("t5 t6 t7"), 7)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 7


def test_completions_batch_n_echo_and_token_prompts(client):
    r = client.completions.create(model="tiny", prompt=["t5 t6", "t7"], n=2, max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text and r.choices[2].text == r.choices[3].text  # greedy
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 16
    ids = client.completions.create(model="tiny", prompt=[5, 6], max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert ids.choices[0].text == r.choices[0].text  # "t5 t6" is [5, 6]
    echo = client.completions.create(model="tiny", prompt="t5 t6", max_tokens=4, temperature=0, echo=True,
                                     extra_body={"ignore_eos": True})
    assert echo.choices[0].text == "t5 t6" + r.choices[0].text
    chunks = list(client.completions.create(model="tiny", prompt=["t5 t6", "t7"], n=2, max_tokens=4, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    texts = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert [texts[i] for i in range(4)] == [c.text for c in r.choices]
    assert chunks[-1].usage.completion_tokens == 16 and chunks[-1].choices == []


def test_completions_logprobs(client):
    r = client.completions.create(model="tiny", prompt="t5 t6", max_tokens=5, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and max(top.values()) == pytest.approx(val) and tok in top
    assert lp.text_offset == sorted(lp.text_offset)


def test_completions_echo_with_logprobs_scores_the_prompt(client, offline):
    """echo + logprobs (how evaluation harnesses score a text): the prompt's tokens come first, the
    first with a null log-prob, the others with the offline engine's prompt log-probs; vLLM's
    prompt_logprobs field carries the same numbers by token id."""
    prompt = "t5 t6 t7 t8 t9"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=2,
                                  extra_body={"ignore_eos": True, "prompt_logprobs": 1})
    ch = r.choices[0]
    lp = ch.logprobs
    ids = offline.get_tokenizer().encode(prompt)
    ref = offline.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                                                                     prompt_logprobs=2, logprobs=2))[0]
    assert ch.text.startswith(prompt) and len(lp.tokens) == len(ids) + 1
    assert lp.tokens[:len(ids)] == prompt.split() and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(ref.prompt_logprobs[i][ids[i]].logprob, abs=1e-5)
        assert len(lp.top_logprobs[i]) == 2
    assert lp.token_logprobs[-1] == pytest.approx(ref.outputs[0].logprobs[0][ref.outputs[0].token_ids[0]].logprob,
                                                  abs=1e-5)
    assert lp.text_offset == sorted(lp.text_offset)
    plp = ch.model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    assert plp[2][str(ids[2])]["logprob"] == pytest.approx(ref.prompt_logprobs[2][ids[2]].logprob, abs=1e-5)


def test_chat_prompt_logprobs(client, offline):
    """vLLM's prompt_logprobs on a (non-streaming) chat completion: a top-level list over the rendered
    prompt's tokens, null first, each entry keyed by token id, equal to the offline engine's."""
    c = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 1})
    plp = c.model_extra["prompt_logprobs"]
    ids = offline.get_tokenizer().apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    assert len(plp) == len(ids) == c.usage.prompt_tokens and plp[0] is None
    ref = offline.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    for i in range(1, len(ids)):
        entry = plp[i]
        assert str(ids[i]) in entry and 1 <= len(entry) <= 2
        assert entry[str(ids[i])]["logprob"] == pytest.approx(ref.prompt_logprobs[i][ids[i]].logprob, abs=1e-5)
        assert entry[str(ids[i])]["rank"] == ref.prompt_logprobs[i][ids[i]].rank
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, temperature=0)
    assert "prompt_logprobs" not in (plain.model_extra or {})


def test_logit_bias(client, offline):
    """OpenAI's logit_bias (string token ids -> [-100, 100]): +100 on "t42" makes greedy decoding emit
    only it (chat and completions); -100 on the unbiased greedy first token moves the first token off it."""
    r = client.completions.create(model="tiny", prompt="t5 t6 t7", max_tokens=4, temperature=0,
                                  logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text.split() == ["t42"] * 4
    c = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, temperature=0,
                                       logit_bias={"42": 100})
    assert c.choices[0].message.content.split() == ["t42"] * 3
    first = greedy_reference(offline, offline.get_tokenizer().encode("t5 t6 t7"), 1).token_ids[0]
    r = client.completions.create(model="tiny", prompt="t5 t6 t7", max_tokens=1, temperature=0,
                                  logit_bias={str(first): -100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text.split() != [f"t{first}"]


# -- embeddings --------------------------------------------------------------------------------
def test_embeddings(client):
    r = client.embeddings.create(model="tiny", input=["t5 t6 t7", "t8"])
    assert [d.index for d in r.data] == [0, 1] and r.object == "list"
    vecs = np.array([d.embedding for d in r.data])
    assert vecs.shape == (2, 64)
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1, atol=1e-5)
    assert r.usage.prompt_tokens == 4 and r.usage.total_tokens == 4
    again = client.embeddings.create(model="tiny", input="t5 t6 t7")
    assert np.allclose(again.data[0].embedding, vecs[0], atol=1e-6)
    ids = client.embeddings.create(model="tiny", input=[[5, 6, 7]])
    assert np.allclose(ids.data[0].embedding, vecs[0], atol=1e-6)
    mean = client.embeddings.create(model="tiny", input="t5 t6 t7", extra_body={"pooling": "mean"})
    assert not np.allclose(mean.data[0].embedding, vecs[0], atol=1e-3)
    one_last = client.embeddings.create(model="tiny", input="t8", extra_body={"pooling": "last"}).data[0].embedding
    one_mean = client.embeddings.create(model="tiny", input="t8", extra_body={"pooling": "mean"}).data[0].embedding
    assert np.allclose(one_last, one_mean, atol=1e-6)  # one token: both poolings agree
    raw = client.embeddings.create(model="tiny", input="t5 t6 t7", extra_body={"normalize": False})
    assert abs(np.linalg.norm(raw.data[0].embedding) - 1) > 1e-3
    assert np.allclose(np.array(raw.data[0].embedding) / np.linalg.norm(raw.data[0].embedding), vecs[0], atol=1e-5)


def test_embeddings_base64(server):
    r = requests.post(server.base_url + "/v1/embeddings", json={"input": "t5 t6 t7", "encoding_format": "base64"})
    f = requests.post(server.base_url + "/v1/embeddings", json={"input": "t5 t6 t7"}).json()
    vec = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(vec, f["data"][0]["embedding"], atol=1e-7)
    bad = requests.post(server.base_url + "/v1/embeddings", json={"input": "t5", "dimensions": 32})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "dimensions"


# -- tokenize / detokenize ---------------------------------------------------------------------
def test_tokenize_and_detokenize(server, offline):
    url = server.base_url
    t = requests.post(url + "/tokenize", json={"prompt": "t5 t6 t300", "return_token_strs": True}).json()
    assert t["tokens"] == [5, 6, 300] and t["count"] == 3 and t["max_model_len"] == 512
    assert t["token_strs"] == ["t5", "t6", "t300"]
    assert requests.post(url + "/detokenize", json={"tokens": [5, 6, 300]}).json() == {"prompt": "t5 t6 t300"}
    m = requests.post(url + "/tokenize", json={"messages": MESSAGES}).json()
    assert m["tokens"] == chat_ids(offline, MESSAGES)
    bad = requests.post(url + "/detokenize", json={"tokens": [5, 99999]})
    assert bad.status_code == 400 and "out of range" in bad.json()["error"]["message"]


# -- metrics -----------------------------------------------------------------------------------
def test_metrics_text_parses(client, server):
    from prometheus_client.parser import text_string_to_metric_families

    client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0,
                                   extra_body={"ignore_eos": True})
    r = requests.get(server.base_url + "/metrics")
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in ("tallow:num_requests_running", "tallow:num_requests_waiting", "tallow:kv_cache_usage_perc",
                 "tallow:prefix_cache_hit_rate", "tallow:prompt_tokens", "tallow:generation_tokens",
                 "tallow:time_to_first_token_seconds", "tallow:inter_token_latency_seconds",
                 "tallow:e2e_request_latency_seconds"):
        assert name in fams, name

    def value(fam, suffix=""):
        return next(s.value for s in fams[fam].samples if s.name == fam + suffix)

    assert value("tallow:prompt_tokens", "_total") > 0
    assert value("tallow:generation_tokens", "_total") >= 5
    assert value("tallow:time_to_first_token_seconds", "_count") >= 1
    assert value("tallow:inter_token_latency_seconds", "_count") >= 4
    assert value("tallow:e2e_request_latency_seconds", "_count") >= 1
    assert 0 <= value("tallow:kv_cache_usage_perc") <= 1
    assert 0 <= value("tallow:prefix_cache_hit_rate") <= 1


# -- concurrency and disconnects ---------------------------------------------------------------
def test_sixteen_concurrent_streaming_clients(server, offline):
    prompts = [[{"role": "user", "content": f"t{20 + i} t{40 + i}"}] for i in range(16)]
    refs = [greedy_reference(offline, chat_ids(offline, p), 20).text for p in prompts]

    async def one(c, msgs):
        text = ""
        stream = await c.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        async for ch in stream:
            if ch.choices:
                text += ch.choices[0].delta.content or ""
        return text

    async def main():
        c = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(c, p) for p in prompts))
        finally:
            await c.close()

    assert asyncio.run(main()) == refs
    server.wait_idle()
    free, total = server.pool_state()
    assert free == total


def _gen_tokens(server) -> int:
    return server.in_engine(lambda e: e.stats["generation_tokens"])


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(server):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 480, "stream": True, "ignore_eos": True}
    disconnect_mid_stream(server, "/v1/chat/completions", body, after_events=4)


def test_client_disconnect_while_waiting_for_a_full_response(server):
    before = _gen_tokens(server)
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(server.base_url + "/v1/completions", timeout=0.3,
                      json={"model": "tiny", "prompt": "t5", "max_tokens": 500, "ignore_eos": True, "n": 4})
    server.wait_idle(timeout=10)
    assert _gen_tokens(server) - before < 4 * 500
    free, total = server.pool_state()
    assert free == total


def test_server_still_answers_after_everything(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_port_is_local(server):
    assert server.base_url.startswith("http://127.0.0.1:")
    with socket.create_connection(("127.0.0.1", server.port), timeout=2):
        pass


def test_tool_call_history_goes_through_the_template(client, server, offline):
    """An assistant tool call and its result (OpenAI wire format, arguments as a JSON string) are
    rendered by the chat template with the arguments decoded."""
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "t5"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "t6"},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    r = requests.post(server.base_url + "/tokenize", json={"messages": messages, "tools": tools})
    assert r.status_code == 200
    text = offline.get_tokenizer().decode(r.json()["tokens"], skip_special_tokens=False)
    rendered = offline.get_tokenizer().apply_chat_template(
        [*MESSAGES, {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "t5"}}}]}, {"role": "tool", "content": "t6"}],
        tools=tools, add_generation_prompt=True)
    assert text.split() == offline.get_tokenizer().decode(
        offline.get_tokenizer().encode(rendered, add_special_tokens=False)).split()
    assert json.dumps({"city": "t5"}) in rendered
    out = client.chat.completions.create(model="tiny", messages=messages, tools=tools, max_tokens=3)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
