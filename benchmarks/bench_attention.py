#!/usr/bin/env python3
"""Paged attention on CUDA against the device's limits (issue 8, targets 3 and 4).

  * ceiling for decode: device copy bandwidth, tallow copy_ of a 1 GiB buffer (bytes read + written
    per second);
  * paged decode attention (tallow.ops.paged_attention with one query per sequence: the split-KV
    kernel of cuda/attention/decode.cu), Llama-3-8B heads (32 query, 8 kv, head dim 128), batch
    {1, 2, 4, 8, 32, 64} x context {4096, 8192, 16384, 32768}, bf16 and fp8 caches: GB/s of K + V bytes
    read (batch x context x 8 heads x 128 x 2 x element size) per second, and its ratio to the copy
    bandwidth (target: >= 0.8); plus short contexts (128, 1024 keys) with tables padded to 4096
    tokens as in a captured decode step, whose us_per_call is the kernel's fixed cost;
  * ceiling for prefill: cuBLAS bf16 GEMM rate, tallow.ops.matmul 4096 x 4096 x 4096;
  * paged prefill attention of one 4096-token causal sequence, same heads, TFLOP/s counted as
    2 * T^2 * D * Hq (the causal half of QK^T and PV).

Caches are head-major by default, as the engine allocates them on CUDA (--layout hnd: a kv head's rows
of a block are contiguous); --layout nhd gives row-major blocks.

Timing: CUDA events around `--iters` back-to-back calls, the median of `--reps` repetitions, after
warm-up. Decode calls are also captured into one CUDA graph (as the engine runs decode steps) and
the graph's replays give the reported value (eager_value: the same calls launched one by one, host
overhead included). Calls pass settled_cache=True, as the attention layer does after its cache write
(here the previous kernel, the previous call, writes no cache rows): a call's first K/V copies go out
while the previous call finishes. A timed set cycles through enough disjoint copies of the inputs (distinct cache blocks) to
exceed twice the L2 cache, so K/V come from HBM as they do in a model's layers. Index checks are
off (as in the engine). Inputs are random (tallow.ops.fill_uniform_ when present). Every
measurement carries the prediction written before it ran. Writes JSON objects {name, device,
value, unit, ceiling, ratio, prediction, command} to --json (default
benchmarks/results/attention_<device>.json). Without CUDA the script says so and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

import gpu_timing

HQ, HK, D, BS = 32, 8, 128, 16
# Predictions, written before the run. Decode (one kernel: cp.async pipelines, the split merge in the
# last CTA, PDL overlapping a call's start with the previous call's end) reaches ~0.90 of copy
# bandwidth on long streams, less a fixed ~1.5 us a call (pipeline ramp-up, merge tail); fp8 caches
# the same GB/s of cache bytes. Earlier predictions (two kernels): 0.85 and 3.0 us. Prefill ~0.5 of
# the cuBLAS GEMM rate.
DECODE_PEAK_RATIO, DECODE_FIXED_US = 0.90, 1.5
PREFILL_PREDICTION = 0.5
# Fixed cost as a model's decode step sees it: short contexts, block tables padded to 4096 tokens.
FIXED_COST_CONFIGS = [(1, 128), (8, 128), (1, 1024)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,2,4,8,32,64")
    ap.add_argument("--contexts", default="4096,8192,16384,32768")
    ap.add_argument("--dtypes", default="bfloat16,float8_e4m3")
    ap.add_argument("--max-kv-gb", type=float, default=60.0, help="skip configurations whose K+V exceed this")
    ap.add_argument("--layout", choices=("hnd", "nhd"), default="hnd",
                    help="cache blocks head-major (hnd: the engine's CUDA layout, a [blocks, rows, heads, dim] "
                         "view of [blocks, heads, rows, dim] memory) or row-major (nhd)")
    ap.add_argument("--pad-to", type=int, default=0,
                    help="pad block tables to this many tokens (as a graph-captured decode step does)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--no-fixed-cost", action="store_true",
                    help="skip the short-context rows (tables padded to 4096 tokens)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import tallow
    import tallow.cuda as tc
    from tallow import ops

    if not tc.is_available():
        print("bench_attention: no CUDA device (tallow built with CUDA: %s); skipping" % tc.built)
        return 0
    tc.set_index_checks(False)
    dev_name = tc.get_device_name()
    l2 = int(tc.get_device_properties().get("l2_cache_size", 50 << 20))
    out_path = args.json or gpu_timing.results_path("attention", dev_name)
    command = "python benchmarks/bench_attention.py " + " ".join(sys.argv[1:])
    results = []
    seed = [0]

    def fill(t, lo=-2.0, hi=2.0):
        """Random values in place (float dtypes; fp8 through a bf16 staging chunk)."""
        rows = t.shape[0]
        per_row = max(1, t.numel() // max(rows, 1))
        step = max(1, (64 << 20) // per_row)
        host_chunk = None
        for r0 in range(0, rows, step):
            n = min(step, rows - r0)
            part = t.narrow(0, r0, n)
            stage = part if part.dtype != tallow.float8_e4m3 else tallow.empty(list(part.shape), "bfloat16", "cuda")
            seed[0] += 1
            if hasattr(ops, "fill_uniform_"):
                ops.fill_uniform_(stage, lo, hi, seed[0])
            else:  # one host chunk, reused
                if host_chunk is None or host_chunk.shape[0] != n:
                    host = np.random.default_rng(seed[0]).uniform(lo, hi, size=list(stage.shape)).astype(np.float32)
                    host_chunk = tallow.tensor(host, dtype="bfloat16").to("cuda")
                stage.copy_(host_chunk if stage.dtype == tallow.bfloat16 else ops.cast(host_chunk, stage.dtype))
            if stage is not part:
                part.copy_(ops.cast(stage, "float8_e4m3"))
        return t

    def cache(blocks, dtype):
        """A random [blocks, BS, HK, D] paged cache in --layout (filled through its contiguous storage)."""
        if args.layout == "hnd":
            return fill(tallow.empty([blocks, HK, BS, D], dtype, "cuda")).permute(0, 2, 1, 3)
        return fill(tallow.empty([blocks, BS, HK, D], dtype, "cuda"))

    def time_ms(fn, iters=args.iters, reps=args.reps, warm=3):
        return gpu_timing.time_ms(fn, iters, reps, warm)

    def time_graph_ms(fn, calls):
        return gpu_timing.time_graph_ms(fn, calls, args.reps)

    def record(name, value, unit, ceiling, prediction, **extra):
        row = {"name": name, "device": dev_name, "value": round(value, 3), "unit": unit,
               "ceiling": round(ceiling, 3), "ratio": round(value / ceiling, 4), "prediction": round(prediction, 3),
               "command": command}
        row.update(extra)
        results.append(row)
        print("%-52s %10.1f %-8s ceiling %8.1f  ratio %.3f  (predicted %.2f)" %
              (name, value, unit, ceiling, row["ratio"], prediction), flush=True)

    # ---- copy bandwidth ----------------------------------------------------------------------------
    def measure_copy(n=512 << 20):  # bf16 elements: 1 GiB
        src, dst = fill(tallow.empty([n], "bfloat16", "cuda")), tallow.empty([n], "bfloat16", "cuda")
        return 2 * n * 2 / time_ms(lambda i: dst.copy_(src), iters=10) / 1e6

    copy_gbs = measure_copy()
    print("device: %s, L2 %d MiB; copy_ of 1 GiB: %.1f GB/s (read + write)" % (dev_name, l2 >> 20, copy_gbs))
    results.append({"name": "copy_ 1GiB bf16 (read+write)", "device": dev_name, "value": round(copy_gbs, 3),
                    "unit": "GB/s", "ceiling": round(copy_gbs, 3), "ratio": 1.0, "prediction": 1.0,
                    "command": command})

    def check_decode(dtype, scales, B=4, ctx=3000):
        """The kernel timed above against the CPU op on a small batch (relative L2 error printed)."""
        nblk = B * -(-ctx // BS)
        kc, vc = (fill(tallow.empty([nblk, BS, HK, D], dtype, "cuda")) for _ in range(2))
        q = fill(tallow.empty([B, HQ, D], "bfloat16", "cuda"))
        tables = tallow.from_numpy(np.random.default_rng(3).permutation(nblk).astype(np.int32).reshape(B, -1))
        seq_lens = tallow.from_numpy(np.array([ctx - 7 * i for i in range(B)], np.int32))
        qsl = tallow.from_numpy(np.arange(B + 1, dtype=np.int32))
        got = ops.paged_attention(q, kc, vc, tables.to("cuda"), seq_lens.to("cuda"), qsl.to("cuda"), D**-0.5, **scales)
        ref = ops.paged_attention(q.to("cpu").to("float32"), kc.to("cpu"), vc.to("cpu"), tables, seq_lens, qsl,
                                  D**-0.5, **scales).numpy().astype(np.float64)
        got = got.to("cpu").to("float32").numpy().astype(np.float64)
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        print("    %s decode vs the CPU op: relative L2 error %.2e (bound 1e-2)" % (dtype, err), flush=True)

    # ---- decode ------------------------------------------------------------------------------------
    batches = [int(x) for x in args.batches.split(",") if x]
    contexts = [int(x) for x in args.contexts.split(",") if x]
    for dtype in [x for x in args.dtypes.split(",") if x]:
        esize = 1 if dtype == "float8_e4m3" else 2
        row_bytes = HK * D * esize  # one token's K (or V) row, all kv heads
        configs = [(b, c, max(c, args.pad_to)) for b in batches for c in contexts
                   if 2 * b * c * row_bytes <= args.max_kv_gb * 1e9]
        if not args.no_fixed_cost:
            configs += [(b, c, 4096) for b, c in FIXED_COST_CONFIGS]
        if not configs:
            continue
        blocks_needed = max(b * c for b, c, _ in configs) // BS
        # copies of the smallest config to overflow L2 also have to fit
        blocks_needed = max(blocks_needed, max(-(-4 * l2 // (2 * b * c * row_bytes)) * b * c // BS
                                               for b, c, _ in configs))
        kc, vc = cache(blocks_needed, dtype), cache(blocks_needed, dtype)
        scales = dict(k_scale=0.05, v_scale=0.05) if esize == 1 else {}
        rng = np.random.default_rng(1)
        for B, ctx, padded in configs:
            nblk = B * ctx // BS
            kv_bytes = 2 * B * ctx * row_bytes
            copies = max(1, min(blocks_needed // nblk, -(-2 * l2 // kv_bytes)))
            width = padded // BS
            perm = rng.permutation(blocks_needed)
            sets = []
            for c in range(copies):
                tables = np.zeros((B, width), np.int32)
                tables[:, :ctx // BS] = perm[c * nblk:(c + 1) * nblk].reshape(B, ctx // BS)
                q = fill(tallow.empty([B, HQ, D], "bfloat16", "cuda"))
                sets.append((q, tallow.from_numpy(tables).to("cuda")))
            seq_lens = tallow.from_numpy(np.full(B, ctx, np.int32)).to("cuda")
            qsl = tallow.from_numpy(np.arange(B + 1, dtype=np.int32)).to("cuda")
            out = tallow.empty([B, HQ, D], "bfloat16", "cuda")

            def call(i):
                q, tables = sets[i % copies]
                ops.paged_attention(q, kc, vc, tables, seq_lens, qsl, D**-0.5, out=out, settled_cache=True, **scales)

            predicted_s = kv_bytes / (copy_gbs * 1e9) + DECODE_FIXED_US * 1e-6
            prediction = DECODE_PEAK_RATIO * (kv_bytes / (copy_gbs * 1e9)) / predicted_s
            ms_eager = time_ms(call)
            ms_graph = time_graph_ms(call, max(args.iters, copies))
            ms = ms_graph if ms_graph is not None else ms_eager
            record("paged_decode_attention[%s B=%d ctx=%d%s]" % ("fp8" if esize == 1 else "bf16", B, ctx,
                                                                  " table=%d" % padded if padded != ctx else ""),
                   kv_bytes / ms / 1e6, "GB/s", copy_gbs, prediction, timing="cuda graph" if ms_graph else "eager",
                   eager_value=round(kv_bytes / ms_eager / 1e6, 3), us_per_call=round(ms * 1e3, 2))
        del kc, vc
        check_decode(dtype, scales)

    # ---- prefill -----------------------------------------------------------------------------------
    if not args.no_prefill:
        N = 4096
        a, b = fill(tallow.empty([N, N], "bfloat16", "cuda"), -1, 1), fill(tallow.empty([N, N], "bfloat16", "cuda"), -1, 1)
        c = tallow.empty([N, N], "bfloat16", "cuda")
        ops.matmul(a, b, out=c)
        ms = time_ms(lambda i: ops.matmul(a, b, out=c), iters=10)
        gemm_tflops = 2.0 * N ** 3 / ms / 1e9
        print("cuBLAS bf16 GEMM %dx%dx%d: %.1f TFLOP/s" % (N, N, N, gemm_tflops))
        results.append({"name": "matmul bf16 4096x4096x4096", "device": dev_name, "value": round(gemm_tflops, 3),
                        "unit": "TFLOP/s", "ceiling": round(gemm_tflops, 3), "ratio": 1.0, "prediction": 1.0,
                        "command": command})
        del a, b, c
        T = 4096
        nblk = T // BS
        kc, vc = cache(nblk, "bfloat16"), cache(nblk, "bfloat16")
        q = fill(tallow.empty([T, HQ, D], "bfloat16", "cuda"))
        tables = tallow.from_numpy(np.random.default_rng(2).permutation(nblk).astype(np.int32)[None]).to("cuda")
        seq_lens = tallow.from_numpy(np.array([T], np.int32)).to("cuda")
        qsl = tallow.from_numpy(np.array([0, T], np.int32)).to("cuda")
        out = tallow.empty([T, HQ, D], "bfloat16", "cuda")
        ms = time_ms(lambda i: ops.paged_attention(q, kc, vc, tables, seq_lens, qsl, D**-0.5, out=out), iters=10)
        flops = 2.0 * T * T * D * HQ
        record("paged_prefill_attention[bf16 T=4096 causal]", flops / ms / 1e9, "TFLOP/s", gemm_tflops,
               PREFILL_PREDICTION)

    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)
    print("wrote", out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
