"""rope_and_cache on CUDA: microseconds a call and bytes moved against the copy bandwidth, for the
warp kernel (rows a lane: the default choice, and 1, 2, 4 pinned with TALLOW_ROPE_ROWS) and the block
kernel (TALLOW_ROPE_WARP=0) side by side, at decode and prefill sizes.

    python benchmarks/bench_rope_cache.py [--tokens 1,64,256,1024,8192] [--json FILE]

Shapes (bf16, a head-major bf16 cache of 16-token blocks, as the engine runs them): Qwen3-0.6B
(16 q / 8 kv heads of 128, q/k RMSNorm) and Llama-3-8B (32 / 8 heads of 128, no norm). Each call
reads q, k, v and writes q, k and both cache rows: T x 128 x 2 bytes x (2 Hq + 2 Hk + 3 Hk).
Calls are captured in one CUDA graph (as in a decode step, PDL included), cycling over enough copies
of the inputs that every call reads from HBM, not L2; the median of 5 replays. The output of the
two kernels is compared bitwise on the first copy (they claim the same bits)."""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPES = {"qwen3_0.6b": dict(hq=16, hk=8, d=128, norm=True), "llama3_8b": dict(hq=32, hk=8, d=128, norm=False)}


def make_inputs(sh, t, dev, rng, seed):
    import tallow
    from tallow import ops

    hq, hk, d = sh["hq"], sh["hk"], sh["d"]
    bs = 16
    nb = -(-t // bs) + 1

    def uniform(shape, lo, hi, s):
        return ops.fill_uniform_(tallow.empty(shape, "bfloat16", dev), lo, hi, seed * 101 + s)

    qkv = uniform([t, hq + 2 * hk, d], -2.0, 2.0, 1)
    # head-major blocks, taken through the strided [blocks, rows, heads, dim] view (as the runner does)
    kc = uniform([nb, hk, bs, d], -1.0, 1.0, 2).permute(0, 2, 1, 3)
    vc = uniform([nb, hk, bs, d], -1.0, 1.0, 3).permute(0, 2, 1, 3)
    pos = tallow.from_numpy(rng.integers(0, 4096, size=t).astype(np.int64)).to(dev)
    slots = tallow.from_numpy(rng.permutation(nb * bs)[:t].astype(np.int64)).to(dev)
    w = [uniform([d], 0.5, 1.5, 4 + i) for i in range(2)] if sh["norm"] else [None, None]
    return dict(qkv=qkv, kc=kc, vc=vc, pos=pos, slots=slots, qw=w[0], kw=w[1])


def call(sh, inp, cs):
    from tallow import ops

    hq, hk = sh["hq"], sh["hk"]
    qkv = inp["qkv"]
    ops.rope_and_cache(inp["pos"], qkv[:, :hq, :], qkv[:, hq:hq + hk, :], qkv[:, hq + hk:, :], cs, True,
                       inp["kc"], inp["vc"], inp["slots"], inp["qw"], inp["kw"], 1e-6, False, 1.0, 1.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,64,256,1024,8192")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import gpu_e2e
    from gpu_timing import time_graph_ms

    import tallow
    import tallow.cuda as tc

    if not tc.is_available():
        print("bench_rope_cache: no CUDA device; skipping")
        return 0
    dev = "cuda:0"
    name = tc.get_device_name()
    bw = gpu_e2e.copy_bandwidth(dev)
    l2 = tc.get_device_properties()["l2_cache_size"]
    cs = tallow.from_numpy(np.ascontiguousarray(
        np.concatenate([np.cos(np.outer(np.arange(4096), 1e-4 ** (np.arange(64) / 64))),
                        np.sin(np.outer(np.arange(4096), 1e-4 ** (np.arange(64) / 64)))], 1).astype(np.float32))).to(dev)
    rng = np.random.default_rng(0)
    print(f"bench_rope_cache: {name}, copy bandwidth {bw / 1e9:,.0f} GB/s")
    modes = {"default": {}, "rows1": {"TALLOW_ROPE_ROWS": "1"}, "rows2": {"TALLOW_ROPE_ROWS": "2"},
             "rows4": {"TALLOW_ROPE_ROWS": "4"}, "block": {"TALLOW_ROPE_WARP": "0"}}
    print(f"{'shape':<11} {'tokens':>6} {'MB/call':>8} " + " ".join(f"{m:>12}" for m in modes)
          + "  (us a call / fraction of copy bandwidth)")
    results = []
    for sname, sh in SHAPES.items():
        for t in (int(x) for x in args.tokens.split(",")):
            hq, hk, d = sh["hq"], sh["hk"], sh["d"]
            nbytes = t * d * 2 * (2 * hq + 2 * hk + 3 * hk)
            copies = max(2, min(64, -(-3 * l2 // nbytes)))
            inps = [make_inputs(sh, t, dev, rng, i) for i in range(copies)]
            calls = max(copies, min(200, 20 * copies))
            us, outs = {}, {}
            pristine = {k: inps[0][k].clone() for k in ("qkv", "kc", "vc")}  # the timed calls rotate q in place
            for mode, env in modes.items():
                os.environ.update(env)
                probe = dict(inps[0], **{k: v.clone() for k, v in pristine.items()})
                call(sh, probe, cs)
                tc.synchronize()
                outs[mode] = [probe[k].to("cpu").to("float32").numpy() for k in ("qkv", "kc", "vc")]
                ms = time_graph_ms(lambda i: call(sh, inps[i % copies], cs), calls, 5)
                us[mode] = ms * 1e3 if ms is not None else float("nan")
                for k in env:
                    os.environ.pop(k)
            same = all(np.array_equal(a, b) for m in modes for a, b in zip(outs[m], outs["block"]))
            print(f"{sname:<11} {t:>6} {nbytes / 1e6:>8.2f} "
                  + " ".join(f"{us[m]:7.2f}/{nbytes / (us[m] * 1e-6) / bw:.2f}" for m in modes)
                  + ("" if same else "  OUTPUTS DIFFER"))
            results.append(dict(shape=sname, tokens=t, bytes=nbytes, us=us,
                                ratio={m: nbytes / (us[m] * 1e-6) / bw for m in modes}, bitwise_same=same,
                                device=name, copy_bandwidth_GB_s=bw / 1e9,
                                command="python benchmarks/bench_rope_cache.py --tokens " + args.tokens))
            del inps
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r["bitwise_same"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
