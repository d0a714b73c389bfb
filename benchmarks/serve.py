"""Serving benchmark: N concurrent streaming clients against `tallow serve`, and the server's
overhead against the offline engine on the same workload.

The workload: --num-prompts prompts of random token ids (lengths uniform in [--input-len-min,
--input-len-max], fixed --seed), each asking for --output-len tokens with ignore_eos, so both runs
do exactly the same model work. The offline run pushes them all through LLM.generate with
max_num_seqs = --clients; the server run starts `python -m tallow.server` in a subprocess (the HTTP
stack and the engine thread share that process, as in production) and --clients streaming clients
in this process (aiohttp, /v1/completions with token-id prompts) each send their next prompt as soon
as the previous one finishes. Reported: output tokens/s of both runs, the overhead
(1 - server / offline throughput), time to first token and inter-token latency p50/p99 (as the
clients see them), and an estimate of what a separate engine process would add instead of the
thread: one pickle round trip through a pipe per step for that step's delta outputs.

    python benchmarks/serve.py                                   # demo model, 8 clients
    python benchmarks/serve.py --f model.gguf --clients 32 --num-prompts 128 --out result.json

Figures (CPU, demo model SmolLM2-135M-Instruct Q4_1) are in the docstring of
tallow/engine/async_engine.py together with the machine they ran on.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pickle
import platform
import random
import re
import signal
import subprocess
import sys
import threading
import time


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def make_workload(args) -> list[list[int]]:
    rng = random.Random(args.seed)
    return [[rng.randint(0, args.max_token_id) for _ in range(rng.randint(args.input_len_min, args.input_len_max))]
            for _ in range(args.num_prompts)]


def model_flags(args) -> list[str]:
    if args.f:
        return ["--f", args.f]
    if args.w:
        return ["--w", args.w]
    if args.m:
        return ["--m", args.m]
    from tallow.server.demo_model import demo_model_path

    return ["--f", demo_model_path()]


def engine_flags(args) -> list[str]:
    out = ["--max-num-seqs", str(args.clients), "--max-model-len", str(args.max_model_len)]
    if args.num_threads:
        out += ["--num-threads", str(args.num_threads)]
    if args.d is not None:
        out += ["--d", args.d]
    if args.load_format:
        out += ["--load-format", args.load_format]
    if args.mem:
        out += ["--mem", str(args.mem)]
    return out


def run_offline(args, prompts) -> dict:
    from tallow import LLM, SamplingParams
    from tallow.engine.arg_parser import add_engine_args, engine_args_from

    p = argparse.ArgumentParser()
    add_engine_args(p)
    ns = p.parse_args(model_flags(args) + engine_flags(args))
    llm = LLM.from_engine_args(engine_args_from(ns))
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    steps0 = llm.engine.stats["steps"]
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": q} for q in prompts], params)
    wall = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = llm.engine.stats["steps"] - steps0
    return {"wall_s": wall, "output_tokens": n_out, "output_tok_s": n_out / wall, "steps": steps,
            "step_ms": 1e3 * wall / max(steps, 1), "sample_outputs": outs[:4]}


def start_server(args) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    cmd = [sys.executable, "-m", "tallow.server", *model_flags(args), *engine_flags(args), "--p", "0",
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines = []
    while True:
        line = proc.stderr.readline()
        if not line:
            raise SystemExit("the server did not start:\n" + "".join(lines))
        lines.append(line)
        m = re.search(r"at (http://[\w.]+:\d+)/v1", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, m.group(1)


async def run_clients(args, url: str, prompts) -> dict:
    import aiohttp

    queue = list(range(len(prompts)))
    ttft, itl, n_out = [], [], [0]

    async def one(session, i):
        body = {"prompt": prompts[i], "max_tokens": args.output_len, "temperature": 0, "ignore_eos": True,
                "stream": True}
        t0 = time.perf_counter()
        last = None
        async with session.post(url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if not chunk["choices"]:
                    continue
                n_out[0] += 1  # one token per chunk (n = 1, one token per step)
                if last is None:
                    ttft.append(now - t0)
                else:
                    itl.append(now - last)
                last = now

    async def client(session):
        while queue:
            await one(session, queue.pop(0))

    conn = aiohttp.TCPConnector(limit=args.clients)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
        await one(session, 0)  # warm-up
        queue[:] = list(range(len(prompts)))
        ttft.clear(), itl.clear()
        n_out[0] = 0
        t = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(args.clients)))
        wall = time.perf_counter() - t
    return {"wall_s": wall, "output_tokens": n_out[0], "output_tok_s": n_out[0] / wall,
            "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
            "itl_p50_ms": 1e3 * percentile(itl, 50), "itl_p99_ms": 1e3 * percentile(itl, 99)}


def ipc_estimate(sample_outputs, batch: int, repeats: int = 200) -> float:
    """Milliseconds for one step's delta outputs (batch of them) to cross a pipe and back, as a
    separate engine process would need per step."""
    import multiprocessing as mp

    from tallow.engine.outputs import CompletionOutput, RequestOutput

    base = sample_outputs[0]
    delta = RequestOutput(base.request_id, None, base.prompt_token_ids,
                          [CompletionOutput(0, " word", [1234], None, None, None)], False, 0, delta=True)
    payload = [delta] * batch
    a, b = mp.Pipe()
    t = time.perf_counter()
    for _ in range(repeats):
        a.send_bytes(pickle.dumps(payload))
        pickle.loads(b.recv_bytes())
        b.send_bytes(b"ack")
        a.recv_bytes()
    return 1e3 * (time.perf_counter() - t) / repeats


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m"), p.add_argument("--w"), p.add_argument("--f")
    p.add_argument("--d", help="GPU id (default: CPU)")
    p.add_argument("--load-format", help="dummy: random weights (the --w folder needs only config.json)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len-min", type=int, default=16)
    p.add_argument("--input-len-max", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-token-id", type=int, default=10000)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--num-threads", type=int)
    p.add_argument("--mem", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--out", help="write the result as JSON here")
    args = p.parse_args(argv)
    prompts = make_workload(args)

    result = {"device": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
              "model": model_flags(args)[-1], "clients": args.clients, "num_prompts": args.num_prompts,
              "input_len": [args.input_len_min, args.input_len_max], "output_len": args.output_len}
    if not args.skip_offline:
        off = run_offline(args, prompts)
        result["offline"] = {k: v for k, v in off.items() if k != "sample_outputs"}
        result["ipc_round_trip_ms_per_step"] = ipc_estimate(off["sample_outputs"], args.clients)
        print(f"offline: {off['output_tok_s']:.1f} output tok/s ({off['wall_s']:.2f} s, {off['steps']} steps, "
              f"{off['step_ms']:.2f} ms/step)", file=sys.stderr)
    proc, url = start_server(args)
    try:
        srv = asyncio.run(run_clients(args, url, prompts))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    result["server"] = srv
    print(f"server:  {srv['output_tok_s']:.1f} output tok/s ({srv['wall_s']:.2f} s), TTFT p50/p99 "
          f"{srv['ttft_p50_ms']:.1f}/{srv['ttft_p99_ms']:.1f} ms, ITL p50/p99 {srv['itl_p50_ms']:.1f}/"
          f"{srv['itl_p99_ms']:.1f} ms", file=sys.stderr)
    if "offline" in result:
        result["server_overhead"] = 1 - srv["output_tok_s"] / result["offline"]["output_tok_s"]
        print(f"server overhead vs offline: {100 * result['server_overhead']:.1f}% of output throughput; a separate "
              f"engine process would add ~{result['ipc_round_trip_ms_per_step']:.3f} ms of pipe round trip per step "
              f"({result['offline']['step_ms']:.2f} ms/step offline)", file=sys.stderr)
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
