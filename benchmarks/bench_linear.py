#!/usr/bin/env python3
"""A model's projections at decode batch sizes on CUDA: tallow.ops.linear per kernel path.

For each projection of a model shape (qkv_proj, o_proj, gate_up_proj, down_proj) and each row count M,
the time of one call as a decode step sees it: calls captured back to back into one CUDA graph, each
on its own copy of the weights (enough copies to overflow L2 four times, as a model's layers do), x
fixed and hot in L2 (as a layer's activations are). Paths:

  * default: what linear picks (tallow's gemv up to skinny_max_m rows, cuBLASLt above);
  * cublas: cuBLASLt only (skinny_max_m 0).

Reported: us a call, the weight bytes at the device copy bandwidth (tallow copy_ of 1 GiB, read + write
counted) as a bound, and TFLOP/s. JSON objects {name, device, value, unit, ceiling, ratio, prediction,
command} go to --json (default benchmarks/results/linear_<device>.json). Without CUDA the script says
so and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

import gpu_timing

SHAPES = {  # (name, N, K)
    "qwen3_0.6b": [("qkv_proj", 4096, 1024), ("o_proj", 1024, 2048), ("gate_up_proj", 6144, 1024),
                   ("down_proj", 1024, 3072)],
    "llama3_8b": [("qkv_proj", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up_proj", 28672, 4096),
                  ("down_proj", 4096, 14336)],
}
# Prediction, written before the first run (H100): cuBLASLt reaches ~1/3 of the weight-bandwidth bound
# on Qwen3-0.6B's small projections at M = 256 (its 64 x 32 tiles re-read x and w from L2), gemv
# ~0.7 at M <= 16. Measured (benchmarks/results/linear_h100_80gb_hbm3.log): cuBLASLt 0.23-0.48 at
# M = 256, o_proj 6.0 us = 178 TFLOP/s; a cluster split-K mma.sync GEMM written to beat it there was
# 1.3-4x slower (commit dee7b76, reverted).
PREDICTION = {"cublas": 0.33, "default": 0.33}
GEMV_PREDICTION = 0.7


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=tuple(SHAPES), default="qwen3_0.6b")
    ap.add_argument("--rows", default="1,8,16,32,64,128,256")
    ap.add_argument("--paths", default="default,cublas")
    ap.add_argument("--only", default="", help="projections to time (default: all)")
    ap.add_argument("--calls", type=int, default=0, help="calls in one graph (default: enough to overflow L2 2x)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    paths = [p for p in args.paths.split(",") if p]
    bad = [p for p in paths if p not in PREDICTION]
    if bad:
        ap.error("unknown path(s) %s (default, cublas)" % ",".join(bad))

    import tallow
    import tallow.cuda as tc
    from tallow import ops

    if not tc.is_available():
        print("bench_linear: no CUDA device (tallow built with CUDA: %s); skipping" % tc.built)
        return 0
    c = tc._c
    dev_name = tc.get_device_name()
    l2 = int(tc.get_device_properties().get("l2_cache_size", 50 << 20))
    out_path = args.json or gpu_timing.results_path("linear", dev_name)
    command = "python benchmarks/bench_linear.py " + " ".join(sys.argv[1:])
    results = []

    def fill(shape, seed):
        t = tallow.empty(list(shape), "bfloat16", "cuda")
        if hasattr(ops, "fill_uniform_"):
            ops.fill_uniform_(t, -0.05, 0.05, seed)
        else:
            t.copy_(tallow.tensor(np.random.default_rng(seed).uniform(-0.05, 0.05, shape).astype(np.float32),
                                  dtype="bfloat16").to("cuda"))
        return t

    n = 512 << 20
    src, dst = fill([n], 1), tallow.empty([n], "bfloat16", "cuda")
    copy_gbs = 2 * n * 2 / gpu_timing.time_ms(lambda i: dst.copy_(src), 10, 5) / 1e6
    del src, dst
    print("device: %s, L2 %d MiB; copy_ of 1 GiB: %.1f GB/s (read + write)" % (dev_name, l2 >> 20, copy_gbs))

    saved = c.skinny_max_m()

    def set_path(path):
        c.set_skinny_max_m(0 if path == "cublas" else saved)

    rows = [int(r) for r in args.rows.split(",") if r]
    only = set(x for x in args.only.split(",") if x)
    print("%-14s %5s %-10s %9s %9s %7s %8s" % ("proj", "M", "path", "us/call", "bound us", "ratio", "TFLOP/s"))
    try:
        for name, N, K in SHAPES[args.shape]:
            if only and name not in only:
                continue
            wbytes = N * K * 2
            copies = args.calls or max(4, -(-4 * l2 // wbytes))
            ws = [fill([N, K], 100 + i) for i in range(copies)]
            bound_us = wbytes / (copy_gbs * 1e9) * 1e6
            for M in rows:
                x = fill([M, K], 7)
                out = tallow.empty([M, N], "bfloat16", "cuda")
                for path in paths:
                    set_path(path)

                    def call(i):
                        ops.linear(x, ws[i % copies], None, out=out)

                    call(0)  # warm-up outside the capture (tuning, plans)
                    tc.synchronize()
                    ms = gpu_timing.time_graph_ms(call, copies, args.reps)
                    if ms is None:
                        continue
                    us = ms * 1e3
                    tflops = 2 * M * N * K / (us * 1e-6) / 1e12
                    pred = GEMV_PREDICTION if path == "default" and M <= saved else PREDICTION[path]
                    print("%-14s %5d %-10s %9.2f %9.2f %7.3f %8.1f" % (name, M, path, us, bound_us, bound_us / us,
                                                                     tflops), flush=True)
                    results.append({"name": "%s %s [%d x %d] M=%d %s" % (args.shape, name, N, K, M, path),
                                    "device": dev_name, "value": round(us, 3), "unit": "us/call",
                                    "ceiling": round(bound_us, 3), "ratio": round(bound_us / us, 4),
                                    "prediction": pred,
                                    "tflops": round(tflops, 1),
                                    "command": command})
            del ws
    finally:
        set_path("default")
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)
    print("wrote %s" % out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
