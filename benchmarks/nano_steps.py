"""The nano-vllm workload (benchmarks/gpu_e2e.py --target nanovllm: Qwen3-0.6B shape, random weights,
256 sequences, input and output lengths uniform in 100-1024, seed 0, ignore_eos) through the engine
one step at a time, reporting wall time per step: mixed steps (with prompt tokens) against decode-only
steps, and decode-only steps by batch size (buckets of 32 sequences), each bucket with the time its
bytes take at the copy bandwidth (the weights once a step, the KV of every context its rows attend)
and that time's ratio to the measured one. For A/B runs of engine and kernel switches (environment
variables) in one session, where gpu_e2e.py's whole-run figure hides where a change acts.

    python benchmarks/nano_steps.py [--no-detokenize] [--max-num-batched-tokens N] [--gaps] [--profile [N]]
    python benchmarks/nano_steps.py --bytes-only 3000   # no GPU: the buckets' bytes at 3,000 GB/s

A step's wall time is from the previous step's return to this one's: with overlapped scheduling that
is the GPU time of about one step plus whatever the host adds.

--gaps records CUDA events around every step's GPU work and the host's phases (schedule, launch, the
wait for the previous step's tokens, applying them): the GPU's idle time between steps (the host
was late) by step kind, the steps with the largest gaps, and the host's time per phase.

--profile records every kernel of the run through torch.profiler (CUPTI; needs torch, which only this
measurement uses) and lists the kernels with the most GPU time (profiling slows the run a little)."""
import argparse
import collections
import gc
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_e2e  # noqa: E402

from tallow import LLM, SamplingParams  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-detokenize", action="store_true", help="skip detokenizing the outputs")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--gaps", action="store_true", help="report the GPU's idle time between steps and the host's phases")
    ap.add_argument("--profile", type=int, nargs="?", const=45, default=None, metavar="N",
                    help="record every kernel of the run (torch.profiler's CUPTI tracing; torch only for this) and "
                         "print the N kernels with the most GPU time (default 45)")
    ap.add_argument("--bytes-only", type=float, default=None, metavar="GB_S",
                    help="run nothing: the decode buckets' bytes at this copy bandwidth, for the workload's decode "
                         "steps counted on the host (every request decoding from the start; no GPU needed)")
    args = ap.parse_args()
    # Bytes a decode step reads (weights once, KV of every context), against the copy bandwidth.
    w_bytes = gpu_e2e.decode_weight_bytes(gpu_e2e.QWEN3_06B)
    kv_bytes = gpu_e2e.kv_bytes_per_token(gpu_e2e.QWEN3_06B, "auto")
    if args.bytes_only is not None:
        return bucket_bytes(w_bytes, kv_bytes, args.bytes_only * 1e9)
    bw = gpu_e2e.copy_bandwidth(args.device)
    print("copy bandwidth %.0f GB/s; a decode step reads %.2f GB of weights and %d bytes of KV a context token"
          % (bw / 1e9, w_bytes / 1e9, kv_bytes))
    gpu_e2e.release_device_memory()
    root = tempfile.mkdtemp()
    path = gpu_e2e.write_model_dir(root, "qwen3_0.6b", gpu_e2e.QWEN3_06B, True)
    kw = {} if args.max_num_batched_tokens is None else {"max_num_batched_tokens": args.max_num_batched_tokens}
    llm = LLM(model=path, device=args.device, dtype="bfloat16", load_format="dummy", max_model_len=4096,
              max_num_seqs=256, **kw)
    token_lists, out_lens, rng = gpu_e2e.nanovllm_workload()
    prompts = [{"prompt_token_ids": t} for t in token_lists]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0, detokenize=not args.no_detokenize)
              for n in out_lens]
    warm = [{"prompt_token_ids": rng.integers(0, 10001, 64).tolist()} for _ in range(4)]
    llm.generate(warm, SamplingParams(max_tokens=16, ignore_eos=True))

    eng = llm.engine
    kinds = []  # per step: (prompt tokens, decode sequences, keys the decode rows attend)
    schedule = eng.scheduler.schedule

    def recording_schedule():
        out = schedule()
        n = [out.num_scheduled_tokens[r.request_id] for r in out.requests]
        keys = sum(r.num_computed_tokens + 1 for r, x in zip(out.requests, n) if x == 1)
        kinds.append((sum(x for x in n if x > 1), sum(1 for x in n if x == 1), keys))
        return out

    eng.scheduler.schedule = recording_schedule
    timeline = StepTimeline(eng) if args.gaps else None
    for p, sp in zip(prompts, params):
        eng.add_request(p, sp)
    times = []
    prof = kernel_profiler() if args.profile else None
    t0 = last = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
        now = time.perf_counter()
        times.append(now - last)
        last = now
    if prof is not None:
        prof.__exit__(None, None, None)
    eng.scheduler.schedule = schedule
    wall = last - t0
    if timeline is not None:
        timeline.restore()
    print("wall %.3f s, %d steps, %.0f output tok/s (detokenize=%s)"
          % (wall, len(times), sum(out_lens) / wall, not args.no_detokenize))
    by_kind = collections.defaultdict(lambda: [0, 0.0])
    by_batch = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for (prompt_tokens, decodes, keys), t in zip(kinds, times):
        by_kind["mixed" if prompt_tokens else "decode"][0] += 1
        by_kind["mixed" if prompt_tokens else "decode"][1] += t
        if not prompt_tokens and decodes:
            b = by_batch[(decodes + 31) // 32 * 32]
            b[0] += 1
            b[1] += t
            b[2] += (w_bytes + keys * kv_bytes) / bw
    for k, (n, t) in by_kind.items():
        print("  %-6s %5d steps %.3f s (%.2f ms/step)" % (k, n, t, t / n * 1e3))
    for k in sorted(by_batch):
        n, t, floor = by_batch[k]
        print("  decode batch <=%3d: %4d steps %.2f ms/step (its bytes at the copy bandwidth: %.2f ms, %.2f)"
              % (k, n, t / n * 1e3, floor / n * 1e3, floor / t))
    if timeline is not None:
        timeline.report(kinds, times)
    if prof is not None:
        report_kernels(prof, args.profile)
    return 0


def kernel_profiler():
    """A started torch.profiler recording CUDA kernels (CUPTI sees tallow's kernels, graph replays
    included). torch is used for this measurement only; tallow does not import it."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CUDA])
    prof.__enter__()
    return prof


def report_kernels(prof, top: int) -> None:
    """Kernels by total GPU time: calls, total ms, mean us, share of all kernel time."""
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = getattr(e, "cuda_time_total", 0.0)
        if t > 0 and e.count:
            rows.append((t, e.count, e.key))
    total = sum(r[0] for r in rows)
    print("kernels: %.3f s of GPU time in %d kernels (%d distinct)" % (total / 1e6, sum(r[1] for r in rows), len(rows)))
    print("  %9s %8s %9s %6s  kernel" % ("total ms", "calls", "mean us", "share"))
    for t, n, name in sorted(rows, reverse=True)[:top]:
        print("  %9.1f %8d %9.2f %5.1f%%  %s" % (t / 1e3, n, t / n, 100 * t / total, name[:110]))


def bucket_bytes(w_bytes: int, kv_bytes: int, bw: float) -> int:
    """The decode-only buckets' time at the copy bandwidth, counting steps on the host: decode step s
    runs every request with more than s output tokens over its prompt + s keys."""
    token_lists, out_lens, _ = gpu_e2e.nanovllm_workload()
    prompt_lens = [len(t) for t in token_lists]
    by_batch = collections.defaultdict(lambda: [0, 0.0])
    for s in range(1, max(out_lens)):
        live = [p + s for p, n in zip(prompt_lens, out_lens) if n > s]
        b = by_batch[(len(live) + 31) // 32 * 32]
        b[0] += 1
        b[1] += (w_bytes + sum(live) * kv_bytes) / bw
    print("copy bandwidth %.0f GB/s (given); decode steps counted on the host" % (bw / 1e9))
    for k in sorted(by_batch):
        n, t = by_batch[k]
        print("  decode batch <=%3d: %4d steps, bytes at the copy bandwidth %.2f ms/step" % (k, n, t / n * 1e3))
    return 0


class StepTimeline:
    """Wraps an engine's step phases: per step a (start, end) CUDA event pair around its GPU work and
    the host's seconds in schedule, launch (runner + sampler), the wait for the previous step's
    tokens, and applying them (outputs, detokenizing)."""

    def __init__(self, eng):
        from tallow import cuda

        self.eng, self.events, self.host = eng, [], []
        self.runner = eng.runner
        self._orig = {"_finish": eng._finish, "step": eng.step}
        self._orig_timing = self.runner._timing_events
        cur = {}
        self.collections = []  # (step, generation, seconds) of the garbage collector's runs
        gc_start = [0.0]

        def on_gc(phase, info):
            if phase == "start":
                gc_start[0] = time.perf_counter()
            else:
                self.collections.append((len(self.host), info["generation"], time.perf_counter() - gc_start[0]))

        self._on_gc = on_gc
        gc.callbacks.append(on_gc)

        def timing_events():
            ev = (cuda.Event(True), cuda.Event(True))
            ev[0].record()
            self.events.append(ev)
            return ev

        def finish(pending):
            t0 = time.perf_counter()
            ev = getattr(getattr(pending.launched, "sample", None), "_event", None)
            if ev is not None:
                ev.synchronize()
            t1 = time.perf_counter()
            res = self._orig["_finish"](pending)
            cur["wait"], cur["apply"] = t1 - t0, time.perf_counter() - t1
            return res

        def step():
            cur.clear()
            s0 = dict(eng.stats)
            t0 = time.perf_counter()
            res = self._orig["step"]()
            total = time.perf_counter() - t0
            self.host.append({"schedule": eng.stats["schedule_s"] - s0["schedule_s"],
                              "launch": eng.stats["model_s"] - s0["model_s"],
                              "wait": cur.get("wait", 0.0), "apply": cur.get("apply", 0.0), "total": total,
                              "outputs": len(res)})
            return res

        eng._finish, eng.step = finish, step
        self.runner._timing_events = timing_events  # the worker's runner times each step's device work

    def restore(self):
        for k, v in self._orig.items():
            setattr(self.eng, k, v)
        self.runner._timing_events = self._orig_timing
        gc.callbacks.remove(self._on_gc)

    def report(self, kinds, times):
        for ev in self.events:
            ev[1].synchronize()
        gpu = [a.elapsed_time(b) for a, b in self.events]
        gaps = [0.0] + [self.events[i - 1][1].elapsed_time(self.events[i][0]) for i in range(1, len(self.events))]
        span = self.events[0][0].elapsed_time(self.events[-1][1]) if self.events else 0.0
        print("GPU: %d steps, %.3f s from the first step's start to the last one's end: %.3f s of steps, "
              "%.3f s idle between them" % (len(gpu), span / 1e3, sum(gpu) / 1e3, sum(gaps) / 1e3))
        by = collections.defaultdict(lambda: [0, 0.0, 0.0])
        for (prompt_tokens, decodes, _), g, idle in zip(kinds, gpu, gaps):
            key = "mixed" if prompt_tokens else "decode<=%d" % ((decodes + 31) // 32 * 32)
            by[key][0] += 1
            by[key][1] += g
            by[key][2] += idle
        for k in sorted(by, key=lambda k: (k != "mixed", len(k), k)):
            n, g, idle = by[k]
            print("  %-11s %5d steps  GPU %.2f ms/step  idle before %.3f ms/step" % (k, n, g / n, idle / n))
        print("largest gaps (ms): " + ", ".join(
            "step %d %s %.2f" % (i, "mixed" if kinds[i][0] else "b%d" % kinds[i][1], gaps[i])
            for i in sorted(range(len(gaps)), key=lambda i: -gaps[i])[:12]))
        host = {k: sum(h[k] for h in self.host) for k in ("schedule", "launch", "wait", "apply", "total")}
        print("host: " + ", ".join("%s %.3f s" % kv for kv in host.items())
              + "; outside step(): %.3f s" % (sum(times) - host["total"]))
        by_gen = collections.defaultdict(lambda: [0, 0.0])
        for _, gen, sec in self.collections:
            by_gen[gen][0] += 1
            by_gen[gen][1] += sec
        print("garbage collections: " + ", ".join("generation %d: %d, %.1f ms" % (g, n, s * 1e3)
                                                  for g, (n, s) in sorted(by_gen.items()))
              + "; longest: " + ", ".join("step %d gen %d %.1f ms" % (i, g, s * 1e3) for i, g, s in
                                        sorted(self.collections, key=lambda c: -c[2])[:4]))
        late = [i for i, h in enumerate(self.host) if h["total"] - h["wait"] > gpu[min(i, len(gpu) - 1)] / 1e3]
        print("steps whose host work (all but the wait) took longer than a step's GPU time: %d" % len(late))


if __name__ == "__main__":
    sys.exit(main())
