#!/usr/bin/env python3
"""quant_linear (GGUF block weights kept quantized) vs ops.linear on the pre-dequantized f32 weight, CPU.

Shapes: the demo model SmolLM2-135M (hidden 576, intermediate 1536, 9 heads x 64, 3 kv heads, vocab 49152):
qkv_proj 960 x 576, o_proj 576 x 576, gate_up_proj 3072 x 576, down_proj 576 x 1536, lm_head 49152 x 576.
For each projection, row count M and weight type, the time of one call as a model's forward sees it: by
default the calls cycle over enough copies of the weight (f32 and quantized alike) to overflow the last
level cache twice (--llc-mb), as a model's 30 layers do; --hot reuses one copy. Weights are random floats
quantized with the gguf package; x is fixed. Reported: us a call (best of --reps passes of equally many
calls, the variants timed in turn within each repetition so other load hits them alike) and the ratio
quant_linear / linear (< 1: the quantized op is faster). The "layer" row sums one decoder layer's four
projections. Each quantized column also shows GB/s: the weight's quantized bytes over the time of a call
(at M = 1 the decode kernels' figure of merit: memory bound when they reach the machine's bandwidth).
--extra adds the split k/v (192 x 576) and up (1536 x 576) projections and two 7B-class shapes (4096 x 4096,
14336 x 4096). Works against an older build whose op was still called dequant_linear (for before/after).
JSON lines go to --json when given.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time

import numpy as np

SHAPES = [  # (name, N, K)
    ("qkv_proj", 960, 576),
    ("o_proj", 576, 576),
    ("gate_up_proj", 3072, 576),
    ("down_proj", 576, 1536),
    ("lm_head", 49152, 576),
]
EXTRA_SHAPES = [
    ("k_proj", 192, 576),
    ("up_proj", 1536, 576),
    ("7b_square", 4096, 4096),
    ("7b_up", 14336, 4096),
]
LAYER = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown CPU"


def time_interleaved(variants, reps, calls_per_pass=0):
    """Best seconds per call of each variant (fn, args_list). Every pass makes the same number of calls
    for each variant (each cycling on through its own args_list, so a weight comes back only after the
    whole list), the variants in turn within a repetition, so that load from other processes hits them
    alike; the best pass of each is kept."""
    calls = calls_per_pass or max(4, min(len(a) for _, a in variants))
    cursors = [0] * len(variants)
    for fn, args_list in variants:  # warm up: page in, size the thread-local buffers
        for a in args_list[: min(len(args_list), 4)]:
            fn(*a)
    best = [float("inf")] * len(variants)
    for _ in range(reps):
        for i, (fn, args_list) in enumerate(variants):
            n, c = len(args_list), cursors[i]
            t0 = time.perf_counter()
            for k in range(calls):
                fn(*args_list[(c + k) % n])
            best[i] = min(best[i], (time.perf_counter() - t0) / calls)
            cursors[i] = (c + calls) % n
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,64,256")
    ap.add_argument("--types", default="q4_1,q8_0")
    ap.add_argument("--only", default="", help="projections to time (default: all)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--hot", action="store_true", help="one copy of each weight (cache-hot) instead of cycling")
    ap.add_argument("--llc-mb", type=float, default=36.0, help="last-level cache size to overflow twice")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (default: all)")
    ap.add_argument("--extra", action="store_true", help="also the split projections and 7B-class shapes")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import gguf
    import gguf.quants
    import tallow
    from tallow import _core, ops

    if args.threads:
        _core.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",") if r]
    types = [t for t in args.types.split(",") if t]
    only = set(s for s in args.only.split(",") if s)
    quant_linear = getattr(ops, "quant_linear", None) or getattr(_core, "dequant_linear")
    shapes = [s for s in SHAPES + (EXTRA_SHAPES if args.extra else []) if not only or s[0] in only]
    rng = np.random.default_rng(0)
    qk = _core._quant_dot_kernel() if hasattr(_core, "_quant_dot_kernel") else "none (dequantized tiles)"
    device = f"{cpu_model()}, {_core.get_num_threads()} threads, kernels {_core._cpu_isa()}, decode {qk}"
    print(f"# {device}; weights {'hot (one copy)' if args.hot else f'cycled over > 2 x {args.llc_mb:g} MB'}")
    hdr = f"{'projection':<13} {'N x K':>12} {'M':>4} {'f32 linear us':>14}"
    for t in types:
        hdr += f" {t + ' us':>10} {'ratio':>6} {'GB/s':>6}"
    print(hdr)
    results = []
    totals: dict = {}
    jf = open(args.json, "a") if args.json else None
    for name, N, K in shapes:
        w32 = (rng.standard_normal((N, K)) * 0.05).astype(np.float32)
        quant = {}
        for t in types:
            raw = np.ascontiguousarray(gguf.quants.quantize(w32, getattr(gguf.GGMLQuantizationType, t.upper())))
            quant[t] = raw
        budget = 2 * args.llc_mb * 2 ** 20

        def copies(nbytes):
            return 1 if args.hot else max(1, int(np.ceil(budget / nbytes)))

        wf = tallow.tensor(w32)
        f32_ws = [wf] + [wf.clone() for _ in range(copies(w32.nbytes) - 1)]
        q_ws = {}
        for t, raw in quant.items():
            wq = tallow.from_buffer(raw, dtype=t, shape=[N, K])
            q_ws[t] = [wq] + [wq.clone() for _ in range(copies(raw.nbytes) - 1)]
        for M in rows:
            x = tallow.tensor(rng.standard_normal((M, K)).astype(np.float32))
            times = time_interleaved([(ops.linear, [(x, w) for w in f32_ws])]
                                     + [(quant_linear, [(x, w) for w in q_ws[t]]) for t in types], args.reps)
            base = times[0]
            line = f"{name:<13} {f'{N} x {K}':>12} {M:>4} {base * 1e6:>14.1f}"
            rec = {"name": name, "N": N, "K": K, "M": M, "device": device, "hot": args.hot, "f32_linear_us": base * 1e6}
            if name in LAYER:
                totals.setdefault(M, {}).setdefault("f32", 0.0)
                totals[M]["f32"] += base
            for t, tq in zip(types, times[1:]):
                gbs = quant[t].nbytes / tq / 1e9
                line += f" {tq * 1e6:>10.1f} {tq / base:>6.2f} {gbs:>6.1f}"
                rec[f"{t}_us"] = tq * 1e6
                rec[f"{t}_GBps"] = gbs
                rec[f"{t}_ratio"] = tq / base
                if name in LAYER:
                    totals[M][t] = totals[M].get(t, 0.0) + tq
            print(line, flush=True)
            results.append(rec)
            if jf:
                jf.write(json.dumps(rec) + "\n")
        del f32_ws, q_ws
    if all(n in {s[0] for s in shapes} for n in LAYER):
        for M in rows:
            tot = totals[M]
            line = f"{'layer (4)':<13} {'':>12} {M:>4} {tot['f32'] * 1e6:>14.1f}"
            for t in types:
                line += f" {tot[t] * 1e6:>10.1f} {tot[t] / tot['f32']:>6.2f} {'':>6}"
            print(line)
    print(f"# command: python benchmarks/bench_quant_linear.py {' '.join(sys.argv[1:])}".rstrip())
    if jf:
        jf.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
