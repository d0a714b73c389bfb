#!/usr/bin/env python3
"""RMSNorm kernels at decode batch sizes, timed inside one CUDA graph as a decode step runs them.

    python benchmarks/bench_norm.py [--hidden 1024,4096] [--rows 1,8,64,128,192,256,512]

fused_add_rms_norm (residual add + norm, the decoder's per-layer norm) and rms_norm, bf16, `--calls`
calls a graph cycling through 4 buffer sets; microseconds per call (median of --reps replays).
Without CUDA the script says so and exits 0."""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_timing  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", default="1024,4096")
    ap.add_argument("--rows", default="1,8,64,128,192,256,512")
    ap.add_argument("--calls", type=int, default=56)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    import tallow
    import tallow.cuda as tc
    from tallow import ops

    if not tc.is_available():
        print("bench_norm: no CUDA device (tallow built with CUDA: %s); skipping" % tc.built)
        return 0
    print("device: %s" % tc.get_device_name())
    print("%6s %6s %16s %10s" % ("hidden", "rows", "fused_add (us)", "rms (us)"))
    for h in (int(x) for x in args.hidden.split(",")):
        w = ops.fill_uniform_(tallow.empty([h], "bfloat16", "cuda"), 0.5, 1.5, 1)
        for rows in (int(x) for x in args.rows.split(",")):
            sets = [[ops.fill_uniform_(tallow.empty([rows, h], "bfloat16", "cuda"), -1, 1, 10 * i + j) for j in range(3)]
                    for i in range(4)]

            def fused(i):
                x, r, _ = sets[i % 4]
                ops.fused_add_rms_norm(x, r, w, 1e-6)

            def plain(i):
                x, _, o = sets[i % 4]
                ops.rms_norm(x, w, 1e-6, out=o)

            us = [gpu_timing.time_graph_ms(f, args.calls, args.reps) * 1e3 for f in (fused, plain)]
            print("%6d %6d %16.2f %10.2f" % (h, rows, *us), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
