#!/usr/bin/env python3
"""CUDA kernel benchmarks (ctest -L bench on a GPU build, or run directly):

  * device-to-device copy GB/s (bytes read + written) against the measured peak (the best
    contiguous copy, tallow's cudaMemcpyAsync path or torch's copy_, whichever is faster);
  * GEMM TFLOP/s and weight GB/s for the linear layers of Llama-3-8B (hidden 4096, 32/8 heads of 128,
    MLP 14336, vocab 128256) and Qwen3-0.6B (hidden 1024, 16/8 heads of 128, MLP 3072, vocab 151936)
    at decode (M = 1 .. 64) and prefill (M = 512, 4096) sizes, bf16, side by side with
    torch.matmul(x, w.T) in the same run (target: >= 95% of torch; decode: the weight streamed at
    >= 95% of the copy peak). Decode sizes are timed as CUDA graphs of back-to-back calls (as the
    engine launches them; a Python loop would time the launches) and, for M <= 16, also forced
    through tallow's gemv kernel and through cuBLASLt. TALLOW_BENCH_GEMV_SWEEP=1 (with
    tallow.cuda._c.set_gemv_config bound) also times gemv launch configurations per decode shape;
  * rms_norm, rotary_embedding, silu_and_mul GB/s (target: >= 80% of the copy bandwidth).

Timing: CUDA events around `iters` calls (or a graph replay), median of `reps` repetitions after
warm-up; weights are rotated among copies so that each timed set exceeds the L2 cache. Inputs are random (never zeros).
Every tallow result is also checked against torch (relative L2 error printed). torch is needed
for the comparisons and for generating the data; without torch or a GPU the script says so and
exits 0. Writes JSON to $TALLOW_BENCH_JSON when set.
"""
import json
import os
import statistics
import sys


def main() -> int:
    try:
        import torch
    except ImportError:
        print("bench_cuda: torch is not installed; skipping (it is the reference and the data source)")
        return 0
    import tallow
    import tallow.cuda as tc

    if not tc.is_available() or not torch.cuda.is_available():
        print("bench_cuda: no CUDA device (tallow cuda available: %s); skipping" % tc.is_available())
        return 0
    dev_name = tc.get_device_name()
    l2 = tc.get_device_properties()["l2_cache_size"]
    results = {"device": dev_name, "copy": [], "gemm": [], "ops": []}
    torch.manual_seed(0)

    def tl(t):  # torch CUDA tensor -> tallow view of the same memory
        return tallow.from_dlpack(t)

    def time_fn(fn, iters, reps=7, warm=3, sync_torch=True):
        for _ in range(warm):
            fn(0)
        torch.cuda.synchronize()
        tc.synchronize()
        times = []
        for _ in range(reps):
            s, e = tc.Event(enable_timing=True), tc.Event(enable_timing=True)
            # tallow ops run on tallow's current stream (the legacy default stream), torch's on its
            # current stream (also the default stream here), so one pair of events brackets both.
            s.record()
            for i in range(iters):
                fn(i)
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / iters)
        return statistics.median(times)  # ms

    def time_pair(fa, fb, iters, reps=7):
        """Median ms of fa and of fb, their repetitions interleaved (clock and heat drift hit both)."""
        ta, tb = [], []
        for _ in range(reps):
            ta.append(time_fn(fa, iters, reps=1, warm=1))
            tb.append(time_fn(fb, iters, reps=1, warm=1))
        return statistics.median(ta), statistics.median(tb)

    def rel(a, b):
        a, b = a.float(), b.float()
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    # ---- copy ----------------------------------------------------------------------------------
    n = 256 << 20  # 256 Mi elements of bf16: 512 MiB each way
    src_t = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst_t = torch.empty_like(src_t)
    src, dst = tl(src_t), tl(dst_t)
    nbytes = 2 * src_t.numel() * src_t.element_size()
    ms_tl = time_fn(lambda i: dst.copy_(src), 10)
    ms_th = time_fn(lambda i: dst_t.copy_(src_t), 10)
    peak = max(nbytes / ms_tl, nbytes / ms_th) / 1e6  # GB/s
    results["copy"].append({"what": "tallow copy_ contiguous (cudaMemcpyAsync)", "GB/s": nbytes / ms_tl / 1e6})
    results["copy"].append({"what": "torch copy_ contiguous", "GB/s": nbytes / ms_th / 1e6})
    # strided device copy through tallow's kernel: a transposed [8192, 16384] bf16 view
    a_t = torch.randn(8192, 16384, device="cuda", dtype=torch.bfloat16)
    b_t = torch.empty(16384, 8192, device="cuda", dtype=torch.bfloat16)
    a, b = tl(a_t), tl(b_t)
    ms = time_fn(lambda i: b.copy_(a.T), 5)
    results["copy"].append({"what": "tallow copy_ transposed [8192x16384] bf16 (strided kernel)",
                            "GB/s": 2 * a_t.numel() * 2 / ms / 1e6})
    assert torch.equal(b_t, a_t.T)
    del src_t, dst_t, src, dst, a_t, b_t, a, b
    for r in results["copy"]:
        r["ratio_to_peak"] = r["GB/s"] / peak
    results["copy_peak_GB/s"] = peak

    # ---- GEMM ----------------------------------------------------------------------------------
    def tl_graph(fn, n):
        """tallow: fn(0), ..., fn(n - 1) captured once as a CUDA graph (warmed up outside the capture)."""
        fn(0)
        tc.synchronize()
        g = tc.CUDAGraph()
        with tc.graph(g):
            for i in range(n):
                fn(i)
        return g

    def th_graph(fn, n):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn(0)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(n):
                fn(i)
        torch.cuda.synchronize()
        return g

    def time_graphs(graphs, n, reps=7):
        """Median ms per call of each graph (n calls each), repetitions interleaved across the graphs.
        Both libraries replay on the legacy default stream, which the events bracket."""
        for g in graphs:
            g.replay()
        torch.cuda.synchronize()
        tc.synchronize()
        times = [[] for _ in graphs]
        for _ in range(reps):
            for k, g in enumerate(graphs):
                s, e = tc.Event(enable_timing=True), tc.Event(enable_timing=True)
                s.record()
                g.replay()
                e.record()
                e.synchronize()
                times[k].append(s.elapsed_time(e) / n)
        return [statistics.median(t) for t in times]

    layers = [("Llama-3-8B", "qkv_proj", 6144, 4096), ("Llama-3-8B", "o_proj", 4096, 4096),
              ("Llama-3-8B", "gate_up_proj", 28672, 4096), ("Llama-3-8B", "down_proj", 4096, 14336),
              ("Llama-3-8B", "lm_head", 128256, 4096),
              ("Qwen3-0.6B", "qkv_proj", 4096, 1024), ("Qwen3-0.6B", "o_proj", 1024, 2048),
              ("Qwen3-0.6B", "gate_up_proj", 6144, 1024), ("Qwen3-0.6B", "down_proj", 1024, 3072),
              ("Qwen3-0.6B", "lm_head", 151936, 1024)]
    decode_Ms, prefill_Ms = [1, 2, 4, 8, 16, 32, 64], [512, 4096]
    has_cfg = hasattr(tc._c, "gemv_config")
    sweep = os.environ.get("TALLOW_BENCH_GEMV_SWEEP") == "1"
    if sweep and not hasattr(tc._c, "set_gemv_config"):
        print("bench_cuda: TALLOW_BENCH_GEMV_SWEEP=1 needs tallow.cuda._c.set_gemv_config; no sweep")
        sweep = False
    # Launch configurations for the sweep: the heuristic (""), a (warps, split) grid, then one knob at a time.
    sweep_specs = [""] + [f"warps={w},split={s}" for w in (2, 4, 8, 16) for s in (1, 2, 4, 8)] + [
        "unroll=2", "unroll=8", "rt=2,unroll=2", "rt=2,unroll=4", "rt=1", "policy=1", "pdl=1", "policy=1,pdl=1",
        "target=8", "target=24", "target=32", "target=48"]
    results["gemv_sweep"] = []
    old_skinny = tc._c.skinny_max_m()
    # TALLOW_BENCH_ONLY=<model>[:<M>,<M>...] restricts the GEMM section (e.g. "Llama-3-8B:1" for a quick sweep).
    only = os.environ.get("TALLOW_BENCH_ONLY", "")
    if only:
        name_only, _, ms_only = only.partition(":")
        layers = [l for l in layers if l[0] == name_only]
        if ms_only:
            decode_Ms, prefill_Ms = [int(m) for m in ms_only.split(",")], []
    for model, name, N, K in layers:
        wbytes = N * K * 2
        copies = max(1, min(64, -(-3 * l2 // wbytes)))  # a pass over the copies overflows L2, as in decode
        ws_t = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        ws = [tl(w) for w in ws_t]
        n_calls = max(copies, 32)
        for M in decode_Ms + prefill_Ms:
            if M > 512 and (name == "lm_head" or model != "Llama-3-8B"):
                continue  # prefill computes logits for the last tokens only; the small model stops at 512
            x_t = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            x = tl(x_t)
            out_t = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            out = tl(out_t)
            flops = 2.0 * M * N * K
            row = {"model": model, "layer": name, "M": M, "N": N, "K": K}
            ref = torch.matmul(x_t, ws_t[0].T)
            tallow.ops.linear(x, ws[0], out=out)  # first call: plan (and, for large shapes, algorithm timing)
            row["rel_err_vs_torch"] = rel(out_t, ref)

            def lin(i):
                tallow.ops.linear(x, ws[i % copies], out=out)

            if M in decode_Ms:
                graphs = [tl_graph(lin, n_calls),
                          th_graph(lambda i: torch.matmul(x_t, ws_t[i % copies].T, out=out_t), n_calls)]
                labels = ["tallow", "torch"]
                if M <= 16:  # the same product forced through each path
                    for label, limit in (("skinny", 16), ("cublaslt", 0)):
                        tc._c.set_skinny_max_m(limit)
                        tallow.ops.linear(x, ws[0], out=out)
                        row[f"{label}_rel_err_vs_torch"] = rel(out_t, ref)
                        graphs.append(tl_graph(lin, n_calls))
                        labels.append(label)
                    tc._c.set_skinny_max_m(old_skinny)
                ms = dict(zip(labels, time_graphs(graphs, n_calls)))
                for g in graphs:
                    g.reset()
                row["timing"] = "cuda graph"
            else:
                ms_th, ms_tl = time_pair(lambda i: torch.matmul(x_t, ws_t[i % copies].T, out=out_t), lin, 5)
                ms = {"tallow": ms_tl, "torch": ms_th}
                row["timing"] = "stream"
            for label, t in ms.items():
                row[f"{label}_TFLOP/s"] = flops / t / 1e9
                row[f"{label}_weight_GB/s"] = wbytes / t / 1e6
            row["ratio"] = ms["torch"] / ms["tallow"]
            row["weight_pct_of_copy_peak"] = 100 * row["tallow_weight_GB/s"] / peak
            if has_cfg and M <= 16:
                row["gemv_config"] = tc._c.gemv_config(M, N, K)
            results["gemm"].append(row)
            del ref

            if sweep and M in (1, 8, 16):
                tc._c.set_skinny_max_m(16)
                timed = {}
                try:
                    for spec in sweep_specs:
                        tc._c.set_gemv_config(spec)
                        eff = tc._c.gemv_config(M, N, K)
                        if eff in timed:
                            continue
                        g = tl_graph(lin, n_calls)
                        (t,) = time_graphs([g], n_calls, reps=5)
                        g.reset()
                        timed[eff] = {"spec": spec, "config": eff, "weight_GB/s": wbytes / t / 1e6}
                finally:
                    tc._c.set_gemv_config("")
                    tc._c.set_skinny_max_m(old_skinny)
                runs = sorted(timed.values(), key=lambda r: -r["weight_GB/s"])
                heur = next(r for r in runs if r["spec"] == "")
                results["gemv_sweep"].append({"model": model, "layer": name, "M": M, "N": N, "K": K,
                                              "heuristic": heur, "best": runs[0], "runs": runs})
        del ws_t, ws

    # ---- memory-bound ops -----------------------------------------------------------------------
    T, H = 8192, 4096
    x_t = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w_t = torch.randn(H, device="cuda", dtype=torch.bfloat16)
    o_t = torch.empty_like(x_t)
    x, w, o = tl(x_t), tl(w_t), tl(o_t)
    ms = time_fn(lambda i: tallow.ops.rms_norm(x, w, eps=1e-6, out=o), 10)
    byt = 2 * x_t.numel() * 2 + H * 2
    ref = (x_t.float() * torch.rsqrt(x_t.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w_t.float())
    results["ops"].append({"op": "rms_norm [8192x4096] bf16", "GB/s": byt / ms / 1e6, "rel_err": rel(o_t, ref)})
    del ref

    Tq, Hq, Hk, D = 8192, 32, 8, 128
    q_t = torch.randn(Tq, Hq, D, device="cuda", dtype=torch.bfloat16)
    k_t = torch.randn(Tq, Hk, D, device="cuda", dtype=torch.bfloat16)
    pos_t = torch.arange(Tq, device="cuda", dtype=torch.int64)
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D))
    fr = torch.outer(torch.arange(Tq, device="cuda", dtype=torch.float32), inv)
    cache_t = torch.cat([fr.cos(), fr.sin()], dim=-1).contiguous()
    q, k, pos, cache = tl(q_t), tl(k_t), tl(pos_t), tl(cache_t)
    byt = 2 * (q_t.numel() + k_t.numel()) * 2 + cache_t.numel() * 4  # q, k read+written; cos/sin rows read once
    ms = time_fn(lambda i: tallow.ops.rotary_embedding(pos, q, k, cache, True), 10)
    results["ops"].append({"op": "rotary_embedding neox q[8192,32,128] k[8192,8,128] bf16 (checked)",
                           "GB/s": byt / ms / 1e6})
    tc.set_index_checks(False)  # the position check reads a flag back (a stream wait) on every call
    ms = time_fn(lambda i: tallow.ops.rotary_embedding(pos, q, k, cache, True), 10)
    results["ops"].append({"op": "rotary_embedding neox, index checks off", "GB/s": byt / ms / 1e6})
    ms = time_fn(lambda i: tallow.ops.rotary_embedding(pos, q, k, cache, False), 10)
    results["ops"].append({"op": "rotary_embedding interleaved, index checks off", "GB/s": byt / ms / 1e6})
    tc.set_index_checks(True)

    I = 14336
    g_t = torch.randn(T // 2, 2 * I, device="cuda", dtype=torch.bfloat16)
    go_t = torch.empty(T // 2, I, device="cuda", dtype=torch.bfloat16)
    g, go = tl(g_t), tl(go_t)
    ms = time_fn(lambda i: tallow.ops.silu_and_mul(g, out=go), 10)
    byt = g_t.numel() * 2 + go_t.numel() * 2
    a_, b_ = g_t.float().chunk(2, dim=-1)
    results["ops"].append({"op": "silu_and_mul [4096x28672] bf16", "GB/s": byt / ms / 1e6,
                           "rel_err": rel(go_t, torch.nn.functional.silu(a_) * b_)})
    for r in results["ops"]:
        r["ratio_to_copy"] = r["GB/s"] / peak

    # ---- report --------------------------------------------------------------------------------
    print(f"\n== tallow CUDA benchmarks on {dev_name} ==")
    print(f"copy peak (best contiguous D2D, read+write): {peak:.0f} GB/s")
    for r in results["copy"]:
        print(f"  {r['what']:<62} {r['GB/s']:8.0f} GB/s  {100 * r['ratio_to_peak']:5.1f}% of peak")
    print("GEMM bf16 (x[M,K] @ w[N,K]^T): TFLOP/s of tallow and torch; tallow's weight GB/s and % of the copy peak;")
    print("  M <= 64 timed as CUDA graphs; skinny/cuBLASLt: weight GB/s with tallow forced through gemv / cuBLASLt")
    print(f"  {'model':<11}{'layer':<13}{'M':>5}{'N':>8}{'K':>7}{'tallow':>8}{'torch':>8}{'ratio':>7}{'W GB/s':>8}"
          f"{'%peak':>7}{'skinny':>8}{'cuBLASLt':>9}{'err':>9}  gemv config")
    for r in results["gemm"]:
        sk = f"{r['skinny_weight_GB/s']:8.0f}" if "skinny_weight_GB/s" in r else " " * 8
        lt = f"{r['cublaslt_weight_GB/s']:9.0f}" if "cublaslt_weight_GB/s" in r else " " * 9
        print(f"  {r['model']:<11}{r['layer']:<13}{r['M']:>5}{r['N']:>8}{r['K']:>7}{r['tallow_TFLOP/s']:8.1f}"
              f"{r['torch_TFLOP/s']:8.1f}{100 * r['ratio']:6.0f}%{r['tallow_weight_GB/s']:8.0f}"
              f"{r['weight_pct_of_copy_peak']:6.1f}%{sk}{lt}{r['rel_err_vs_torch']:9.1e}  {r.get('gemv_config', '')}")
    if results["gemv_sweep"]:
        print("gemv launch sweep (weight GB/s, % of copy peak): heuristic vs best")
        for r in results["gemv_sweep"]:
            h, b = r["heuristic"], r["best"]
            print(f"  {r['model']:<11}{r['layer']:<13}{r['M']:>3} heuristic {h['weight_GB/s']:6.0f} "
                  f"{100 * h['weight_GB/s'] / peak:5.1f}% [{h['config']}]  best {b['weight_GB/s']:6.0f} "
                  f"{100 * b['weight_GB/s'] / peak:5.1f}% [{b['config']}]")
    print("memory-bound ops:")
    for r in results["ops"]:
        print(f"  {r['op']:<62} {r['GB/s']:8.0f} GB/s  {100 * r['ratio_to_copy']:5.1f}% of copy peak")
    out = os.environ.get("TALLOW_BENCH_JSON")
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
