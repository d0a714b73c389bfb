#!/usr/bin/env python3
"""quant_linear on CUDA (GGUF block weights kept quantized, cuda/quant_linear.cu) vs ops.linear on bf16
weights of the same shape.

Shapes: Llama-3-8B's projections as a Q4_K_M GGUF holds them (N x K): q/o 4096 x 4096 Q4_K, k/v 1024 x 4096
Q4_K, gate/up 14336 x 4096 Q4_K, down 4096 x 14336 Q4_K and Q6_K, lm_head 128256 x 4096 Q6_K; --types
adds other block types on the 4096 x 4096 shape. M (rows of x) in {1, 2, 4, 8, 16, 64, 512, 4096}.
Each variant is timed as a CUDA graph of back-to-back calls (as the engine's decode steps run) that cycle
over enough copies of the weight to overflow L2 several times, so weights stream from HBM; median of
--reps replays, the quantized op and linear timed in turn. Printed: us a call, GB/s over the bytes a call
reads (the quantized weight, plus x and out) and that as a % of the copy bandwidth (a device-to-device
copy of a 1 GiB tensor, bytes read + written, the faster of eager and captured), TFLOP/s from M = 64, and the speedup over bf16 linear.
Before timing, every (type, M path) is checked against linear(x, dequantize(w)) in f32 (relative L2 error
<= 0.02 at M <= 16, the q8 activations' bound; 1e-2 above: x's dtype products of the same weights): a wrong
result stops the run. --json writes the rows.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np

import tallow
from tallow import cuda as tc

sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
from gpu_timing import time_graph_ms, time_ms  # noqa: E402

# (name, N, K, dtype)
SHAPES = [
    ("q_o_proj", 4096, 4096, "q4_k"),
    ("k_v_proj", 1024, 4096, "q4_k"),
    ("gate_up_proj", 14336, 4096, "q4_k"),
    ("down_proj", 4096, 14336, "q4_k"),
    ("down_proj", 4096, 14336, "q6_k"),
    ("lm_head", 128256, 4096, "q6_k"),
]
MS = [1, 2, 4, 8, 16, 64, 512, 4096]
BLOCK = {  # name: (elements, bytes, f16 scale offsets, f32 scale offsets)
    "q4_0": (32, 18, [0], []), "q4_1": (32, 20, [0, 2], []), "q5_0": (32, 22, [0], []),
    "q5_1": (32, 24, [0, 2], []), "q8_0": (32, 34, [0], []), "q2_k": (256, 84, [80, 82], []),
    "q3_k": (256, 110, [108], []), "q4_k": (256, 144, [0, 2], []), "q5_k": (256, 176, [0, 2], []),
    "q6_k": (256, 210, [208], []), "iq4_nl": (32, 18, [0], []), "iq4_xs": (256, 136, [0], []),
    "q8_1": (32, 36, [0, 2], []), "q8_k": (256, 292, [], [0]),
}


def random_blocks(rng, name, rows, k):
    """Random quant bytes with scale fields of a trained weight's size (|d| ~ 1e-2)."""
    bs, ts, f16_at, f32_at = BLOCK[name]
    nb = k // bs
    raw = rng.integers(0, 256, size=(rows, nb, ts), dtype=np.uint8)
    for off in f16_at:
        v = (rng.choice([-1.0, 1.0], size=(rows, nb)) * rng.uniform(0.5, 2.0, size=(rows, nb)) * 1e-2)
        raw[:, :, off:off + 2] = v.astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    for off in f32_at:
        v = (rng.uniform(0.5, 2.0, size=(rows, nb)) * 1e-3).astype(np.float32)
        raw[:, :, off:off + 4] = v.view(np.uint8).reshape(rows, nb, 4)
    return tallow.from_buffer(raw.reshape(rows, nb * ts), dtype=name, shape=[rows, k])


def rel_err(a, b):
    a = np.asarray(a.to("float32").to("cpu").numpy(), dtype=np.float64)
    b = np.asarray(b.to("float32").to("cpu").numpy(), dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def copy_bandwidth_gbs(reps):
    n = 1 << 30
    src = tallow.from_numpy(np.ones(n // 4, dtype=np.float32)).to("cuda")
    dst = tallow.from_numpy(np.zeros(n // 4, dtype=np.float32)).to("cuda")
    # the faster of eager and captured copies (a captured memcpy node can run slower than the eager call)
    times = [t for t in (time_ms(lambda i: dst.copy_(src), 4, reps), time_graph_ms(lambda i: dst.copy_(src), 4, reps))
             if t]
    return 2 * n / min(times) / 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="rows of x, comma-separated")
    ap.add_argument("--types", default="", help="extra block types on 4096 x 4096, e.g. q4_0,q8_0,iq4_xs")
    ap.add_argument("--shapes", default="", help="only these shape names (comma-separated)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="x's dtype")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--l2-mult", type=float, default=4.0, help="weight copies cycled: this many times L2")
    ap.add_argument("--check-only", action="store_true", help="run the correctness checks, no timing")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    if not tc.is_available():
        print("bench_quant_linear_cuda: no CUDA device; nothing to measure")
        return 0
    ms_list = [int(m) for m in a.ms.split(",") if m]
    shapes = [s for s in SHAPES if not a.shapes or s[0] in a.shapes.split(",")]
    shapes += [("extra_4096", 4096, 4096, t) for t in a.types.split(",") if t]
    dev = tc.get_device_name()
    l2 = tc.get_device_properties()["l2_cache_size"]
    rng = np.random.default_rng(0)
    print(f"device: {dev}, L2 {l2 / 2**20:.0f} MiB, x dtype {a.dtype}")

    # Correctness first: one small-N slice of each type, every M path.
    for name, _, K, qt in shapes:
        w = random_blocks(rng, qt, 67, K).to("cuda")
        wd = tallow.ops.dequantize(w, "float32")
        for M in sorted({1, 3, 16, 17, 64} | set(m for m in ms_list if m <= 64)):
            x = tallow.from_numpy(rng.standard_normal((M, K)).astype(np.float32)).to("cuda")
            bias = tallow.from_numpy(rng.standard_normal(67).astype(np.float32)).to("cuda")
            got = tallow.ops.quant_linear(tallow.ops.cast(x, a.dtype), w, tallow.ops.cast(bias, a.dtype))
            ref = tallow.ops.linear(x, wd, bias)
            err = rel_err(got, ref)
            bound = 0.02 if M <= 16 else 1e-2
            ok = err <= bound
            print(f"  check {qt:7s} K={K:5d} M={M:3d}: rel L2 err {err:.2e} (bound {bound:.0e}) {'ok' if ok else 'FAIL'}")
            if not ok:
                return 1
    # W of many rows: above 8 rows of x, W is dequantized in L2-sized row chunks (about 20 MiB of x's dtype,
    # a few thousand rows at K = 4096), each chunk's product written into its columns of out. The lm head
    # (>= 50 chunks) and 10001 rows (a tail chunk that is not a multiple of 128 rows); one of them captured.
    for qt, N, M, in_graph in (("q6_k", 128256, 17, False), ("q6_k", 128256, 64, False),
                               ("q4_k", 128256, 17, False), ("q4_k", 128256, 64, False),
                               ("q4_k", 10001, 40, False), ("q6_k", 10001, 64, True)):
        K = 4096
        w = random_blocks(rng, qt, N, K).to("cuda")
        wd = tallow.ops.dequantize(w, "float32")
        x = tallow.from_numpy(rng.standard_normal((M, K)).astype(np.float32)).to("cuda")
        bias = tallow.from_numpy(rng.standard_normal(N).astype(np.float32)).to("cuda")
        xc, bc = tallow.ops.cast(x, a.dtype), tallow.ops.cast(bias, a.dtype)
        if in_graph:
            got = tallow.empty([M, N], a.dtype, "cuda")
            tallow.ops.quant_linear(xc, w, bc, out=got)  # eager first: cuBLASLt's timing runs outside capture
            got = tallow.empty([M, N], a.dtype, "cuda")
            g = tc.CUDAGraph()
            with tc.graph(g):
                tallow.ops.quant_linear(xc, w, bc, out=got)
            g.replay()
            tc.synchronize()
        else:
            got = tallow.ops.quant_linear(xc, w, bc)
        err = rel_err(got, tallow.ops.linear(x, wd, bias))
        ok = err <= 1e-2
        print(f"  check {qt:7s} N={N:6d} K={K:5d} M={M:3d}{' in a graph' if in_graph else ''} (row chunks): "
              f"rel L2 err {err:.2e} (bound 1e-02) {'ok' if ok else 'FAIL'}")
        if not ok:
            return 1
        del w, wd
    # Under graph capture (the decode kernels then launch with PDL): several products back to back, each
    # with its own x, replayed, must equal the eager calls bit for bit.
    for qt in sorted({s[3] for s in shapes}):
        w = random_blocks(rng, qt, 67, 4096).to("cuda")
        for M in (1, 8, 16):
            xs = [tallow.ops.cast(tallow.from_numpy(rng.standard_normal((M, 4096)).astype(np.float32)).to("cuda"),
                                  a.dtype) for _ in range(4)]
            outs = [tallow.empty([M, 67], a.dtype, "cuda") for _ in xs]
            g = tc.CUDAGraph()
            with tc.graph(g):
                for xi, oi in zip(xs, outs):
                    tallow.ops.quant_linear(xi, w, out=oi)
            g.replay()
            tc.synchronize()
            same = all(np.array_equal(o.to("float32").to("cpu").numpy(),
                                      tallow.ops.quant_linear(xi, w).to("float32").to("cpu").numpy())
                       for xi, o in zip(xs, outs))
            print(f"  check {qt:7s} M={M:3d} in a graph: {'ok (bitwise equal to eager)' if same else 'FAIL'}")
            if not same:
                return 1
    if a.check_only:
        return 0

    peak = copy_bandwidth_gbs(a.reps)
    print(f"copy bandwidth (1 GiB D2D, read + written): {peak:.0f} GB/s")
    rows = []
    esz = {"bfloat16": 2, "float16": 2, "float32": 4}[a.dtype]
    print(f"{'shape':14s} {'type':6s} {'N x K':>13s} {'M':>5s} | {'quant us':>9s} {'GB/s':>6s} {'%copy':>6s} "
          f"{'TF/s':>6s} | {'bf16 us':>8s} {'GB/s':>6s} | {'speedup':>7s}")
    for name, N, K, qt in shapes:
        bs, ts = BLOCK[qt][0], BLOCK[qt][1]
        qbytes = N * K // bs * ts
        ncq = max(1, math.ceil(a.l2_mult * l2 / qbytes))
        ncb = max(1, math.ceil(a.l2_mult * l2 / (2 * N * K)))
        wq = [random_blocks(rng, qt, N, K).to("cuda") for _ in range(ncq)]
        wb0 = tallow.ops.dequantize(wq[0], "bfloat16")
        wb = [wb0] + [wb0.clone() for _ in range(ncb - 1)]
        for M in ms_list:
            x = tallow.ops.cast(tallow.from_numpy(rng.standard_normal((M, K)).astype(np.float32)).to("cuda"), a.dtype)
            xb = tallow.ops.cast(x, "bfloat16")
            out = tallow.empty([M, N], a.dtype, "cuda")
            outb = tallow.empty([M, N], "bfloat16", "cuda")
            calls_q = max(ncq, 8 if M <= 64 else 2)
            calls_b = max(ncb, 8 if M <= 64 else 2)
            tq = time_graph_ms(lambda i: tallow.ops.quant_linear(x, wq[i % ncq], out=out), calls_q, a.reps)
            tb = time_graph_ms(lambda i: tallow.ops.linear(xb, wb[i % ncb], out=outb), calls_b, a.reps)
            read_q = qbytes + M * K * esz + M * N * esz
            read_b = 2 * N * K + M * K * 2 + M * N * 2
            r = {"device": dev, "shape": name, "type": qt, "N": N, "K": K, "M": M, "x_dtype": a.dtype,
                 "quant_us": tq * 1e3 if tq else None, "bf16_us": tb * 1e3 if tb else None, "copy_GB/s": peak}
            if tq:
                r["quant_GB/s"] = read_q / tq / 1e6
                r["quant_pct_copy"] = 100 * r["quant_GB/s"] / peak
                r["quant_TFLOP/s"] = 2 * M * N * K / tq / 1e9
            if tb:
                r["bf16_GB/s"] = read_b / tb / 1e6
            rows.append(r)
            tf = f"{r['quant_TFLOP/s']:6.1f}" if tq and M >= 64 else "     -"
            print(f"{name:14s} {qt:6s} {N:6d}x{K:<6d} {M:5d} | {r['quant_us'] or float('nan'):9.1f} "
                  f"{r.get('quant_GB/s', float('nan')):6.0f} {r.get('quant_pct_copy', float('nan')):5.1f}% {tf} | "
                  f"{r['bf16_us'] or float('nan'):8.1f} {r.get('bf16_GB/s', float('nan')):6.0f} | "
                  f"{(tb / tq) if tq and tb else float('nan'):6.2f}x")
        del wq, wb
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
