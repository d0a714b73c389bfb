"""`tallow serve` as shipped: the engine core in its own process behind the HTTP server. Streams
and plain answers through the OpenAI client, KV back to zero in /metrics after disconnects, several
API server processes on one port (--api-server-count), and a core that dies turns /health
unhealthy, fails the in-flight request and ends the server with status 1 (no hang)."""
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("zmq")
requests = pytest.importorskip("requests")
openai = pytest.importorskip("openai")

from server_harness import kill_mid_stream, write_tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", seed=21, max_position_embeddings=4096)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    def __init__(self, model_dir, *flags):
        self.port = free_port()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        self.p = subprocess.Popen([sys.executable, "-m", "tallow.server", "--w", str(model_dir), "--p", str(self.port),
                                   "--max-model-len", "1024", *flags], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        self.url = f"http://127.0.0.1:{self.port}"
        t = time.monotonic()
        while True:
            assert self.p.poll() is None, self.p.stderr.read()
            try:
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() - t < 60, "the server did not come up"
            time.sleep(0.1)

    def client(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=30)

    def metric(self, name: str) -> float:
        text = requests.get(self.url + "/metrics", timeout=5).text
        return float(re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M).group(1))

    def descendants(self) -> list[int]:
        kids, todo = [], [self.p.pid]
        while todo:
            pid = todo.pop()
            for task in os.listdir(f"/proc/{pid}/task"):
                try:
                    with open(f"/proc/{pid}/task/{task}/children") as f:
                        found = [int(c) for c in f.read().split()]
                except OSError:
                    continue
                kids += found
                todo += found
        return kids

    def stop(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGINT)
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                self.p.kill()
        return self.p.returncode


def test_streams_disconnects_and_kv_back_to_zero(model_dir):
    srv = Served(model_dir)
    try:
        assert len(srv.descendants()) >= 1  # the engine core (and multiprocessing's resource tracker)
        c = srv.client()
        r = c.completions.create(model="m", prompt="t5 t6 t7", max_tokens=12, temperature=0)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
        chunks = list(c.chat.completions.create(model="m", messages=[{"role": "user", "content": "t9"}],
                                                max_tokens=8, temperature=0, stream=True))
        assert sum(len(ch.choices[0].delta.content or "") > 0 for ch in chunks if ch.choices) >= 1
        # clients that leave mid-stream: their requests are aborted in the core
        for _ in range(4):
            with requests.post(srv.url + "/v1/completions", json={"prompt": "t5 t6", "max_tokens": 900,
                                                                  "ignore_eos": True, "stream": True},
                               stream=True, timeout=30) as resp:
                for i, _line in enumerate(resp.iter_lines()):
                    if i > 3:
                        break
        t = time.monotonic()
        while srv.metric("tallow:kv_cache_usage_perc") > 0 or srv.metric("tallow:num_requests_running") > 0:
            assert time.monotonic() - t < 10, "KV blocks were not freed after the clients left"
            time.sleep(0.05)
        r = c.completions.create(model="m", prompt="t5", max_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3
    finally:
        assert srv.stop() == 0


def test_several_api_server_processes_share_the_port(model_dir):
    srv = Served(model_dir, "--api-server-count", "2")
    try:
        kids = srv.descendants()
        assert len(kids) >= 2  # the engine core and the second API server
        c = srv.client()
        results = [None] * 12

        def ask(i):
            r = c.completions.create(model="m", prompt=f"t{5 + i} t6", max_tokens=6, temperature=0)
            results[i] = r.choices[0].text

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(r is not None for r in results)
        # the same prompt gives the same greedy text whichever API process answers
        same = {c.completions.create(model="m", prompt="t5 t6", max_tokens=6, temperature=0).choices[0].text
                for _ in range(6)}
        assert len(same) == 1
        # every scrape, whichever process answers it, counts the requests of both
        for _ in range(6):
            text = requests.get(srv.url + "/metrics", timeout=5).text
            done = sum(float(v) for v in re.findall(r'^tallow:request_success_total\{[^}]*\} (\S+)$', text, re.M))
            assert done == 18, text[:2000]
        # a stored response is found by a follow-up whichever process each request reaches
        first = c.responses.create(model="m", input="t5 t6", max_output_tokens=4, temperature=0)
        for _ in range(6):
            c.responses.create(model="m", input="t7", previous_response_id=first.id, max_output_tokens=2)
            assert c.responses.retrieve(first.id).id == first.id
    finally:
        assert srv.stop() == 0
    assert "2 API server processes" in srv.p.stderr.read()


def test_a_dying_engine_core_ends_the_server(model_dir):
    srv = Served(model_dir)
    core = None
    for pid in srv.descendants():
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
        if b"resource_tracker" not in cmd:
            core = pid
    assert core is not None
    kill_mid_stream(srv.url, core, timeout=20)
    try:
        rc = srv.p.wait(20)
    except subprocess.TimeoutExpired:
        srv.p.kill()
        pytest.fail("the server did not end after its engine core died")
    assert rc == 1
    assert "engine core process exited" in srv.p.stderr.read()


def test_api_server_count_defaults_by_device():
    from tallow.server.cli import resolve_api_server_count

    assert resolve_api_server_count(None, "cpu") == 1
    assert resolve_api_server_count(None, "cuda") == resolve_api_server_count(None, "cuda:1") == 2
    assert resolve_api_server_count(3, "cpu") == 3 and resolve_api_server_count(1, "cuda:0") == 1
