#!/usr/bin/env python3
"""Decode attention over the nano-vllm workload's context mix (issue 8, targets 2 and 4).

The nano-vllm workload (benchmarks/gpu_e2e.py --target nanovllm: Qwen3-0.6B shape, 256 sequences,
input and output lengths uniform in 100-1024, seed 0) spends most of its GPU time reading the KV
cache: summed over its decode steps, 28 layers x 8 kv heads x 128 x 2 (K, V) x 2 bytes per context
token come to ~15.7 TB, 5.2 s at 3.0 TB/s, against 7.4 s of steps measured on an H100. This script
times the decode attention alone on the batches those steps see: at decode step s the sequences
with more than s output tokens, each over its prompt plus s + 1 keys, block tables 4096 / 16 = 256
wide (the engine's max_model_len 4096), blocks numbered as a fresh pool hands them out (the prompts
in order, then one block a sequence whenever its context crosses a block boundary). `--layers`
calls (one a layer) are captured into one CUDA graph, as a decode step runs them; the value is
K + V bytes read per second, and its ratio to the copy bandwidth measured in the same run (with the
prediction written before the first run).

`--env` runs the same batches again under other settings of the kernel's tuning variables
(cuda/attention/decode.cuh; read per call, so per capture), e.g.
    python benchmarks/bench_decode_mix.py --env TALLOW_DECODE_STAGES=2 --env TALLOW_DECODE_SPLITS=2
Without CUDA the script says so and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

import gpu_e2e
import gpu_timing

HQ, HK, D, BS, WIDTH = 16, 8, 128, 16, 256


def prediction(step: int) -> float:
    """Ratio to copy bandwidth, written before the first run. The nano-vllm run's decode steps
    (benchmarks/results/nano_gaps_h100_80gb_hbm3.log) exceed their bytes by 1.19 ms plus 2.6% of
    the KV time (cuda/README.md), so the attention should stream at ~0.95-0.97 on the large batches;
    step 900 (42 sequences, 336 rows over 132 SMs) a little less."""
    return 0.95 if step <= 600 else 0.90


def nano_lengths():
    """Prompt and output lengths of the nano-vllm workload (gpu_e2e.nanovllm_workload)."""
    token_lists, out_lens, _ = gpu_e2e.nanovllm_workload()
    return np.array([len(t) for t in token_lists]), np.array(out_lens)


def block_tables_at(in_lens, out_lens, step):
    """The live sequences' contexts and block tables at decode step `step`, blocks numbered in the
    order a fresh pool hands them out."""
    tables = [list(range(sum(-(-int(n) // BS) for n in in_lens[:i]), sum(-(-int(n) // BS) for n in in_lens[:i + 1])))
              for i in range(len(in_lens))]
    nxt = sum(len(t) for t in tables)
    for s in range(step + 1):  # step s writes key in_len + s (the token sampled last)
        for i, n in enumerate(in_lens):
            if out_lens[i] > s and (int(n) + s) % BS == 0:
                tables[i].append(nxt)
                nxt += 1
    live = [i for i in range(len(in_lens)) if out_lens[i] > step]
    ctx = np.array([int(in_lens[i]) + step + 1 for i in live], np.int32)
    bt = np.zeros((len(live), WIDTH), np.int32)
    for r, i in enumerate(live):
        need = -(-int(ctx[r]) // BS)
        bt[r, :need] = tables[i][:need]
    return ctx, bt, nxt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", default="0,100,300,600,900", help="decode steps of the workload to time")
    ap.add_argument("--layers", type=int, default=28, help="calls in one captured graph")
    ap.add_argument("--dtype", choices=("bfloat16", "float8_e4m3"), default="bfloat16")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE[,NAME=VALUE]",
                    help="also time under these tuning variables (repeatable)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import tallow
    import tallow.cuda as tc
    from tallow import ops

    if not tc.is_available():
        print("bench_decode_mix: no CUDA device (tallow built with CUDA: %s); skipping" % tc.built)
        return 0
    tc.set_index_checks(False)
    dev_name = tc.get_device_name()
    command = "python benchmarks/bench_decode_mix.py " + " ".join(sys.argv[1:])
    esize = 1 if args.dtype == "float8_e4m3" else 2
    scales = dict(k_scale=0.05, v_scale=0.05) if esize == 1 else {}

    def fill(t, seed):
        stage = t if esize == 2 else tallow.empty(list(t.shape), "bfloat16", "cuda")
        ops.fill_uniform_(stage, -2.0, 2.0, seed)
        if stage is not t:
            t.copy_(ops.cast(stage, "float8_e4m3"))
        return t

    n = 512 << 20  # the copy bandwidth: a 1 GiB bf16 copy (bytes read + written)
    src, dst = fill(tallow.empty([n], "bfloat16", "cuda"), 1), tallow.empty([n], "bfloat16", "cuda")
    copy_gbs = 2 * n * 2 / gpu_timing.time_ms(lambda i: dst.copy_(src), 10, args.reps) / 1e6
    del src, dst
    print("device: %s; copy of 1 GiB: %.1f GB/s (read + write)" % (dev_name, copy_gbs), flush=True)

    in_lens, out_lens = nano_lengths()
    steps = [int(s) for s in args.steps.split(",") if s]
    plans = [(s, *block_tables_at(in_lens, out_lens, s)) for s in steps]
    nblocks = max(p[3] for p in plans)
    # Head-major blocks, as the engine allocates them on CUDA.
    kc = [fill(tallow.empty([nblocks, HK, BS, D], args.dtype, "cuda"), 10 + i).permute(0, 2, 1, 3) for i in range(2)]
    vc = [fill(tallow.empty([nblocks, HK, BS, D], args.dtype, "cuda"), 20 + i).permute(0, 2, 1, 3) for i in range(2)]

    settings = [""] + args.env
    results = []
    print("%-10s %5s %7s %9s %5s  %s" % ("step", "batch", "avg ctx", "floor us", "pred",
                                     "  ".join("%-26s" % (s or "default") for s in settings)), flush=True)
    for step, ctx, bt, _ in plans:
        B = len(ctx)
        q = fill(tallow.empty([B, HQ, D], "bfloat16", "cuda"), 30 + step)
        out = tallow.empty([B, HQ, D], "bfloat16", "cuda")
        tables = tallow.from_numpy(bt).to("cuda")
        seq_lens = tallow.from_numpy(ctx).to("cuda")
        qsl = tallow.from_numpy(np.arange(B + 1, dtype=np.int32)).to("cuda")
        kv_bytes = 2 * int(ctx.sum()) * HK * D * esize

        def call(i):  # layers alternate between two caches, as a step's layers read different ones
            ops.paged_attention(q, kc[i % 2], vc[i % 2], tables, seq_lens, qsl, D**-0.5, out=out,
                                settled_cache=True, **scales)

        cells = []
        for setting in settings:
            pairs = [kv.partition("=")[::2] for kv in setting.split(",") if kv]
            saved = {name: os.environ.get(name) for name, _ in pairs}
            os.environ.update(dict(pairs))
            try:
                ms = gpu_timing.time_graph_ms(call, args.layers, args.reps)
                if ms is None:  # capture failed (reported): calls launched one by one
                    ms = gpu_timing.time_ms(call, args.layers, args.reps)
            finally:
                for name, value in saved.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
            gbs = kv_bytes / ms / 1e6
            cells.append("%6.1f us %6.0f GB/s %.3f" % (ms * 1e3, gbs, gbs / copy_gbs))
            results.append({"name": "decode_mix[%s step=%d]%s" % ("fp8" if esize == 1 else "bf16", step,
                                                                  " " + setting if setting else ""),
                            "device": dev_name, "value": round(gbs, 1), "unit": "GB/s",
                            "ceiling": round(copy_gbs, 1), "ratio": round(gbs / copy_gbs, 4),
                            "prediction": prediction(step),
                            "batch": B, "average_context": round(float(ctx.mean()), 1),
                            "us_per_call": round(ms * 1e3, 2), "command": command})
        print("%-10s %5d %7.0f %9.1f %5.2f  %s" % (step, B, ctx.mean(), kv_bytes / copy_gbs / 1e3, prediction(step),
                                                   "  ".join(cells)), flush=True)

    out_path = args.json or gpu_timing.results_path("decode_mix", dev_name)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)
    print("wrote", out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
