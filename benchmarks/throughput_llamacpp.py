"""The nano-vllm throughput workload of benchmarks/throughput.py, run through llama-cpp-python.

    python benchmarks/throughput_llamacpp.py [same flags as throughput.py]
    python benchmarks/throughput.py --llamacpp [flags]      # the same thing

llama-cpp-python's Python API decodes one sequence at a time (no batching across requests), so the
requests run one after another: reset, evaluate the prompt (in n_batch chunks), then sample and
evaluate one token at a time until the request's output length (EOS ignored). The time split it
reports is prompt evaluation / decode (eval + sampling of generated tokens). Sampling matches the
tallow run: temperature only (top_k, top_p, min_p off), greedy at temperature 0.
"""
from __future__ import annotations

import importlib.metadata
import os
import sys
import time


def run_llamacpp(args, prompts: list[list[int]], out_lens: list[int]) -> dict:
    from llama_cpp import Llama

    threads = args.threads or os.cpu_count()
    n_ctx = args.n_ctx or -(-(max(map(len, prompts)) + max(out_lens) + 1) // 256) * 256
    t = time.perf_counter()
    llm = Llama(model_path=args.model, n_ctx=n_ctx, n_batch=args.n_batch, n_threads=threads,
                n_threads_batch=threads, seed=args.seed, logits_all=False, verbose=False)
    load_s = time.perf_counter() - t

    def one(prompt: list[int], n_out: int) -> tuple[float, float]:
        llm.reset()  # forget the previous request (no prefix reuse between requests)
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1 = time.perf_counter()
        for i in range(n_out):
            if args.temperature == 0:
                tok = llm.sample(temp=0.0)
            else:
                tok = llm.sample(temp=args.temperature, top_k=0, top_p=1.0, min_p=0.0)
            if i + 1 < n_out:
                llm.eval([tok])
        return t1 - t0, time.perf_counter() - t1

    one([(t + 1) % 1000 for t in prompts[0][:16]], 4)  # warm-up, not timed
    prefill = decode = 0.0
    t = time.perf_counter()
    for p, n in zip(prompts, out_lens):
        a, b = one(p, n)
        prefill += a
        decode += b
    elapsed = time.perf_counter() - t
    import llama_cpp

    return dict(engine="llama.cpp (llama-cpp-python, sequential)",
                llama_cpp_python=importlib.metadata.version("llama-cpp-python"),
                llama_cpp_system_info=llama_cpp.llama_print_system_info().decode().strip(),
                threads=threads, n_ctx=n_ctx, n_batch=args.n_batch, load_s=round(load_s, 3), elapsed_s=elapsed,
                time_split_s={"prompt_eval_s": prefill, "decode_s": decode})


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import throughput

    sys.exit(throughput.main(sys.argv[1:] + ["--llamacpp"]))
