"""The nano-vllm throughput workload of benchmarks/throughput.py, run through llama-cpp-python.

    python benchmarks/throughput_llamacpp.py [same flags as throughput.py]
    python benchmarks/throughput.py --llamacpp [flags]            # the same thing
    python benchmarks/throughput.py --llamacpp --batched [flags]  # all requests decoded together

Default (sequential): llama-cpp-python's high-level API (Llama.eval / Llama.sample) decodes one
sequence at a time, with no batching across requests, so the requests run one after another: reset,
evaluate the prompt (in n_batch chunks), then sample and evaluate one token at a time until the
request's output length (EOS ignored). Sampling is llama.cpp's own sampler chain with temperature
only (top_k, top_p, min_p off), greedy at temperature 0.

--batched: llama.cpp's low-level API (llama_decode over a llama_batch holding several sequences, as
llama-server does), one context with a unified KV cache holding every request: the prompts are
evaluated first (packed into batches of n_batch tokens), then every step decodes one token of each
unfinished request in one batch. Sampling is numpy on the returned logits (softmax at the
temperature, as tallow's sampler does), seeded per request.

The time split is prompt evaluation / decode (eval + sampling of generated tokens).
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

    def one(prompt: list[int], n_out: int, out: list[int]) -> tuple[float, float]:
        llm.reset()  # forget the previous request (no prefix reuse between requests)
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1 = time.perf_counter()
        for i in range(n_out):
            if args.temperature == 0:
                tok = llm.sample(temp=0.0)
            else:
                tok = llm.sample(temp=args.temperature, top_k=0, top_p=1.0, min_p=0.0)
            out.append(tok)
            if i + 1 < n_out:
                llm.eval([tok])
        return t1 - t0, time.perf_counter() - t1

    one([(t + 1) % 1000 for t in prompts[0][:16]], 4, [])  # warm-up, not timed
    prefill = decode = 0.0
    outputs: list[list[int]] = [[] for _ in prompts]
    t = time.perf_counter()
    for p, n, out in zip(prompts, out_lens, outputs):
        a, b = one(p, n, out)
        prefill += a
        decode += b
    elapsed = time.perf_counter() - t
    import llama_cpp

    return dict(engine="llama.cpp (llama-cpp-python, sequential)",
                llama_cpp_python=importlib.metadata.version("llama-cpp-python"),
                llama_cpp_system_info=llama_cpp.llama_print_system_info().decode().strip(),
                threads=threads, n_ctx=n_ctx, n_batch=args.n_batch, load_s=round(load_s, 3), elapsed_s=elapsed,
                time_split_s={"prompt_eval_s": prefill, "decode_s": decode},
                outputs_head=[o[:8] for o in outputs[:4]])


def run_llamacpp_batched(args, prompts: list[list[int]], out_lens: list[int]) -> dict:
    import llama_cpp as L
    import numpy as np
    from llama_cpp import _logger

    _logger.set_verbose(False)  # llama.cpp's load log: errors only
    threads = args.threads or os.cpu_count()
    n_seq = len(prompts)
    n_ctx = args.n_ctx or -(-(sum(map(len, prompts)) + sum(out_lens) + 64) // 256) * 256
    L.llama_backend_init()
    t = time.perf_counter()
    model = L.llama_model_load_from_file(args.model.encode(), L.llama_model_default_params())
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, args.n_batch, args.n_batch
    cp.n_seq_max = n_seq
    cp.kv_unified = True  # one KV pool shared by all sequences (else n_ctx is split evenly among them)
    cp.n_threads = cp.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, cp)
    if not model or not ctx:
        raise SystemExit("llama.cpp could not load the model / create the context")
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(max(args.n_batch, n_seq), 0, 1)
    load_s = time.perf_counter() - t
    rngs = [np.random.default_rng(args.seed + i) for i in range(n_seq)]

    def decode(items):  # items: (seq, token, pos, want_logits); returns the batch rows with logits
        batch.n_tokens = len(items)
        for i, (s, tok, pos, out) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, 1, out
            batch.seq_id[i][0] = s
        if L.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed (KV cache full? raise --n-ctx)")

    def sample(row: int, s: int) -> int:
        logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, row), shape=(n_vocab,))
        if args.temperature == 0:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / args.temperature
        p = np.exp(z - z.max())
        return int(np.searchsorted(np.cumsum(p), rngs[s].random() * p.sum()))

    outputs: list[list[int]] = []

    def run() -> tuple[float, float]:
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        outputs[:] = [[] for _ in range(n_seq)]
        t0 = time.perf_counter()
        nxt = [0] * n_seq
        # prompts, packed into batches of n_batch tokens; logits only at each prompt's last token
        pending = [(s, tok, pos, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
        for i in range(0, len(pending), args.n_batch):
            items = pending[i:i + args.n_batch]
            decode(items)
            for row, (s, _, _, out) in enumerate(items):
                if out:
                    nxt[s] = sample(row, s)
                    outputs[s].append(nxt[s])
        t1 = time.perf_counter()
        produced = [1] * n_seq
        while True:
            live = [s for s in range(n_seq) if produced[s] < out_lens[s]]
            if not live:
                break
            decode([(s, nxt[s], len(prompts[s]) + produced[s] - 1, True) for s in live])
            for row, s in enumerate(live):
                nxt[s] = sample(row, s)
                outputs[s].append(nxt[s])
                produced[s] += 1
        return t1 - t0, time.perf_counter() - t1

    # warm-up (not timed): a short run of the first request
    saved = prompts, out_lens, n_seq
    prompts, out_lens, n_seq = [prompts[0][:16]], [4], 1
    run()
    prompts, out_lens, n_seq = saved
    t = time.perf_counter()
    prefill, dec = run()
    elapsed = time.perf_counter() - t
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return dict(engine="llama.cpp (llama-cpp-python low-level API, batched)",
                llama_cpp_python=importlib.metadata.version("llama-cpp-python"),
                llama_cpp_system_info=L.llama_print_system_info().decode().strip(),
                threads=threads, n_ctx=n_ctx, n_batch=args.n_batch, load_s=round(load_s, 3), elapsed_s=elapsed,
                time_split_s={"prompt_eval_s": prefill, "decode_s": dec},
                outputs_head=[o[:8] for o in outputs[:4]])


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import throughput

    sys.exit(throughput.main(sys.argv[1:] + ["--llamacpp"]))
