"""Where a decode step's time goes, measured inside the CUDA graph (no profiler needed).

    python benchmarks/decode_breakdown.py            # every variant, one process each, then a table
    python benchmarks/decode_breakdown.py --variant no_rope
    python benchmarks/decode_breakdown.py --shape nano   # the nano-vllm workload's large decode steps

Shapes (random bf16 weights, models of benchmarks/gpu_e2e.py, CUDA graphs):
  llama3_8b  the Llama-3-8B decode of gpu_e2e.py: batch 1, 128-token prompt, 256 generated tokens;
             ms per token
  nano       Qwen3-0.6B, 256 sequences of 683-token prompts (the nano-vllm workload's average context
             at its decode step 100), 128 decode steps of batch 256 timed once every prompt is prefilled
             (contexts ~700-830 keys then); ms per step
Variants remove one kernel family from the model (monkeypatched; the generated tokens are then
meaningless, the step's remaining work is the same):
  base          nothing removed
  no_norm       the RMSNorm kernels (x passes through; a norm folded into a projection leaves a plain one)
  no_rope       rope_and_cache (no rotation, no q/k norm, no cache write)
  no_attn       the decode attention (a fixed tensor stands in for its output)
  no_rope_attn  both, no_all: norms, rope and attention
The difference of a variant's time to base is what that family costs in the step, launch gaps
included. `gemv` times each projection (at M = 1 for llama3_8b, M = 256 for nano) in a graph of 20-40
back-to-back calls cycling through distinct weights (so they come from HBM), and the copy bandwidth,
for the per-GEMM overhead beyond its bytes. Used for cuda/README.md's breakdown (H100, llama3_8b,
before the GEMV autotuning: attention 8.6 us a layer, rope_and_cache 4.0, norms 0.6 each; GEMVs ~4 us
each beyond their bytes).
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
# Per shape: tokens a step (GEMM rows) and the projections' [N, K] ([N, 2 x intermediate] for down: its
# input is gate and up, silu(gate) * up folded in).
GEMV_SHAPES = {
    "llama3_8b": (1, {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                      "lm_head": (128256, 4096)}),
    "nano": (256, {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
                   "lm_head": (151936, 1024)}),
}
NANO_BATCH, NANO_PROMPT, NANO_STEPS = 256, 683, 128
DEVICE = "cuda:0"  # (the CPU tests run the variants on "cpu" with a tiny model)


def run_gemv(shape: str) -> None:
    import gpu_e2e as E
    import tallow
    import tallow.cuda as tc
    from tallow import ops

    dev = DEVICE

    def weight(n, k, seed):
        return ops.fill_uniform_(tallow.empty([n, k], "bfloat16", dev), -0.02, 0.02, seed)

    m, shapes = GEMV_SHAPES[shape]
    s = tc.Stream()
    for name, (n, k) in shapes.items():
        ws = [weight(n, k, i + 1) for i in range(4 if n * k < 100e6 else 2)]
        # the down projection's input is [gate, up] (2 x intermediate): silu(gate) * up folded in
        x = ops.fill_uniform_(tallow.empty([m, 2 * k if name == "down" else k], "bfloat16", dev), -1, 1, 9)

        def run():
            for _ in range(5):
                for wt in ws:
                    if name == "down":
                        ops.gated_linear(x, wt, None, activation="silu")
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
        print(f"GEMM M={m} {name:8s} {n}x{k}: {us:7.2f} us  {n * k * 2 / us / 1e3:7.1f} GB/s of weights  "
              f"{2 * m * n * k / us / 1e6:7.1f} TFLOP/s")
    print(f"copy bandwidth {E.copy_bandwidth(dev) / 1e9:.1f} GB/s")


def run_variant(variant: str, shape: str) -> float:
    """ms per decode step (llama3_8b: per generated token) with `variant`'s kernels removed."""
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

        def attend(self, q, kv, meta, settled_cache=False):
            key = tuple(q.shape)
            if key not in stand_ins:
                stand_ins[key] = ops.fill_uniform_(tallow.empty(list(key), "bfloat16", q.device), -1, 1, 5)
            return stand_ins[key]
        A.PagedAttention.attend = attend

    if shape == "nano":
        return nano_ms_per_step()
    d = E.write_model_dir(tempfile.mkdtemp(), "llama3_8b", E.LLAMA3_8B, True)
    llm = LLM(model=d, device=DEVICE, dtype="bfloat16", load_format="dummy", max_model_len=8192, max_num_seqs=8)
    prompt = {"prompt_token_ids": np.random.default_rng(0).integers(0, 128000, 128).tolist()}
    llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True, temperature=0))
    best = 0.0
    for _ in range(2):
        t = time.perf_counter()
        llm.generate(prompt, SamplingParams(max_tokens=256, ignore_eos=True, temperature=0))
        best = max(best, 256 / (time.perf_counter() - t))
    return 1e3 / best


def nano_ms_per_step() -> float:
    """ms per decode step of NANO_BATCH sequences, NANO_STEPS steps timed once every prompt is prefilled
    (wall time between engine steps: with overlapped steps, the GPU's time a step)."""
    import numpy as np

    import gpu_e2e as E
    from tallow import LLM, SamplingParams

    d = E.write_model_dir(tempfile.mkdtemp(), "qwen3_0.6b", E.QWEN3_06B, True)
    llm = LLM(model=d, device=DEVICE, dtype="bfloat16", load_format="dummy", max_model_len=4096,
              max_num_seqs=NANO_BATCH)
    eng = E.engine_of(llm)
    rng = np.random.default_rng(0)
    hi = min(10001, E.QWEN3_06B["vocab_size"])  # token ids as nano-vllm draws them
    best = None
    for run in range(3):  # the first warms up (graphs replayed for the first time, GEMM plans)
        eng.kv.pool.reset_prefix_cache()
        # Room for the decodes that run beside later prompts' prefill chunks: every sequence is still
        # decoding through the timed steps (batch NANO_BATCH throughout).
        sp = SamplingParams(max_tokens=NANO_STEPS + 64, ignore_eos=True, temperature=0, detokenize=False)
        for _ in range(NANO_BATCH):
            eng.add_request({"prompt_token_ids": rng.integers(0, hi, NANO_PROMPT).tolist()}, sp)
        while eng.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running):
            eng.step()
        for _ in range(4):  # past the last prefill chunk's GPU work (overlapped steps read it later)
            eng.step()
        steps0, t0 = eng.stats["steps"], time.perf_counter()
        while eng.stats["steps"] - steps0 < NANO_STEPS:
            eng.step()
        ms = (time.perf_counter() - t0) * 1e3 / (eng.stats["steps"] - steps0)
        assert len(eng.scheduler.running) == NANO_BATCH, "a sequence finished inside the timed steps"
        while eng.has_unfinished_requests():
            eng.step()
        if run:
            best = ms if best is None else min(best, ms)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", choices=(*VARIANTS, "gemv"), default=None,
                    help="run one variant in this process (default: all, one process each)")
    ap.add_argument("--shape", choices=tuple(GEMV_SHAPES), default="llama3_8b")
    args = ap.parse_args()
    if args.variant == "gemv":
        run_gemv(args.shape)
        return 0
    if args.variant:
        print(f"RESULT {args.variant} {run_variant(args.variant, args.shape):.4f}")
        return 0
    ms = {}
    for v in VARIANTS:
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--variant", v, "--shape", args.shape],
                           capture_output=True, text=True)
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if r.returncode != 0 or line is None:
            print(f"{v}: failed\n{r.stderr[-2000:]}")
            return 1
        ms[v] = float(line.split()[2])
    unit = "token" if args.shape == "llama3_8b" else "step"
    print(f"{'variant':<14}{'ms/' + unit:>10}{'saved vs base (us/' + unit + ')':>27}")
    for v in VARIANTS:
        print(f"{v:<14}{ms[v]:>10.3f}{(ms['base'] - ms[v]) * 1e3:>27.0f}")
    subprocess.run([sys.executable, os.path.abspath(__file__), "--variant", "gemv", "--shape", args.shape],
                   check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
