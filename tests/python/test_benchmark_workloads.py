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


@pytest.mark.parametrize("script", ["bench_decode_mix.py", "bench_linear.py"])
def test_gpu_benchmark_without_cuda_says_so(script):
    tallow_cuda = pytest.importorskip("tallow.cuda")
    if tallow_cuda.is_available():
        pytest.skip("a CUDA device is present: the script would run the benchmark")
    r = subprocess.run([sys.executable, os.path.join(BENCH, script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "no CUDA device" in r.stdout


def test_bench_linear_rejects_unknown_paths():
    r = subprocess.run([sys.executable, os.path.join(BENCH, "bench_linear.py"), "--paths", "default,splitk"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "unknown path(s) splitk" in r.stderr


@pytest.mark.parametrize("variant", ["base", "no_norm", "no_rope", "no_attn", "no_all"])
def test_decode_breakdown_nano_variants_run(variant, monkeypatch):
    """decode_breakdown.py --shape nano's variants (kernel families monkeypatched out of the model) run
    through the engine: here on the CPU with a tiny Qwen3 and a small batch, for the bookkeeping."""
    import decode_breakdown as DB
    from tallow.layers import attention as A
    from tallow.layers import norm as N

    for cls, names in ((N.RMSNorm, ("add_norm", "__call__")), (A.PagedAttention, ("rope_and_attend", "attend"))):
        for name in names:  # restored after the test: the variants patch these classes
            if hasattr(cls, name):
                monkeypatch.setattr(cls, name, getattr(cls, name))
    tiny = dict(gpu_e2e.QWEN3_06B, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_hidden_layers=2, vocab_size=512, bos_token_id=510,
                eos_token_id=511)
    monkeypatch.setattr(gpu_e2e, "QWEN3_06B", tiny)
    monkeypatch.setattr(DB, "DEVICE", "cpu")
    monkeypatch.setattr(DB, "NANO_BATCH", 4)
    monkeypatch.setattr(DB, "NANO_PROMPT", 20)
    monkeypatch.setattr(DB, "NANO_STEPS", 12)
    from tallow import ops

    calls = {}
    families = {"norm": ("rms_norm", "fused_add_rms_norm"), "rope": ("rope_and_cache",),
                "attn": ("paged_attention",)}
    for family, names in families.items():
        for name in names:

            def counted(*a, _f=getattr(ops, name), _family=family, **kw):
                calls[_family] = calls.get(_family, 0) + 1
                return _f(*a, **kw)
            monkeypatch.setattr(ops, name, counted)
    ms = DB.run_variant(variant, "nano")
    assert ms > 0
    removed = {"base": (), "no_norm": ("norm",), "no_rope": ("rope",), "no_attn": ("attn",),
               "no_all": ("norm", "rope", "attn")}[variant]
    for family in families:  # the variant's families never ran, the others did
        assert (calls.get(family, 0) == 0) == (family in removed), (family, calls)


def test_nano_steps_kernel_report_ranks_by_gpu_time(capsys):
    import nano_steps

    class Avg:  # torch.profiler's key_averages() rows: older torch names the total cuda_time_total
        def __init__(self, key, count, total, old=False):
            self.key, self.count = key, count
            setattr(self, "cuda_time_total" if old else "device_time_total", total)

    class Prof:
        def key_averages(self):
            return [Avg("rms_norm", 56, 300.0), Avg("decode_attention", 28, 6000.0, old=True),
                    Avg("host_only", 3, 0.0), Avg("gemm", 112, 1700.0)]

    nano_steps.report_kernels(Prof(), 2)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "kernels: 0.008 s of GPU time in 196 kernels (3 distinct)"
    assert [ln.split()[-1] for ln in out[2:]] == ["decode_attention", "gemm"]  # top 2 of 3, most time first
    assert out[2].split()[:4] == ["6.0", "28", "214.29", "75.0%"]
