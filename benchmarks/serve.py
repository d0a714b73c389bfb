"""Serving benchmark: `tallow serve` under N concurrent streaming clients against the offline engine
on the same workload, reported in the shape of `vllm bench serve`.

The workload: --num-prompts prompts of random token ids (lengths uniform in [--input-len-min,
--input-len-max], fixed --seed), each asking for --output-len tokens with ignore_eos, so both runs do
exactly the same model work. The offline run pushes them all through LLM.generate with max_num_seqs =
--clients, in a spawned process (its memory, GPU memory included, is gone before the server starts).
The server run starts `python -m tallow.server` in a subprocess (waited for on /health) and
--clients streaming clients (/v1/completions with token-id prompts, usage in the last chunk) spread
over --client-procs spawned processes, each an aiohttp event loop; every client sends the next prompt
of a shared queue as soon as its previous one finishes. Each client process's CPU time over its wall
time is reported, so the reader sees the clients were not the bottleneck.

Reported: request and token throughputs, TTFT, TPOT (per request, excluding the first token) and ITL
(between stream chunks) mean / median / p90 / p99 as `vllm bench serve` prints them; beside them the
offline output tok/s, its step time at that batch (wall / steps and the engine's model time / steps),
and the overhead 1 - server / offline output throughput.

    python benchmarks/serve.py                                   # demo model, 16 clients
    python benchmarks/serve.py --w qwen3-0.6b/ --load-format dummy --d 0 --clients 256 --num-prompts 1024 \\
        --input-len-min 100 --input-len-max 1024 --output-len 256 --out result.json
    python benchmarks/serve.py ... --server-args "--api-server-count 2"   # flags for the server only
    python benchmarks/serve.py ... --engine-args "--prefill-chunk-size 512"  # for both runs
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import serve_clients as SC  # noqa: E402


def run_offline(flags: list[str], prompts: list[list[int]], output_len: int) -> dict:
    """LLM.generate over the whole workload (in a spawned process: see the module docstring)."""
    import time

    from tallow import LLM, SamplingParams
    from tallow.engine.arg_parser import add_engine_args, engine_args_from

    p = argparse.ArgumentParser()
    add_engine_args(p)
    llm = LLM.from_engine_args(engine_args_from(p.parse_args(flags)))
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    eng = llm.engine
    st0 = dict(eng.stats)
    # The time between successive steps (each call launches one): the offline side of the ITL
    # comparison, prefill-heavy steps included.
    marks: list[float] = []
    step = eng.step

    def timed_step():
        marks.append(time.perf_counter())
        return step()

    eng.step = timed_step
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": q} for q in prompts],
                        SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    wall = time.perf_counter() - t
    eng.step = step
    gaps = [b - a for a, b in zip(marks, marks[1:])]
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = eng.stats["steps"] - st0["steps"]
    model_s = eng.stats["model_s"] - st0["model_s"]
    return {"duration_s": wall, "output_tokens": n_out, "input_tokens": sum(map(len, prompts)),
            "output_throughput": n_out / wall, "steps": steps, "step_ms": 1e3 * wall / max(steps, 1),
            "model_ms_per_step": 1e3 * model_s / max(steps, 1), "mean_batch": n_out / max(steps, 1),
            "step_gap_ms": SC.percentiles(gaps, 1e3)}


def offline_in_child(flags, prompts, output_len) -> dict:
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=SC.SPAWN) as ex:
        return ex.submit(run_offline, flags, prompts, output_len).result()


def serve_metrics(merged: SC.ClientResult, duration: float, num_prompts: int) -> dict:
    m = {"completed": merged.completed, "failed": num_prompts - merged.completed, "duration_s": duration,
         "total_input_tokens": merged.input_tokens, "total_output_tokens": merged.output_tokens,
         "request_throughput": merged.completed / duration,
         "output_throughput": merged.output_tokens / duration,
         "total_token_throughput": (merged.input_tokens + merged.output_tokens) / duration,
         "status": {str(k): v for k, v in merged.status.items()}, "conn_errors": merged.conn_errors,
         "stream_errors": merged.stream_errors, "errors": merged.errors}
    for name, xs in (("ttft", merged.ttft), ("tpot", merged.tpot), ("itl", merged.itl), ("e2el", merged.latency)):
        for stat, v in SC.percentiles(xs, 1e3).items():
            m[f"{stat}_{name}_ms"] = v
    return m


def print_report(res: dict) -> None:
    s, off = res["server"], res.get("offline")

    def row(label, value, fmt="{:<10}"):
        print(("{:<40} " + fmt).format(label, value))

    def head(title, c="-"):
        print("{s:{c}^{n}}".format(s=title, n=50, c=c))

    head(" Serving Benchmark Result ", "=")
    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    row("Maximum request concurrency:", res["clients"])
    row("Benchmark duration (s):", s["duration_s"], "{:<10.2f}")
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", s["request_throughput"], "{:<10.2f}")
    row("Output token throughput (tok/s):", s["output_throughput"], "{:<10.2f}")
    row("Total Token throughput (tok/s):", s["total_token_throughput"], "{:<10.2f}")
    for key, title, label in (("ttft", "Time to First Token", "TTFT"),
                              ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
                              ("itl", "Inter-token Latency", "ITL")):
        head(title)
        for stat, name in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            row(f"{name} {label} (ms):", s[f"{stat}_{key}_ms"], "{:<10.2f}")
    if off:
        head("Offline engine, same workload")
        row("Output token throughput (tok/s):", off["output_throughput"], "{:<10.2f}")
        row("Benchmark duration (s):", off["duration_s"], "{:<10.2f}")
        row("Steps:", off["steps"])
        row("Output tokens per step:", off["mean_batch"], "{:<10.1f}")
        row("Step time (ms, wall / steps):", off["step_ms"], "{:<10.2f}")
        row("Model time per step (ms):", off["model_ms_per_step"], "{:<10.2f}")
        for stat, name in (("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            row(f"{name} step gap (ms):", off["step_gap_ms"][stat], "{:<10.2f}")
        row("Server overhead (1 - server/offline):", f"{100 * res['server_overhead']:.1f}%")
    head("Client processes (CPU s / wall s)")
    for c in res["client_procs"]:
        row(f"pid {c['pid']}:", f"{c['cpu_util']:.2f} ({c['cpu_s']:.1f} / {c['wall_s']:.1f})")
    head("", "=")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    SC.add_model_args(p)
    p.add_argument("--clients", type=int, default=16, help="concurrent streams (and the engines' --max-num-seqs)")
    p.add_argument("--client-procs", type=int, default=SC.default_client_procs(),
                   help="processes the clients are spread over (default min(4, cores / 2))")
    p.add_argument("--num-prompts", type=int, default=64)
    SC.add_workload_args(p, (16, 128), 64)
    p.add_argument("--skip-offline", action="store_true")
    args = p.parse_args(argv)
    SC.check_workload_args(p, args)
    prompts = SC.random_prompts(args, args.num_prompts)
    flags = SC.model_flags(args) + SC.engine_flags(args, max_num_seqs=args.clients)

    result = dict(SC.provenance(args.d), model=SC.model_flags(args)[-1], clients=args.clients,
                  client_procs_requested=args.client_procs, num_prompts=args.num_prompts,
                  input_len=[args.input_len_min, args.input_len_max], output_len=args.output_len, seed=args.seed,
                  engine_flags=flags, server_args=args.server_args)
    if not args.skip_offline:
        result["offline"] = offline_in_child(flags, prompts, args.output_len)
        print(f"offline: {result['offline']['output_throughput']:.1f} output tok/s", file=sys.stderr)

    SC.raise_fd_limit()
    server = SC.ServerProcess(flags + shlex.split(args.server_args) + ["--log-level", "warning"])
    try:
        code, body = server.post_json("/v1/completions", {"prompt": prompts[0], "max_tokens": 4,
                                                          "ignore_eos": True, "temperature": 0})
        if code != 200:
            raise SystemExit(f"the warm-up request failed: HTTP {code} {body}")
        spec = SC.ClientSpec(url=server.url, prompts=prompts, workers=0, output_len=args.output_len,
                             max_jobs=args.num_prompts, seed=args.seed)
        results, duration = SC.run_clients(spec, args.clients, args.client_procs)
    finally:
        result["server_exit_code"] = server.stop()
    merged = SC.merge(results)
    result["server"] = serve_metrics(merged, duration, args.num_prompts)
    result["client_procs"] = SC.client_cpu_report(results)
    if "offline" in result:
        result["server_overhead"] = 1 - result["server"]["output_throughput"] / result["offline"]["output_throughput"]
    print_report(result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if merged.completed == args.num_prompts else 1


if __name__ == "__main__":
    sys.exit(main())
