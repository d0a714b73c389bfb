"""Offline generation in-process (LLM.generate: LLMEngine's step loop in the caller's process) against
the same workload through the engine-core process (EngineCoreClient, as `tallow serve` runs it, without
HTTP): which path is faster, and do they give the same tokens (greedy, ignore_eos)?

    python benchmarks/offline_paths.py --w qwen3-0.6b-shape/ --load-format dummy --d 0 --num-prompts 512
    python benchmarks/offline_paths.py                          # the demo model on the CPU, a small workload
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import serve_clients as SC  # noqa: E402


def engine_args(args):
    from tallow.engine.arg_parser import add_engine_args, engine_args_from

    p = argparse.ArgumentParser()
    add_engine_args(p)
    return engine_args_from(p.parse_args(SC.model_flags(args) + SC.engine_flags(args, max_num_seqs=args.max_num_seqs)))


def run_in_process(args, prompts, q) -> None:
    from tallow import LLM, SamplingParams

    llm = LLM.from_engine_args(engine_args(args))
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:8]], sp)  # warm-up
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    dt = time.perf_counter() - t
    q.put({"wall_s": dt, "tokens": [o.outputs[0].token_ids for o in outs]})


async def _through_core(args, prompts) -> dict:
    from tallow import SamplingParams
    from tallow.engine.core_client import EngineCoreClient

    client = await EngineCoreClient.launch(engine_args(args))
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)

    async def one(i, p):
        ids = []
        async for out in await client.add_request({"prompt_token_ids": p}, sp, f"r{i}"):
            ids += out.outputs[0].token_ids
        return ids

    try:
        await asyncio.gather(*(one(f"w{i}", p) for i, p in enumerate(prompts[:8])))  # warm-up
        t = time.perf_counter()
        tokens = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return {"wall_s": time.perf_counter() - t, "tokens": tokens}
    finally:
        await client.shutdown()


def run_through_core(args, prompts, q) -> None:
    q.put(asyncio.run(_through_core(args, prompts)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    SC.add_model_args(p)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=64)
    SC.add_workload_args(p, (16, 128), 64)
    args = p.parse_args(argv)
    SC.check_workload_args(p, args)
    prompts = SC.random_prompts(args, args.num_prompts)
    n_out = args.num_prompts * args.output_len
    ctx = multiprocessing.get_context("spawn")
    res = {}
    for name, fn in (("in_process", run_in_process), ("engine_core_process", run_through_core)):
        q = ctx.Queue()
        proc = ctx.Process(target=fn, args=(args, prompts, q))  # one at a time: each owns the device alone
        proc.start()
        r = q.get()
        proc.join()
        res[name] = r
        print(f"{name:>20}: {r['wall_s']:.2f} s, {n_out / r['wall_s']:,.0f} output tok/s", flush=True)
    same = res["in_process"]["tokens"] == res["engine_core_process"]["tokens"]
    ratio = res["in_process"]["wall_s"] / res["engine_core_process"]["wall_s"]
    print(f"same tokens: {same}; engine-core process speed / in-process speed: {ratio:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join([sys.executable] + sys.argv), "same_tokens": same,
                       "speed_ratio_process_over_in_process": ratio,
                       **{k: {"wall_s": v["wall_s"], "output_tok_s": n_out / v["wall_s"]} for k, v in res.items()}},
                      f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    sys.exit(main())
