"""A tensor-parallel worker killed (SIGKILL) mid-generation: the engine raises EngineDeadError within
seconds (the in-flight requests fail, later steps fail the same way), no worker process is left and the
shared-memory segment is unlinked; behind `tallow serve -tp 2` the stream in flight ends with an error
event and the server exits with status 1."""
from __future__ import annotations

import glob
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from server_harness import kill_mid_stream, write_tiny_llama
from tallow import LLM, SamplingParams
from tallow.engine.errors import EngineDeadError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", seed=3, max_position_embeddings=4096)


def _shm_segments() -> set[str]:
    return set(glob.glob("/dev/shm/tallow_tp_*"))


def test_killed_worker_stops_the_engine(model_dir):
    before = _shm_segments()
    llm = LLM(weights_dir=str(model_dir), tensor_parallel_size=2, dtype="float32", num_kv_blocks=64,
              max_model_len=512)
    (segment,) = _shm_segments() - before
    check_killed_worker_stops_the_engine(llm)
    assert not os.path.exists(segment), "the shared-memory segment must be unlinked"


def check_killed_worker_stops_the_engine(llm) -> None:
    """Kill rank 1 three steps into a generation: EngineDeadError within 30 s naming it, later steps fail
    the same way, no worker outlives the engine. (Also run on GPUs: test_tensor_parallel_cuda.py.)"""
    eng = llm.engine
    group = eng.executor.workers
    worker = group.procs[0]
    eng.add_request([5, 6, 7], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
    for _ in range(3):
        eng.step()
    os.kill(worker.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"rank 1 \(pid \d+\) was killed by signal 9"):
        while eng.has_unfinished_requests():
            eng.step()
    assert time.monotonic() - t0 < 30
    with pytest.raises(EngineDeadError, match="tensor parallelism stopped"):
        eng.step()
    assert all(p.exitcode is not None for p in group.procs), "no worker may outlive the engine"
    eng.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def _is_tracker(pid: int) -> bool:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return b"resource_tracker" in f.read()


def test_killed_worker_ends_the_server(model_dir):
    requests = pytest.importorskip("requests")
    pytest.importorskip("zmq")
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    srv = subprocess.Popen([sys.executable, "-m", "tallow.server", "--w", str(model_dir), "--p", str(port),
                            "--max-model-len", "1024", "-tp", "2"], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        t = time.monotonic()
        while True:
            assert srv.poll() is None, srv.stderr.read()
            try:
                if requests.get(url + "/health", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() - t < 120, "the server did not come up"
            time.sleep(0.1)
        (core,) = [p for p in _children(srv.pid) if not _is_tracker(p)]
        (worker,) = [p for p in _children(core) if not _is_tracker(p)]
        kill_mid_stream(url, worker)
        rc = srv.wait(30)
        assert rc == 1
        for pid in (core, worker):
            assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z", \
                f"process {pid} outlived the server"
        assert "killed by signal 9" in srv.stderr.read()
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait(10)
