"""Errors: OpenAI-style JSON {"error": {"message", "type", "param", "code"}} with the right status
for bad parameters (400), unknown models and routes (404), too-long prompts (400), bodies too
large (413), missing or wrong API keys (401); and a property-based fuzz test sending malformed and
hostile bodies and headers to every endpoint: never a 5xx, every answer within 10 s, /health answering
within 1 s throughout (a probe thread asks it every 50 ms), never a leaked KV block."""
import gzip
import json

import pytest

openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from health_probe import HealthProbe  # noqa: E402
from server_harness import ServerThread, post, write_tiny_llama  # noqa: E402
from tallow.engine.args import EngineArgs  # noqa: E402
from tallow.engine.engine import LLMEngine  # noqa: E402
from tallow.server.keys import STATE  # noqa: E402

ENDPOINTS = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/tokenize", "/detokenize"]
MSGS = [{"role": "user", "content": "t5 t6"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", seed=11)


@pytest.fixture(scope="module")
def server(model_dir):
    eng = LLMEngine(EngineArgs(model=str(model_dir), num_kv_blocks=24, max_model_len=64))
    srv = ServerThread(eng, model_names=["tiny"], max_body_bytes=2 * 2**20, strict_model_name=True)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def auth_server(model_dir):
    eng = LLMEngine(EngineArgs(model=str(model_dir), num_kv_blocks=24, max_model_len=64))
    srv = ServerThread(eng, model_names=["tiny"], api_key="sk-test-key")
    yield srv
    srv.stop()


def assert_error(r, status, param=None, code=None, contains=None):
    assert r.status_code == status, r.text
    assert r.headers["Content-Type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    assert "Traceback" not in r.text
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    if contains is not None:
        assert contains in err["message"]
    return err


# -- 400: bad parameters ----------------------------------------------------------------------
@pytest.mark.parametrize("body,param", [
    ({"messages": MSGS, "temperature": 3}, "temperature"),
    ({"messages": MSGS, "temperature": "hot"}, "temperature"),
    ({"messages": MSGS, "top_p": 0}, "top_p"),
    ({"messages": MSGS, "top_p": 1.5}, "top_p"),
    ({"messages": MSGS, "max_tokens": 0}, "max_tokens"),
    ({"messages": MSGS, "max_tokens": 1.5}, "max_tokens"),
    ({"messages": MSGS, "max_tokens": True}, "max_tokens"),
    ({"messages": MSGS, "max_completion_tokens": -1}, "max_completion_tokens"),
    ({"messages": MSGS, "n": 0}, "n"),
    ({"messages": MSGS, "n": 10**6}, "n"),
    ({"messages": MSGS, "stop": 5}, "stop"),
    ({"messages": MSGS, "stop": ["ok", 3]}, "stop"),
    ({"messages": MSGS, "stop": [""]}, "stop"),
    ({"messages": MSGS, "seed": 10**30}, "seed"),
    ({"messages": MSGS, "seed": "x"}, "seed"),
    ({"messages": MSGS, "presence_penalty": 5}, "presence_penalty"),
    ({"messages": MSGS, "frequency_penalty": -3}, "frequency_penalty"),
    ({"messages": MSGS, "top_k": -5}, "top_k"),
    ({"messages": MSGS, "min_p": 2}, "min_p"),
    ({"messages": MSGS, "logprobs": 3}, "logprobs"),
    ({"messages": MSGS, "top_logprobs": 30, "logprobs": True}, "top_logprobs"),
    ({"messages": MSGS, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": MSGS, "stream": "yes"}, "stream"),
    ({"messages": MSGS, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": MSGS, "logit_bias": {"5": 101}}, "logit_bias"),
    ({"messages": MSGS, "logit_bias": {"t5": 1}}, "logit_bias"),
    ({"messages": MSGS, "logit_bias": {"5": "1"}}, "logit_bias"),
    ({"messages": MSGS, "logit_bias": {"1000000": 1}}, "logit_bias"),
    ({"messages": MSGS, "logit_bias": [5]}, "logit_bias"),
    ({"messages": MSGS, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"messages": MSGS, "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"messages": MSGS, "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"messages": MSGS, "guided_regex": "[a-z", "guided_choice": ["a"]}, "guided_choice"),
    ({"messages": MSGS, "guided_regex": "[a-z"}, None),
    ({"messages": MSGS, "guided_json": {"type": "bogus"}}, None),
    ({"messages": MSGS, "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"messages": MSGS, "chat_template": "{{ messages }}"}, "chat_template"),
    ({"messages": MSGS, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"messages": MSGS, "min_tokens": 10, "max_tokens": 2}, "min_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"messages": MSGS, "model": 5}, "model"),
    ({"messages": MSGS, "tools": "x"}, "tools"),
    ({"messages": MSGS, "tool_choice": "sometimes"}, "tool_choice"),
])
def test_chat_bad_parameters(server, body, param):
    assert_error(post(server, "/v1/chat/completions", body), 400, param=param)


@pytest.mark.parametrize("body,param", [
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": {"a": 1}}, "prompt"),
    ({"prompt": [5, 10**9]}, "prompt"),
    ({"prompt": "t5", "logprobs": 50}, "logprobs"),
    ({"prompt": "t5", "echo": True, "logprobs": 1, "stream": True}, "echo"),
    ({"prompt": "t5", "suffix": "x"}, "suffix"),
    ({"prompt": "t5", "best_of": 3}, "best_of"),
    ({"prompt": "t5", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "t5", "prompt_logprobs": "1"}, "prompt_logprobs"),
    ({"prompt": "t5", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
])
def test_completions_bad_parameters(server, body, param):
    assert_error(post(server, "/v1/completions", body), 400, param=param)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/embeddings", {}, "input"),
    ("/v1/embeddings", {"input": 5}, "input"),
    ("/v1/embeddings", {"input": [""]}, "input"),
    ("/v1/embeddings", {"input": "t5", "encoding_format": "hex"}, "encoding_format"),
    ("/v1/embeddings", {"input": "t5", "pooling": "max"}, "pooling"),
    ("/v1/embeddings", {"input": [[5, 10**6]]}, "input"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
])
def test_other_endpoints_bad_parameters(server, path, body, param):
    assert_error(post(server, path, body), 400, param=param)


def test_prompt_longer_than_the_context(server):
    err = assert_error(post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "t5 " * 80}]}),
                       400, code="context_length_exceeded")
    assert "64" in err["message"]
    assert_error(post(server, "/v1/completions", {"prompt": [5] * 64}), 400, code="context_length_exceeded")
    assert_error(post(server, "/v1/embeddings", {"input": [[5] * 65]}), 400, code="context_length_exceeded")
    with pytest.raises(openai.BadRequestError) as e:
        openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0).completions.create(
            model="tiny", prompt="t5 " * 100)
    assert e.value.code == "context_length_exceeded"


@pytest.mark.parametrize("data,contains", [
    (b"", "empty"),
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe{}", "UTF-8"),
    (b"[1, 2]", "JSON object"),
    (b"null", "JSON object"),
    (b'{"messages": NaN}', "not valid JSON"),
    (b'{"prompt": "t5", "max_tokens": Infinity}', "not valid JSON"),
    (b'{"prompt": "\\ud800"}', "surrogate"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
])
def test_malformed_bodies(server, data, contains):
    for path in ENDPOINTS:
        assert_error(post(server, path, data=data, headers={"Content-Type": "application/json"}), 400,
                     contains=contains)


def test_enormous_strings_within_the_body_limit(server):
    huge = "t5 " * 500_000  # 1.5 MB, under the 2 MB limit: tokenized, then refused for its length
    for path, body in [("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}),
                       ("/v1/completions", {"prompt": huge}), ("/v1/embeddings", {"input": huge})]:
        assert_error(post(server, path, body), 400, code=None, contains="context")
    # /tokenize counts no more than the context: a 31 MB answer is a 400 naming both numbers
    err = assert_error(post(server, "/tokenize", {"prompt": huge}), 400, code="context_length_exceeded")
    assert "64" in err["message"] and "1500000 characters" in err["message"]
    # a long stop string is allowed; it just never matches
    r = post(server, "/v1/completions", {"prompt": "t5", "max_tokens": 2, "stop": ["x" * 100_000]})
    assert r.status_code == 200


def test_unknown_model_route_and_method(server):
    err = assert_error(post(server, "/v1/chat/completions", {"model": "gpt-9", "messages": MSGS}), 404,
                       param="model", code="model_not_found")
    assert "tiny" in err["message"]
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0).chat.completions.create(
            model="gpt-9", messages=MSGS)
    assert_error(requests.get(server.base_url + "/v1/nothing"), 404, code="not_found")
    assert_error(requests.get(server.base_url + "/"), 404)  # no --ui-server
    assert_error(requests.get(server.base_url + "/v1/chat/completions"), 405, code="method_not_allowed")


def test_body_too_large(server):
    big = json.dumps({"prompt": "t5 " * (1 << 20)}).encode()
    assert len(big) > 2 * 2**20
    assert_error(post(server, "/v1/completions", data=big, headers={"Content-Type": "application/json"}), 413,
                 code="request_too_large")


# -- 401 ---------------------------------------------------------------------------------------
def test_api_key(auth_server):
    url = auth_server.base_url
    assert_error(requests.get(url + "/v1/models"), 401, code="missing_api_key")
    assert_error(requests.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}), 401,
                 code="invalid_api_key")
    assert_error(requests.get(url + "/v1/models", headers={"Authorization": "Basic sk-test-key"}), 401)
    assert_error(post(auth_server, "/tokenize", {"prompt": "t5"}), 401)
    assert requests.get(url + "/v1/models", headers={"Authorization": "Bearer sk-test-key"}).status_code == 200
    assert requests.get(url + "/v1/models", headers={"x-api-key": "sk-test-key"}).status_code == 200
    for open_path in ("/health", "/version", "/metrics"):
        assert requests.get(url + open_path).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
    c = openai.OpenAI(base_url=url + "/v1", api_key="sk-test-key", max_retries=0)
    assert c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2).choices[0].finish_reason
    auth_server.wait_idle()


# -- fuzz --------------------------------------------------------------------------------------
_leaf = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                  st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40))
_json = st.recursive(_leaf, lambda ch: st.lists(ch, max_size=4) | st.dictionaries(st.text(max_size=8), ch, max_size=4),
                     max_leaves=16)
_text = st.one_of(st.text(max_size=60), st.sampled_from(["t5 t6", "t7", "", " ", "t5 " * 70]))
_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "x"]),
                                  "content": st.one_of(_text, _json)},
                                 optional={"name": _json, "tool_calls": _json, "tool_call_id": _json})
_ids = st.lists(st.integers(min_value=-5, max_value=400), max_size=70)
_tools = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "x"]), "function": st.one_of(
    st.fixed_dictionaries({"name": st.sampled_from(["get_weather", "bad name", ""]), "parameters": _json}), _json)}),
    max_size=3)
FIELDS = {
    "model": st.one_of(st.just("tiny"), _json),
    "messages": st.one_of(st.lists(_message, min_size=1, max_size=3), _json),
    "prompt": st.one_of(_text, _ids, st.lists(_ids, max_size=3), st.lists(_text, max_size=3), _json),
    "input": st.one_of(_text, _ids, st.lists(_text, max_size=3), _json),
    "tokens": st.one_of(_ids, _json),
    "max_tokens": st.one_of(st.integers(min_value=-3, max_value=40), _json),
    "max_completion_tokens": st.one_of(st.integers(min_value=-3, max_value=40), _json),
    "n": st.one_of(st.integers(min_value=-1, max_value=6), _json),
    "temperature": st.one_of(st.floats(min_value=-1, max_value=3), _json),
    "top_p": st.one_of(st.floats(min_value=-0.5, max_value=1.5), _json),
    "top_k": st.one_of(st.integers(min_value=-3, max_value=500), _json),
    "min_p": st.one_of(st.floats(min_value=-1, max_value=2), _json),
    "stop": st.one_of(_text, st.lists(_text, max_size=3), _json),
    "stop_token_ids": st.one_of(_ids, _json),
    "seed": st.one_of(st.integers(min_value=-2**65, max_value=2**65), _json),
    "logprobs": st.one_of(st.booleans(), st.integers(min_value=-1, max_value=25), _json),
    "top_logprobs": st.one_of(st.integers(min_value=-1, max_value=25), _json),
    "stream": st.one_of(st.booleans(), _json),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), _json),
    "tools": st.one_of(_tools, _json),
    "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required"]),
                             st.just({"type": "function", "function": {"name": "get_weather"}}), _json),
    "presence_penalty": st.one_of(st.floats(min_value=-3, max_value=3), _json),
    "frequency_penalty": st.one_of(st.floats(min_value=-3, max_value=3), _json),
    "repetition_penalty": st.one_of(st.floats(min_value=-1, max_value=3), _json),
    "ignore_eos": st.one_of(st.booleans(), _json),
    "echo": st.one_of(st.booleans(), _json),
    "encoding_format": st.one_of(st.sampled_from(["float", "base64"]), _json),
    "pooling": st.one_of(st.sampled_from(["last", "mean"]), _json),
    "response_format": _json,
    "chat_template_kwargs": st.one_of(st.dictionaries(st.text(max_size=12), _json, max_size=3), _json),
    "add_generation_prompt": st.one_of(st.booleans(), _json),
    "continue_final_message": st.one_of(st.booleans(), _json),
    "min_tokens": st.one_of(st.integers(min_value=-2, max_value=50), _json),
    "skip_special_tokens": st.one_of(st.booleans(), _json),
    "unknown_field": _json,
}
_body = st.one_of(st.dictionaries(st.sampled_from(sorted(FIELDS)), st.none(), max_size=10).flatmap(
    lambda d: st.fixed_dictionaries({k: FIELDS[k] for k in d})), _json)


BASE = {"/v1/chat/completions": {"model": "tiny", "messages": MSGS, "max_tokens": 4},
        "/v1/completions": {"model": "tiny", "prompt": "t5 t6", "max_tokens": 4},
        "/v1/embeddings": {"model": "tiny", "input": "t5"}, "/tokenize": {"prompt": "t5"}, "/detokenize": {"tokens": [5]}}
# a valid body with one to four fields replaced by plausible or hostile values
_mutation = st.dictionaries(st.sampled_from(sorted(FIELDS)), st.none(), min_size=1, max_size=4).flatmap(
    lambda d: st.fixed_dictionaries({k: FIELDS[k] for k in d}))


@pytest.fixture(scope="module")
def probe(server):
    """/health asked every 50 ms from the first fuzz test to the end of the module."""
    with HealthProbe(server.base_url) as p:
        yield p


REQUEST_TIME_LIMIT = 10  # seconds: a request that takes longer counts as a stall (requests raises Timeout)


def _check(server, path, body):
    r = post(server, path, body, timeout=REQUEST_TIME_LIMIT)
    assert r.status_code < 500, (path, body, r.text)
    if r.status_code >= 400:
        assert_error(r, r.status_code)
    elif r.headers["Content-Type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]")
        assert '"error"' not in r.text
    else:
        r.json()
    return r.status_code


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(ENDPOINTS), body=_body)
def test_fuzz_random_bodies(server, probe, path, body):
    _check(server, path, body)


# header values as a client may send them (latin-1; requests refuses leading whitespace itself)
_content_type = st.one_of(st.none(), st.sampled_from(["application/json", "text/plain", "application/json; charset=x",
                                                     "multipart/form-data", "application/octet-stream", "",
                                                     "application/x-www-form-urlencoded", "*/*", ";;"]),
                          st.text(st.characters(min_codepoint=32, max_codepoint=255), max_size=30).map(str.strip))
_encoding = st.one_of(st.none(), st.sampled_from(["gzip", "deflate", "br", "zstd", "identity", "gzip, gzip", "x-gzip",
                                                 "gzip, deflate, gzip", "*", ""]),
                      st.text(st.characters(min_codepoint=32, max_codepoint=255), max_size=20).map(str.strip))
_raw_body = st.one_of(st.binary(max_size=200), _json.map(lambda v: json.dumps(v).encode()),
                      st.sampled_from(sorted(BASE)).map(lambda p: json.dumps(BASE[p]).encode()))


@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(ENDPOINTS), content_type=_content_type, encoding=_encoding, data=_raw_body,
       compress=st.booleans())
def test_fuzz_headers_and_raw_bodies(server, probe, path, content_type, encoding, data, compress):
    headers = {}
    if content_type is not None:
        headers["Content-Type"] = content_type
    if encoding is not None:
        headers["Content-Encoding"] = encoding
        if compress:  # sometimes what the header says, sometimes not
            data = gzip.compress(data)
    r = requests.post(server.base_url + path, data=data, headers=headers, timeout=REQUEST_TIME_LIMIT)
    assert r.status_code < 500, (path, headers, data[:100], r.text[:300])
    if r.status_code >= 400 and not (r.status_code == 400 and r.headers["Content-Type"].startswith("text/plain")):
        assert_error(r, r.status_code)  # the app's answer; aiohttp's own 400 (headers it cannot parse) is plain text


_get_path = st.one_of(st.sampled_from(["/v1/models", "/health", "/version", "/metrics", "/", "/v1/nothing",
                                       "/v1/chat/completions", "/tokenize"]),
                      st.text(st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="#?%"),
                              max_size=40).map(lambda t: "/v1/models/" + t))


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=_get_path, query=st.text(st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="#"),
                                     max_size=30))
def test_fuzz_get_endpoints(server, probe, path, query):
    r = requests.get(server.base_url + path + ("?" + query if query else ""), timeout=REQUEST_TIME_LIMIT)
    assert r.status_code < 500, (path, query, r.text[:300])


STATUSES = []


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(ENDPOINTS), mutation=_mutation)
def test_fuzz_mutated_valid_bodies(server, probe, path, mutation):
    STATUSES.append(_check(server, path, {**BASE[path], **mutation}))


def test_the_fuzz_reached_the_engine():
    if len(STATUSES) < 100:
        pytest.skip("runs after test_fuzz_mutated_valid_bodies")
    assert STATUSES.count(200) > len(STATUSES) // 10


def test_no_block_leaked_after_the_fuzz(server, probe):
    server.wait_idle(timeout=30)
    free, total = server.pool_state()
    assert free == total
    assert server.app[STATE].seqs_in_flight == 0
    assert requests.get(server.base_url + "/health").status_code == 200


def test_health_answered_within_a_second_throughout_the_fuzz(probe):
    assert probe.count > 100  # it ran alongside the fuzz tests above
    probe.assert_responsive(limit=1.0)
