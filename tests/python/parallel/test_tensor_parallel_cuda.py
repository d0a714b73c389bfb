"""Tensor parallelism on GPUs (NCCL): needs two CUDA devices and NCCL 2.9+, else skipped saying which.

1. The collectives (NcclCommunicator: all_reduce, all_gather along any dim, broadcast) between two spawned
   ranks on fresh random data against numpy, eagerly and replayed from a CUDA graph with new inputs.
2. TP=2 against TP=1 and transformers, greedy, 32 tokens a prompt, random-weight Llama, Qwen3 and
   Qwen3-MoE checkpoints (tests/python/parallel/test_tensor_parallel_engine.py's): in float32 every token
   equal (the ranks' partial sums change only the last bits); in bfloat16 the number of prompts whose 32
   tokens all agree is printed, and at least half must (bf16 reductions in another order flip near-ties).
3. A worker killed (SIGKILL) mid-generation: EngineDeadError within 30 s naming the dead rank, no worker
   left running."""
from __future__ import annotations

import multiprocessing
import os

import numpy as np
import pytest

import tallow
import tallow.cuda

pytestmark = pytest.mark.skipif(tallow.cuda.device_count() < 2, reason="needs two CUDA devices")


def _nccl_or_skip():
    from tallow.parallel.nccl_communicator import load_nccl

    try:
        load_nccl()
    except RuntimeError as e:
        pytest.skip(f"NCCL is not available: {e}")


# -- 1. the collectives ----------------------------------------------------------------------------------
def _rank_main(rank: int, handle, seed: int, out_q) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    try:
        import tallow.cuda as tc
        from tallow.parallel.nccl_communicator import NcclCommunicator

        comm = NcclCommunicator.attach(handle, rank)
        dev = handle.device_of(rank)
        rng = np.random.default_rng(seed + rank)
        res = {}
        for dtype in ("float32", "bfloat16"):
            x = rng.standard_normal((3, 1000)).astype(np.float32)
            t = tallow.tensor(x, dtype=dtype).to(dev)
            res[f"in_{dtype}"] = t.to("cpu").to(tallow.float32).numpy()
            comm.all_reduce(t)
            res[f"sum_{dtype}"] = t.to("cpu").to(tallow.float32).numpy()
        g = rng.standard_normal((4, 6)).astype(np.float32)
        res["gather_in"] = g
        for dim in (0, 1, -1):
            res[f"gather_{dim}"] = comm.all_gather(tallow.tensor(g).to(dev), dim=dim).to("cpu").numpy()
        b = tallow.tensor(rng.integers(0, 1000, 17).astype(np.int32)).to(dev)
        res["bcast_in"] = b.to("cpu").numpy()
        comm.broadcast(b, src=1)
        res["bcast"] = b.to("cpu").numpy()
        # captured in a CUDA graph, replayed with new inputs: a small all-reduce (the IPC kernel where
        # there is peer access), a large one and an all-gather (NCCL), as a decode graph holds them
        small = tallow.empty([4096], tallow.float32, dev)
        large = tallow.empty([1 << 18], tallow.float32, dev)  # 1 MiB: past the IPC kernel's limit
        s = tc.Stream()
        graph = tc.CUDAGraph()
        with tc.graph(graph, stream=s):
            comm.all_reduce(small)
            comm.all_reduce(large)
            gathered = comm.all_gather(small, dim=0)
        res["ipc"] = comm._ipc is not None
        for name, t in (("small", small), ("large", large)):
            res[f"graph_{name}_in"], res[f"graph_{name}_out"] = [], []
        res["graph_gathered"] = []
        for _ in range(5):
            for name, t in (("small", small), ("large", large)):
                v = rng.standard_normal(t.shape[0]).astype(np.float32)
                t.copy_(tallow.tensor(v).to(dev))
                res[f"graph_{name}_in"].append(v)
            graph.replay()
            tc.synchronize()
            for name, t in (("small", small), ("large", large)):
                res[f"graph_{name}_out"].append(t.to("cpu").numpy())
            res["graph_gathered"].append(gathered.to("cpu").numpy())
        out_q.put((rank, res))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        import traceback

        out_q.put((rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def test_nccl_collectives_between_two_ranks():
    _nccl_or_skip()
    from tallow.parallel.nccl_communicator import NcclCommunicator

    handle = NcclCommunicator.create([0, 1], timeout_s=60).handle
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, handle, 7, q), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(2):
            rank, res = q.get(timeout=180)
            assert not isinstance(res, str), f"rank {rank} failed: {res}"
            got[rank] = res
    finally:
        for p in procs:
            p.join(30)
            if p.exitcode is None:
                p.kill()
    a, b = got[0], got[1]
    for dtype, tol in (("float32", 1e-6), ("bfloat16", 1e-2)):
        want = a[f"in_{dtype}"].astype(np.float64) + b[f"in_{dtype}"]
        err = np.abs(a[f"sum_{dtype}"] - want).max() / np.abs(want).max()
        assert err <= tol, f"all_reduce {dtype}: max error {err:.2e} of max |sum|"
        assert np.array_equal(a[f"sum_{dtype}"], b[f"sum_{dtype}"]), f"all_reduce {dtype}: ranks differ"
    for dim in (0, 1, -1):
        want = np.concatenate([a["gather_in"], b["gather_in"]], axis=dim)
        assert np.array_equal(a[f"gather_{dim}"], want) and np.array_equal(b[f"gather_{dim}"], want), dim
    assert np.array_equal(a["bcast"], b["bcast_in"]) and np.array_equal(b["bcast"], b["bcast_in"])
    print(f"\nIPC all-reduce {'on' if a['ipc'] else 'off (no peer access)'} for messages <= 512 KB")
    for name in ("small", "large"):
        for k in range(5):
            want = a[f"graph_{name}_in"][k].astype(np.float64) + b[f"graph_{name}_in"][k]
            got = a[f"graph_{name}_out"][k]
            assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), (name, k)
            assert np.array_equal(got, b[f"graph_{name}_out"][k]), (name, k)
    for k in range(5):  # the gather of the reduced small tensor: both halves equal the sum
        small_sum = a["graph_small_out"][k]
        assert np.array_equal(a["graph_gathered"][k], np.concatenate([small_sum, small_sum]))


# -- 2. whole models ------------------------------------------------------------------------------------
torch = pytest.importorskip("torch", reason="transformers (with torch) writes the checkpoints")
transformers = pytest.importorskip("transformers", reason="transformers writes the checkpoints")

from test_tensor_parallel_engine import N_NEW, VOCAB, _checkpoint  # noqa: E402
from test_tensor_parallel_engine import _generate as _generate_with  # noqa: E402
from test_tensor_parallel_faults import check_killed_worker_stops_the_engine  # noqa: E402
from tallow import LLM  # noqa: E402

PROMPT_LENS = (5, 17, 40, 150, 9, 33, 64, 3)
GPU_ENGINE = dict(device="cuda:0", max_model_len=256, gpu_memory_fraction=0.3, max_num_seqs=16)


def _generate(path, tp: int, dtype: str, prompts) -> list[list[int]]:
    return _generate_with(path, tp, prompts, dtype=dtype, **GPU_ENGINE)


def _transformers_greedy(path, prompts) -> list[list[int]]:
    model = getattr(transformers, "AutoModelForCausalLM").from_pretrained(str(path), torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, max_new_tokens=N_NEW, do_sample=False, min_new_tokens=N_NEW,
                                 pad_token_id=0, eos_token_id=None)
            out.append(gen[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_tp2_matches_tp1_and_transformers(family, tmp_path):
    _nccl_or_skip()
    path = _checkpoint(tmp_path, family)
    rng = np.random.default_rng(1234)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in PROMPT_LENS]
    want = _transformers_greedy(path, prompts)
    tp1 = _generate(path, 1, "float32", prompts)
    tp2 = _generate(path, 2, "float32", prompts)
    for i, (a, b, c) in enumerate(zip(tp2, tp1, want)):
        assert b == c, f"{family}: TP=1 float32 differs from transformers on prompt {i}"
        assert a == b, f"{family}: TP=2 float32 differs from TP=1 on prompt {i}"
    bf1 = _generate(path, 1, "bfloat16", prompts)
    bf2 = _generate(path, 2, "bfloat16", prompts)
    same = sum(a == b for a, b in zip(bf1, bf2))
    print(f"\n{family}: bfloat16 TP=2 equals TP=1 on {same}/{len(prompts)} prompts (32 greedy tokens each)")
    assert same >= len(prompts) // 2


# -- 3. faults --------------------------------------------------------------------------------------------
def test_killed_worker_stops_the_engine(tmp_path):
    _nccl_or_skip()
    path = _checkpoint(tmp_path, "llama")
    check_killed_worker_stops_the_engine(LLM(weights_dir=str(path), tensor_parallel_size=2, dtype="float32",
                                             **GPU_ENGINE))
