#!/usr/bin/env python3
"""tallow.ops.sample_tokens on CUDA: microseconds per call against the device's read bandwidth.

Batch B in {1, 16, 256} (--batches), vocabulary V = 151936 (Qwen's), logits bf16 and f32, cases:
  greedy        temperature 0
  unfiltered    temperature 0.6, no top-k / top-p / min-p (one Gumbel-max pass)
  top_k_top_p   temperature 0.6, top-k 50, top-p 0.9
  top_p         temperature 0.6, top-p 0.95
  min_p         temperature 0.6, min-p 0.05
over two logit distributions (--dists): "lm", N(0, 2.5^2) with 200 tokens per row raised by 5..12
(a peaked head, like a language model's), and "flat", N(0, 1) (the worst case: every token near
the top, most hashed, a large nucleus).

Ceiling: the device copy bandwidth (tallow copy_ of 1 GiB, bytes read + written per second); a call
reads B x V logits once at best, so value GB/s = B V element_size / time and ratio = that over the
copy bandwidth (1.0: as fast as memory allows). Timing: CUDA events around --iters calls, the median
of --reps repetitions after warm-up; the calls are also captured into one CUDA graph (no host
overhead between them) and the graph's replays give the reported value (eager_us: launched one by
one). A timed set cycles through enough copies of the logits to exceed twice the L2 cache, so they
come from HBM. Every measurement carries the prediction written before it ran, and each case is
checked against the CPU op on 16 rows (fraction of equal tokens: CPU and CUDA may differ only where
two scores are within float rounding). Writes JSON objects {name, device, value, unit, ...} to --json
(default benchmarks/results/sampling_<device>.json). Without CUDA the script says so and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

import gpu_timing

V = 151936
CASES = {  # name: (temperature, top_k, top_p, min_p)
    "greedy": (0.0, 0, 1.0, 0.0),
    "unfiltered": (0.6, 0, 1.0, 0.0),
    "top_k_top_p": (0.6, 50, 0.9, 0.0),
    "top_p": (0.6, 0, 0.95, 0.0),
    "min_p": (0.6, 0, 1.0, 0.05),
}
# Predictions, written before the run: passes over the logits at the copy bandwidth (one pass reads
# at ~0.85 of it), plus a fixed cost per call (launch, ramp-up, the buffer work of filtered rows).
# "flat" rows hash most tokens (unfiltered: compute-bound, ~1.8 passes' time), and their 95% nucleus
# overflows the candidate buffer (top-p: the multi-pass radix select, ~6 passes).
PASSES = {("greedy", "lm"): 1.0, ("unfiltered", "lm"): 1.0, ("top_k_top_p", "lm"): 1.1, ("top_p", "lm"): 2.6,
          ("min_p", "lm"): 1.1, ("greedy", "flat"): 1.0, ("unfiltered", "flat"): 1.8,
          ("top_k_top_p", "flat"): 1.2, ("top_p", "flat"): 6.0, ("min_p", "flat"): 1.1}
FIXED_US = {"greedy": 3.0, "unfiltered": 3.0, "top_k_top_p": 8.0, "top_p": 10.0, "min_p": 6.0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,16,256")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--dists", default="lm,flat")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-check", action="store_true", help="skip the CPU agreement check")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import tallow
    import tallow.cuda as tc
    from tallow import ops

    if not tc.is_available():
        print("bench_sampling: no CUDA device (tallow built with CUDA: %s); skipping" % tc.built)
        return 0
    dev_name = tc.get_device_name()
    l2 = int(tc.get_device_properties().get("l2_cache_size", 50 << 20))
    out_path = args.json or gpu_timing.results_path("sampling", dev_name)
    command = "python benchmarks/bench_sampling.py " + " ".join(sys.argv[1:])
    results = []

    def time_ms(fn, calls, warm=3):
        return gpu_timing.time_ms(fn, calls, args.reps, warm)

    def time_graph_ms(fn, calls):
        return gpu_timing.time_graph_ms(fn, calls, args.reps)

    # ---- copy bandwidth ----------------------------------------------------------------------------
    def measure_copy(n=512 << 20):  # bf16 elements: 1 GiB
        src, dst = tallow.empty([n], "bfloat16", "cuda"), tallow.empty([n], "bfloat16", "cuda")
        ops.fill_uniform_(src, -1.0, 1.0, 1)
        return 2 * n * 2 / time_ms(lambda i: dst.copy_(src), 10) / 1e6

    copy_gbs = measure_copy()
    print("device: %s, L2 %d MiB; copy_ of 1 GiB: %.1f GB/s (read + write)" % (dev_name, l2 >> 20, copy_gbs))
    results.append({"name": "copy_ 1GiB bf16 (read+write)", "device": dev_name, "value": round(copy_gbs, 3),
                    "unit": "GB/s", "ceiling": round(copy_gbs, 3), "ratio": 1.0, "prediction": 1.0,
                    "command": command})

    rng = np.random.default_rng(0)
    batches = [int(x) for x in args.batches.split(",") if x]
    base_rows = max(batches)
    for dist in [d for d in args.dists.split(",") if d]:
        if dist == "lm":
            host = (rng.standard_normal((base_rows, V)) * 2.5).astype(np.float32)
            for r in range(base_rows):
                host[r, rng.integers(0, V, 200)] += rng.uniform(5, 12, 200).astype(np.float32)
        elif dist == "flat":
            host = rng.standard_normal((base_rows, V)).astype(np.float32)
        else:
            raise SystemExit("unknown --dists entry %r (lm, flat)" % dist)
        for dtype in [d for d in args.dtypes.split(",") if d]:
            esize = 2 if dtype in ("bfloat16", "float16") else 4
            base = tallow.tensor(host, dtype=dtype).to("cuda")
            for B in batches:
                row_bytes = B * V * esize
                copies = max(1, min(-(-2 * l2 // row_bytes), (2 << 30) // row_bytes))
                sets = tallow.empty([copies * B, V], dtype, "cuda")
                for c in range(copies):  # copy c holds base rows (c * B ..) mod base_rows
                    for r0 in range(0, B, base_rows):
                        nr = min(base_rows, B - r0)
                        src_row = (c * B + r0) % (base_rows - nr + 1)
                        sets.narrow(0, c * B + r0, nr).copy_(base.narrow(0, src_row, nr))
                views = [sets.narrow(0, c * B, B) for c in range(copies)]
                for case in [c for c in args.cases.split(",") if c]:
                    T, k, p, mp = CASES[case]
                    prm_host = dict(temperature=np.full(B, T, np.float32), top_k=np.full(B, k, np.int32),
                                    top_p=np.full(B, p, np.float32), min_p=np.full(B, mp, np.float32),
                                    seeds=rng.integers(-2**63, 2**63 - 1, B, dtype=np.int64),
                                    offsets=rng.integers(0, 1 << 20, B).astype(np.int64))
                    prm = {name: tallow.from_numpy(v).to("cuda") for name, v in prm_host.items()}

                    def call(i, prm=prm):
                        ops.sample_tokens(views[i % copies], **prm)

                    t_pass_us = row_bytes / (copy_gbs * 1e9) / 0.85 * 1e6
                    pred_us = PASSES[(case, dist)] * t_pass_us + FIXED_US[case]
                    calls = max(args.iters, copies)
                    eager = time_ms(call, calls) * 1e3
                    graph = time_graph_ms(call, calls)
                    us = graph * 1e3 if graph is not None else eager
                    gbs = row_bytes / (us * 1e-6) / 1e9
                    row = {"name": "sample_tokens[%s %s %s B=%d V=%d]" % (case, dtype, dist, B, V), "device": dev_name,
                           "value": round(us, 2), "unit": "us", "eager_us": round(eager, 2),
                           "timing": "cuda graph" if graph is not None else "eager", "gbps": round(gbs, 1),
                           "ceiling_gbps": round(copy_gbs, 1), "ratio": round(gbs / copy_gbs, 4),
                           "prediction": round(pred_us, 2), "command": command}
                    if not args.no_check:
                        rows = min(B, 16)
                        lt = views[0].narrow(0, 0, rows)
                        sub = {name: tallow.from_numpy(np.ascontiguousarray(v[:rows])) for name, v in prm_host.items()}
                        gpu = ops.sample_tokens(lt, **{name: t.to("cuda") for name, t in sub.items()}).to("cpu").numpy()
                        cpu = ops.sample_tokens(lt.to("cpu"), **sub).numpy()
                        row["cpu_agreement"] = round(float(np.mean(gpu == cpu)), 3)
                    results.append(row)
                    print("%-58s %9.1f us  (eager %8.1f)  %7.1f GB/s  ratio %.3f  predicted %7.1f us%s" %
                          (row["name"], us, eager, gbs, row["ratio"], pred_us,
                           "  cpu agreement %.2f" % row["cpu_agreement"] if "cpu_agreement" in row else ""),
                          flush=True)

    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)
    print("wrote", out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
