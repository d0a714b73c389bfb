"""Throughput of tallow.ops.quantize (M weights/s) per block type on the CPU (all threads and one) and,
when built and present, on CUDA. The target it informs: --isq / `tallow quantize` of an 8B model
(~7e9 weights) to q4_k well under a minute on 16 cores.

    PYTHONPATH=<build>/python:python python benchmarks/bench_quantize.py [--rows 4096] [--cols 4096] [--types q4_k,q6_k]
"""
import argparse
import json
import os
import platform
import time

import numpy as np

import tallow

TYPES = "q4_0,q4_1,q5_0,q5_1,q8_0,q2_k,q3_k,q4_k,q5_k,q6_k"


def best_rate(fn, n, reps=3, sync=None):
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        if sync:
            sync()
        best = min(best, time.perf_counter() - t)
    return n / best / 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--types", default=TYPES)
    ap.add_argument("--single", action="store_true", help="also measure one thread")
    args = ap.parse_args()
    x_np = np.random.default_rng(0).standard_normal((args.rows, args.cols)).astype(np.float32)
    x = tallow.from_numpy(x_np)
    n = x_np.size
    threads = tallow.get_num_threads()
    out = {"device_cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
           "threads": threads, "shape": [args.rows, args.cols], "mweights_per_s": {}}
    cuda = None
    if tallow._core.build_info.get("cuda"):
        from tallow import cuda as tcuda

        if tcuda.is_available():
            cuda = tcuda
            xc = x.to("cuda")
    for name in args.types.split(","):
        row = {"cpu": round(best_rate(lambda: tallow.ops.quantize(x, name), n), 1)}
        if args.single:
            tallow.set_num_threads(1)
            row["cpu_1thread"] = round(best_rate(lambda: tallow.ops.quantize(x, name), n, reps=1), 1)
            tallow.set_num_threads(threads)
        if cuda is not None:
            tallow.ops.quantize(xc, name)
            row["cuda"] = round(best_rate(lambda: tallow.ops.quantize(xc, name), n, sync=cuda.synchronize), 1)
        out["mweights_per_s"][name] = row
        print(name, row, flush=True)
    q4k = out["mweights_per_s"].get("q4_k", {}).get("cpu")
    if q4k:
        out["seconds_for_7e9_q4_k_cpu"] = round(7e9 / (q4k * 1e6), 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
