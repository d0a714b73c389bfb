"""Hostile input: every limit is checked before the expensive work it guards, every malformed header or
encoding is a 4xx, and while the attack runs /health keeps answering within a second.

Each test here is the regression test of an attack measured against the server (issue 26): bodies that
made the nesting check quadratic, Content-Encoding lies and gzip bombs, non-UTF-8 API keys, a 10 MB prompt
tokenized on the event loop, embeddings and n × prompts beyond any sane request."""
import asyncio
import concurrent.futures
import gzip
import json
import logging
import socket
import threading
import time
import zlib

import pytest

requests = pytest.importorskip("requests")

from health_probe import HealthProbe  # noqa: E402
from server_harness import ServerThread, post, write_tiny_llama  # noqa: E402
from tallow.engine.args import EngineArgs  # noqa: E402
from tallow.engine.engine import LLMEngine  # noqa: E402
from tallow.server.keys import STATE  # noqa: E402

BODY_ENDPOINTS = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/tokenize", "/detokenize"]
MSGS = [{"role": "user", "content": "t5 t6"}]
VALID = {"/v1/chat/completions": {"messages": MSGS, "max_tokens": 2},
         "/v1/completions": {"prompt": "t5 t6", "max_tokens": 2},
         "/v1/embeddings": {"input": "t5 t6"}, "/tokenize": {"prompt": "t5 t6"}, "/detokenize": {"tokens": [5, 6]}}
JSON = {"Content-Type": "application/json"}
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", seed=11)


@pytest.fixture(scope="module")
def server(model_dir):
    eng = LLMEngine(EngineArgs(model=str(model_dir), num_kv_blocks=24, max_model_len=MAX_MODEL_LEN))
    srv = ServerThread(eng, model_names=["tiny"], max_body_bytes=12 * 2**20, max_pending=4, max_seqs_per_request=6,
                       max_embedding_inputs=8)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def auth_server(model_dir):
    eng = LLMEngine(EngineArgs(model=str(model_dir), num_kv_blocks=8, max_model_len=MAX_MODEL_LEN))
    srv = ServerThread(eng, model_names=["tiny"], api_key="sk-test-key")
    yield srv
    srv.stop()


def assert_error(r, status, code=None, contains=()):
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert r.headers["Content-Type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    for text in (contains,) if isinstance(contains, str) else contains:
        assert text in err["message"], err
    return err


def timed(fn, *args, **kw):
    t0 = time.monotonic()
    r = fn(*args, **kw)
    return r, time.monotonic() - t0


def raw_http(srv, request: bytes, timeout: float = 10) -> bytes:
    """Send bytes as they are (requests would fix the headers) and return the status line."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=timeout) as s:
        s.sendall(request)
        data = b""
        while b"\r\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    return data.split(b"\r\n", 1)[0]


def _status(line: bytes) -> int:
    return int(line.split()[1])


@pytest.fixture
def server_log(caplog):
    """Everything logged while the test runs (the server's thread included), to assert no traceback."""
    caplog.set_level(logging.INFO)
    return caplog


def assert_no_traceback(log):
    bad = [r for r in log.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not bad, [(r.name, r.getMessage()) for r in bad]


# -- 1. bodies that made the nesting check quadratic -------------------------------------------
def _backslash_quotes(size: int, path: str, closed: bool) -> bytes:
    """A body whose one string is \\" repeated (size bytes in all), left unterminated when not closed:
    the old nesting check's string regex retried from every quote (18.6 s at 64 KB, 66 s at 128 KB)."""
    field = {"/v1/chat/completions": b'{"messages": [{"role": "user", "content": "',
             "/v1/embeddings": b'{"input": "', "/detokenize": b'{"tokens": "'}.get(path, b'{"prompt": "')
    tail = (b'"}]}' if path == "/v1/chat/completions" else b'"}') if closed else b""
    return field + b'\\"' * ((size - len(field) - len(tail)) // 2) + tail


@pytest.mark.parametrize("size", [128 * 1024, 2 * 2**20])
def test_backslash_quote_bodies_are_answered_at_once(server, size):
    with HealthProbe(server.base_url) as probe:
        for path in BODY_ENDPOINTS:
            for closed in (False, True):
                data = _backslash_quotes(size, path, closed)
                r, took = timed(post, server, path, data=data, headers=JSON)
                # unterminated: not JSON; terminated: a prompt too long, or one /tokenize may count
                assert r.status_code in ((200, 400) if closed else (400,)), (path, closed, r.text[:200])
                assert took < 1.0, f"{path} took {took:.2f} s for a {len(data)}-byte body"
    probe.assert_responsive()


def test_health_answers_while_hostile_bodies_arrive_concurrently(server):
    bodies = [(p, _backslash_quotes(2 * 2**20, p, closed)) for p in BODY_ENDPOINTS for closed in (False, True)]
    with HealthProbe(server.base_url) as probe, concurrent.futures.ThreadPoolExecutor(4) as pool:
        statuses = list(pool.map(lambda pb: post(server, pb[0], data=pb[1], headers=JSON).status_code, bodies * 2))
    assert set(statuses) == {400}
    probe.assert_responsive()


def test_deep_nesting_is_refused_by_a_linear_check(server):
    for depth in (257, 100_000, 1_000_000):  # the last parsed in a worker thread (a body over 256 KB)
        data = b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
        r, took = timed(post, server, "/v1/completions", data=data, headers=JSON)
        assert_error(r, 400, contains="nested too deeply")
        assert took < 1.0
    # deep arrays inside messages and tools: refused, never a 500 from whatever walks them later
    deep = json.loads("[" * 300 + "]" * 300)
    for body in ({"messages": [{"role": "user", "content": deep}]},
                 {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f", "parameters":
                                                                                 {"x": deep}}}]}):
        assert_error(post(server, "/v1/chat/completions", data=json.dumps(body), headers=JSON), 400,
                     contains="nested too deeply")
    ok = {"messages": MSGS, "max_tokens": 2, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": json.loads("[" * 100 + "]" * 100)}}}}]}
    assert post(server, "/v1/chat/completions", ok).status_code == 200


# -- 2. Content-Encoding --------------------------------------------------------------------------
@pytest.mark.parametrize("path", BODY_ENDPOINTS)
def test_content_encoding_that_lies_is_a_4xx(server, server_log, path):
    plain = json.dumps(VALID[path]).encode()
    for enc, status, code in [("gzip", 400, "invalid_encoding"), ("deflate", 400, "invalid_encoding"),
                              ("br", 415, "unsupported_encoding"), ("zstd", 415, "unsupported_encoding"),
                              ("compress", 415, "unsupported_encoding"), ("x-unknown", 415, "unsupported_encoding")]:
        assert_error(post(server, path, data=plain, headers={**JSON, "Content-Encoding": enc}), status, code=code,
                     contains=enc)
    truncated = gzip.compress(plain)[:-6]
    assert_error(post(server, path, data=truncated, headers={**JSON, "Content-Encoding": "gzip"}), 400,
                 code="invalid_encoding")
    assert_no_traceback(server_log)


@pytest.mark.parametrize("enc,data", [
    ("gzip", gzip.compress), ("x-gzip", gzip.compress), ("deflate", zlib.compress),
    ("deflate", lambda b: zlib.compress(b)[2:-4]),  # raw deflate, as some clients send it
    ("identity", lambda b: b), ("gzip, deflate", lambda b: zlib.compress(gzip.compress(b))),
])
def test_compressed_bodies_are_read(server, enc, data):
    r = post(server, "/tokenize", data=data(json.dumps({"prompt": "t5 t6 t7"}).encode()),
             headers={**JSON, "Content-Encoding": enc})
    assert r.status_code == 200 and r.json()["tokens"] == [5, 6, 7], r.text


def test_gzip_bomb_is_refused_without_inflating_it(server, server_log):
    bomb = gzip.compress(b'{"prompt": "' + b"0" * (1 << 30) + b'"}', compresslevel=9)  # 1 GiB of zeros
    assert len(bomb) < 2 * 2**20
    with HealthProbe(server.base_url) as probe:
        r, took = timed(post, server, "/v1/completions", data=bomb, headers={**JSON, "Content-Encoding": "gzip"})
    assert_error(r, 413, code="request_too_large")
    assert took < 1.0  # inflating all of it takes seconds and a gigabyte
    probe.assert_responsive()
    assert_no_traceback(server_log)


# -- 3. API keys that are not UTF-8 --------------------------------------------------------------
def test_api_key_header_that_is_not_utf8_is_a_401(auth_server, server_log):
    for header in (b"Authorization: Bearer \xff", b"Authorization: \xff\xfe", b"Authorization: Bearer sk-test-key\xff",
                   b"x-api-key: \xff", b"x-api-key: sk-t\xe9st"):
        request = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + header + b"\r\nConnection: close\r\n\r\n"
        line = raw_http(auth_server, request)
        assert _status(line) == 401, (header, line)
    r = requests.get(auth_server.base_url + "/v1/models", headers={"Authorization": b"Bearer sk-test-key"})
    assert r.status_code == 200
    assert_no_traceback(server_log)


# -- 4. prompt length before tokenizing, tokenizing off the loop -----------------------------------
def test_ten_megabyte_prompt_is_refused_by_its_length(server):
    huge = "t5 " * (10 * 2**20 // 3)
    with HealthProbe(server.base_url) as probe:
        for path, body in [("/v1/completions", {"prompt": huge}), ("/v1/embeddings", {"input": huge}),
                           ("/tokenize", {"prompt": huge}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]})]:
            r, took = timed(post, server, path, body)
            assert_error(r, 400, code="context_length_exceeded", contains=("characters", str(MAX_MODEL_LEN)))
            assert took < 2.0, f"{path}: {took:.2f} s"  # parsing 10 MB of JSON, never tokenizing it
    probe.assert_responsive()


def test_tokenize_refuses_a_prompt_longer_than_the_context(server):
    err = assert_error(post(server, "/tokenize", {"prompt": "t5 " * 100}), 400, code="context_length_exceeded")
    assert "100 tokens" in err["message"] and str(MAX_MODEL_LEN) in err["message"]
    r = post(server, "/tokenize", {"prompt": "t5 " * MAX_MODEL_LEN})  # exactly the context: fine to tokenize
    assert r.status_code == 200 and r.json()["count"] == MAX_MODEL_LEN
    # /detokenize likewise: millions of ids (a 32 MB body) took seconds of the event loop to decode
    assert_error(post(server, "/detokenize", {"tokens": [5] * (MAX_MODEL_LEN + 1)}), 400,
                 code="context_length_exceeded", contains=(str(MAX_MODEL_LEN + 1), str(MAX_MODEL_LEN)))
    assert post(server, "/detokenize", {"tokens": [5] * MAX_MODEL_LEN}).status_code == 200


def test_long_text_within_the_bound_is_tokenized(server):
    # 100 KB of text that is one token for this word-level tokenizer: past the character pre-check, and
    # long enough to be tokenized in a worker thread
    text = "t5" + " " * 50_000 + "t6"
    r = post(server, "/tokenize", {"prompt": text})
    assert r.status_code == 200 and r.json()["tokens"] == [5, 6], r.text[:200]
    r = post(server, "/v1/completions", {"prompt": [text, "t7"], "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3


# -- 5. embeddings ---------------------------------------------------------------------------------
def test_embedding_limits_are_checked_before_any_work(server):
    cap = server.app[STATE].max_embedding_tokens
    assert cap == 4 * MAX_MODEL_LEN  # the default: 4 contexts (capped at 65,536)
    assert_error(post(server, "/v1/embeddings", {"input": ["t5"] * 9}), 400, contains=("8", "9"))
    assert_error(post(server, "/v1/embeddings", {"input": [[5] * (MAX_MODEL_LEN + 1)]}), 400,
                 code="context_length_exceeded")
    assert_error(post(server, "/v1/embeddings", {"input": [[5] * 60] * 5}), 400, contains=("300", str(cap)))
    assert_error(post(server, "/v1/embeddings", {"input": ["t5 " * 60] * 5}), 400, contains=("300", str(cap)))
    assert_error(post(server, "/v1/embeddings", {"input": ["t5 " * 60] * 2 + [[5] * 60] * 3}), 400,
                 contains="300")
    r = post(server, "/v1/embeddings", {"input": ["t5 " * 60] * 2 + [[5] * 60] * 2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 240
    server.wait_idle()


# -- 6. sequences, not requests ----------------------------------------------------------------------
def test_sequences_per_request_are_capped(server):
    err = assert_error(post(server, "/v1/completions", {"prompt": ["t5", "t6", "t7"], "n": 3}), 400,
                       contains=("9", "6"))
    assert err["param"] == "n"
    assert_error(post(server, "/v1/chat/completions", {"messages": MSGS, "n": 7}), 400, contains=("7", "6"))
    # 2 prompts x n=128 was admitted under --max-pending-requests 2 when requests were counted
    assert_error(post(server, "/v1/completions", {"prompt": ["t5", "t6"], "n": 128}), 400)
    # within the per-request cap but more than the server ever holds (4): refused, not queued
    assert_error(post(server, "/v1/completions", {"prompt": ["t5", "t6"], "n": 3}), 400, contains=("6", "4"))


def test_pending_counts_sequences_and_every_exit_releases_them(server):
    st = server.app[STATE]
    release = threading.Event()
    blocked = server.call(_block_the_step_thread(server, release))  # requests stay in flight
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(post, server, "/v1/completions", {"prompt": ["t5", "t6"], "max_tokens": 2, "n": 2})
            _wait_for(lambda: st.seqs_in_flight == 4)
            for body in ({"prompt": "t5", "max_tokens": 2}, {"messages": MSGS, "max_tokens": 2}):
                path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
                assert_error(post(server, path, body), 503, code="server_busy", contains=("4", "1"))
            assert_error(post(server, "/v1/embeddings", {"input": "t5"}), 503, code="server_busy")
            release.set()
            assert first.result(30).status_code == 200
    finally:
        release.set()
        server.call(_wait(blocked))
    # errors, engine refusals and clients that leave mid-stream give their seats back
    assert post(server, "/v1/completions", {"prompt": [5, 999_999]}).status_code == 400
    with requests.post(server.base_url + "/v1/completions", json={"prompt": "t5", "max_tokens": 50, "n": 2,
                                                                  "ignore_eos": True, "stream": True},
                       stream=True, timeout=30) as r:
        next(r.iter_lines())
    _wait_for(lambda: st.seqs_in_flight == 0)
    r = post(server, "/v1/completions", {"prompt": ["t5", "t6"], "max_tokens": 2, "n": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4
    assert st.seqs_in_flight == 0
    server.wait_idle()


async def _block_the_step_thread(server, release):
    return asyncio.ensure_future(server.engine.run_in_engine(lambda _: release.wait(30)))


async def _wait(task):
    return await task


def _wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# -- 7. malformed headers and bodies ------------------------------------------------------------------
@pytest.mark.parametrize("content_type,status", [
    (None, 200), ("application/json", 200), ("application/json; charset=utf-8", 200), ("text/plain", 200),
    ("application/x-www-form-urlencoded", 200), ("application/vnd.api+json", 200),
    ("multipart/form-data; boundary=x", 415), ("application/octet-stream", 415), ("image/png", 415),
])
def test_content_type(server, content_type, status):
    headers = {"Content-Type": content_type} if content_type else {}
    r = post(server, "/tokenize", data=json.dumps({"prompt": "t5"}).encode(), headers=headers)
    if status == 200:
        assert r.status_code == 200 and r.json()["tokens"] == [5], r.text
    else:
        assert_error(r, 415, code="unsupported_media_type")


@pytest.mark.parametrize("headers", [
    b"Content-Length: abc\r\n", b"Content-Length: -1\r\n", b"Content-Length: 5\r\nContent-Length: 6\r\n",
    b"Content-Length: 99999999999999999999999\r\n",
    b"Transfer-Encoding: chunked\r\nContent-Length: 2\r\n", b"Transfer-Encoding: gzip\r\n",
    b"Transfer-Encoding: chunked, chunked\r\n", b"Transfer-Encoding: \xff\r\n",
    b"Content-Type: \xff\xfe\r\nContent-Length: 2\r\n", b"X-Bad\x00Name: 1\r\nContent-Length: 2\r\n",
])
def test_malformed_http_headers_are_a_4xx(server, server_log, headers):
    line = raw_http(server, b"POST /tokenize HTTP/1.1\r\nHost: x\r\n" + headers + b"Connection: close\r\n\r\n{}")
    assert 400 <= _status(line) < 500, line
    assert requests.get(server.base_url + "/health", timeout=5).status_code == 200
    assert_no_traceback(server_log)


def test_bad_chunked_body_is_a_4xx(server, server_log):
    for chunks in (b"zz\r\n{}\r\n0\r\n\r\n", b"2\r\n{}XX0\r\n\r\n", b"ffffffffffffffffffff\r\n{}\r\n"):
        line = raw_http(server, b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                                b"Connection: close\r\n\r\n" + chunks)
        assert 400 <= _status(line) < 500, (chunks, line)
    assert_no_traceback(server_log)


def test_huge_numbers_are_refused_quickly(server):
    for number, status in ((b"1" * 10**6, 400), (b"-" + b"9" * 5000, 400), (b"1." + b"0" * 10**6 + b"1", 200)):
        data = b'{"prompt": "t5", "max_tokens": ' + number + b"}"  # beyond Python's int digits limit: a 400
        r, took = timed(post, server, "/v1/completions", data=data, headers=JSON)
        assert r.status_code == status and took < 1.0, (r.status_code, took, r.text[:200])
    assert_error(post(server, "/v1/completions", data=b'{"prompt": "t5", "max_tokens": 1e999}', headers=JSON), 400,
                 contains="max_tokens")


def test_duplicate_keys_last_wins(server):
    r = post(server, "/tokenize", data=b'{"prompt": 5, "prompt": "t6"}', headers=JSON)
    assert r.status_code == 200 and r.json()["tokens"] == [6]
