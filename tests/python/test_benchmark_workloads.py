"""The workload arithmetic of the GPU benchmarks (benchmarks/gpu_e2e.py, bench_decode_mix.py): the
nano-vllm requests, the bytes its decode steps read, and the block tables bench_decode_mix builds.
They run on the CPU; the timed parts need a GPU."""
import os
import subprocess
import sys

import numpy as np
import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks")
sys.path.insert(0, BENCH)

import bench_decode_mix  # noqa: E402
import gpu_e2e  # noqa: E402


def test_nanovllm_workload_is_nano_vllms_draw():
    prompts, out_lens, _ = gpu_e2e.nanovllm_workload()
    rng = np.random.default_rng(0)  # nano-vllm's bench.py order: input lengths, token ids, output lengths
    in_lens = rng.integers(100, 1025, 256)
    ids = [rng.integers(0, 10001, int(n)).tolist() for n in in_lens]
    assert prompts == ids
    assert out_lens == rng.integers(100, 1025, 256).tolist()
    assert sum(out_lens) == 147121 and sum(map(len, prompts)) == 148894


def test_decode_bytes_counts_each_step_keys():
    cfg = gpu_e2e.QWEN3_06B
    prompt_lens, out_lens = [5, 17, 3], [4, 1, 9]
    w, kv = gpu_e2e.decode_bytes(cfg, "auto", prompt_lens, out_lens)
    # Step by step: token j (j >= 2) of a request is made by a decode step whose input is token j - 1,
    # at position p + j - 2, which attends p + j - 1 keys.
    keys = sum(p + j - 1 for p, n in zip(prompt_lens, out_lens) for j in range(2, n + 1))
    assert kv == keys * 2 * 28 * 8 * 128 * 2
    assert w == gpu_e2e.decode_weight_bytes(cfg) * (max(out_lens) - 1)
    _, kv8 = gpu_e2e.decode_bytes(cfg, "fp8", prompt_lens, out_lens)
    assert kv8 == kv / 2


@pytest.mark.parametrize("step", [0, 15, 100, 700])
def test_decode_mix_block_tables(step):
    in_lens, out_lens = bench_decode_mix.nano_lengths()
    ctx, bt, nblocks = bench_decode_mix.block_tables_at(in_lens, out_lens, step)
    live = [i for i in range(len(in_lens)) if out_lens[i] > step]
    assert ctx.tolist() == [int(in_lens[i]) + step + 1 for i in live]
    assert bt.shape == (len(live), bench_decode_mix.WIDTH)
    used = np.concatenate([bt[r, :-(-int(c) // bench_decode_mix.BS)] for r, c in enumerate(ctx)])
    assert len(np.unique(used)) == len(used)  # no block serves two sequences or two positions
    assert used.min() >= 0 and used.max() < nblocks
    if live[0] == 0:  # the first prompt's blocks come first, in order
        first = bt[0, :-(-int(in_lens[0]) // bench_decode_mix.BS)]
        assert first.tolist() == list(range(len(first)))


def test_decode_mix_without_cuda_says_so():
    tallow_cuda = pytest.importorskip("tallow.cuda")
    if tallow_cuda.is_available():
        pytest.skip("a CUDA device is present: the script would run the benchmark")
    r = subprocess.run([sys.executable, os.path.join(BENCH, "bench_decode_mix.py")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "no CUDA device" in r.stdout
