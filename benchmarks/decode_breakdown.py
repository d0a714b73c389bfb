"""Where a batch-1 decode step's time goes, measured inside the CUDA graph (no profiler needed).

    python benchmarks/decode_breakdown.py            # every variant, one process each, then a table
    python benchmarks/decode_breakdown.py --variant no_rope

Variants run the Llama-3-8B-shape decode of benchmarks/gpu_e2e.py (random bf16 weights, batch 1,
128-token prompt, 256 generated tokens, CUDA graphs) with one kernel family removed from the model
(monkeypatched; the generated tokens are then meaningless, the step's remaining work is the same):
  base          nothing removed
  no_norm       the RMSNorm kernels (x passes through)
  no_rope       rope_and_cache (no rotation, no cache write)
  no_attn       the decode attention (a fixed tensor stands in for its output)
  no_rope_attn  both, no_all: norms, rope and attention
The difference of a variant's ms/token to base is what that family costs in the step, launch gaps
included. `gemv` times each projection at M = 1 in a graph of 20-40 back-to-back calls cycling
through distinct weights (so they come from HBM), and the copy bandwidth, for the per-GEMV overhead
beyond its bytes. Used for cuda/README.md's breakdown (H100, before the GEMV autotuning: attention
8.6 us a layer, rope_and_cache 4.0, norms 0.6 each; GEMVs ~4 us each beyond their bytes).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

VARIANTS = ("base", "no_norm", "no_rope", "no_attn", "no_rope_attn", "no_all")
GEMV_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
               "lm_head": (128256, 4096)}


def run_gemv() -> None:
    import gpu_e2e as E
    import tallow
    import tallow.cuda as tc
    from tallow import ops

    dev = "cuda:0"

    def weight(n, k, seed):
        return ops.fill_uniform_(tallow.empty([n, k], "bfloat16", dev), -0.02, 0.02, seed)

    x = ops.fill_uniform_(tallow.empty([1, 4096], "bfloat16", dev), -1, 1, 9)
    x_gated = ops.fill_uniform_(tallow.empty([1, 28672], "bfloat16", dev), -1, 1, 9)
    s = tc.Stream()
    for name, (n, k) in GEMV_SHAPES.items():
        ws = [weight(n, k, i + 1) for i in range(4 if n * k < 100e6 else 2)]

        def run():
            for _ in range(5):
                for wt in ws:
                    if name == "down":  # the MLP's down projection with silu(gate) * up folded in
                        ops.gated_linear(x_gated, wt, None, activation="silu")
                    else:
                        ops.linear(x, wt, None)

        with tc.stream(s):
            run()  # outside the capture: plans, autotuning
        g = tc.CUDAGraph()
        with tc.stream(s):
            with tc.graph(g, stream=s):
                run()
        s.synchronize()
        with tc.stream(s):
            ms = min(E.time_events(lambda: g.replay(s), 10))
        us = ms / (5 * len(ws)) * 1e3
        print(f"GEMV {name:8s} {n}x{k}: {us:7.2f} us  {n * k * 2 / us / 1e3:7.1f} GB/s of weights")
    print(f"copy bandwidth {E.copy_bandwidth(dev) / 1e9:.1f} GB/s")


def run_variant(variant: str) -> float:
    """ms per generated token of the decode with `variant`'s kernels removed."""
    import numpy as np

    import gpu_e2e as E
    import tallow
    from tallow import LLM, SamplingParams, ops
    from tallow.layers import attention as A
    from tallow.layers import norm as N

    if variant in ("no_norm", "no_all"):
        N.RMSNorm.add_norm = lambda self, x, r: (x, r)
        N.RMSNorm.__call__ = lambda self, x: x
    if variant in ("no_rope", "no_rope_attn", "no_all"):
        def rope_and_attend(self, positions, q, k, v, cos_sin, neox, kv, meta, *a, **kw):
            return self.attend(q, kv, meta)
        A.PagedAttention.rope_and_attend = rope_and_attend
    if variant in ("no_attn", "no_rope_attn", "no_all"):
        stand_ins = {}

        def attend(self, q, kv, meta):
            key = tuple(q.shape)
            if key not in stand_ins:
                stand_ins[key] = ops.fill_uniform_(tallow.empty(list(key), "bfloat16", q.device), -1, 1, 5)
            return stand_ins[key]
        A.PagedAttention.attend = attend

    d = E.write_model_dir(tempfile.mkdtemp(), "llama3_8b", E.LLAMA3_8B, True)
    llm = LLM(model=d, device="cuda:0", dtype="bfloat16", load_format="dummy", max_model_len=8192, max_num_seqs=8)
    prompt = {"prompt_token_ids": np.random.default_rng(0).integers(0, 128000, 128).tolist()}
    llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True, temperature=0))
    best = 0.0
    for _ in range(2):
        t = time.perf_counter()
        llm.generate(prompt, SamplingParams(max_tokens=256, ignore_eos=True, temperature=0))
        best = max(best, 256 / (time.perf_counter() - t))
    return 1e3 / best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", choices=(*VARIANTS, "gemv"), default=None,
                    help="run one variant in this process (default: all, one process each)")
    args = ap.parse_args()
    if args.variant == "gemv":
        run_gemv()
        return 0
    if args.variant:
        print(f"RESULT {args.variant} {run_variant(args.variant):.4f}")
        return 0
    ms = {}
    for v in VARIANTS:
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--variant", v], capture_output=True, text=True)
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if r.returncode != 0 or line is None:
            print(f"{v}: failed\n{r.stderr[-2000:]}")
            return 1
        ms[v] = float(line.split()[2])
    print(f"{'variant':<14}{'ms/token':>10}{'saved vs base (us/token)':>27}")
    for v in VARIANTS:
        print(f"{v:<14}{ms[v]:>10.3f}{(ms['base'] - ms[v]) * 1e3:>27.0f}")
    subprocess.run([sys.executable, os.path.abspath(__file__), "--variant", "gemv"], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
