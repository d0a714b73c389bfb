#!/usr/bin/env python3
"""End-to-end GPU benchmarks of issue 8, on random-weight models of real shapes made on the device.

    PYTHONPATH=build/python:python python benchmarks/gpu_e2e.py --target all [--enforce-eager]
        [--kv-cache-dtype fp8] [--check-pool] [--prediction NAME=VALUE ...] [--json PATH]

Targets (each measured against a ceiling measured in the same run, or the issue's number):
  decode8b   Llama-3-8B shape, bf16, batch 1, 128-token prompt, 256 generated tokens: decode tok/s (first
             token to last, from streamed outputs; prefill excluded) vs the bandwidth bound = copy
             bandwidth / (bytes of weights read per token + KV bytes of the average context). The copy
             bandwidth is tallow's device copy_ of 1 GiB, (read + write bytes) / time, best of 10.
  nanovllm   Qwen3-0.6B shape, nano-vllm's workload: 256 sequences, input and output lengths uniform in
             100..1024 (numpy seed 0; token ids uniform in 0..10000 as nano-vllm), ignore_eos, all
             submitted at once to llm.generate: output tok/s vs the issue's 20,000 tok/s target (a target,
             not a bound), plus engine steps and ms per step; the median of --repeats runs (the prefix
             cache is reset before each, so every run prefills every prompt). Also the same tok/s against
             the decode steps' bytes at the copy bandwidth (the KV of every context each step attends, the
             weights once a step; prefill not counted): 26,200 tok/s at 3.0 TB/s.
  prefill8b  One 4096-token prompt, max_tokens=1, 8B shape: prefill tok/s and achieved TFLOP/s vs the bf16
             GEMM rate of tallow.ops.linear [4096,4096] x [14336,4096]^T (best of 10, CUDA events).

The models are folders holding only config.json (and, unless --no-tokenizer, a WordLevel tokenizer.json of
the vocabulary size, since the engine needs a tokenizer to detokenize); weights come from
load_format="dummy". Prompts are token ids. Results: a JSON list of {name, device, value, unit, ceiling,
ratio, prediction, command, details}; entries of the same name and device in an existing file are replaced.
Needs no torch.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shlex
import statistics
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Llama-3.1-8B's config.json (Llama-3-8B's shapes; llama3 RoPE scaling as in the real 3.1 file).
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "mlp_bias": False,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
}
# Qwen3-0.6B's config.json.
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "num_attention_heads": 16, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_sliding_window": False,
    "vocab_size": 151936,
}
ISSUE_NANOVLLM_TARGET = 20000.0  # output tok/s on one H100 (issue 8, target 2)
TARGETS = ("decode8b", "nanovllm", "prefill8b")


# ---- setup --------------------------------------------------------------------------------------

def write_model_dir(root: str, name: str, config: dict, tokenizer: bool) -> str:
    d = os.path.join(root, name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    if tokenizer:
        write_byte_level_tokenizer(d, config["vocab_size"], config["eos_token_id"])
    return d


def write_byte_level_tokenizer(d: str, vocab_size: int, eos_id: int) -> None:
    """A byte-level BPE vocabulary of the model's size (the 256 byte symbols, then pieces " w<i>"),
    decoded by a ``ByteLevel`` decoder as Qwen3's and Llama 3's real tokenizers are, so the engine
    detokenizes at a real tokenizer's cost. It has no merges: benchmarks feed token ids, not text."""
    from tokenizers import Tokenizer, decoders, models

    from tallow.tokenizer.byte_level import byte_symbols

    vocab = {c: i for i, c in enumerate(byte_symbols())}
    vocab.update({f"\u0120w{i}": i for i in range(len(vocab), vocab_size)})  # \u0120 is the symbol of " "
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.ByteLevel()
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": f"\u0120w{eos_id}", "bos_token": None}, f)


def device_slug(name: str) -> str:
    s = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    return re.sub(r"^nvidia_", "", s) or "gpu"


def time_events(fn, reps: int, warm: int = 2) -> list[float]:
    """Milliseconds of each of `reps` calls of fn, bracketed by CUDA events on the current stream."""
    import tallow.cuda as tc

    for _ in range(warm):
        fn()
    tc.synchronize()
    out = []
    for _ in range(reps):
        s, e = tc.Event(enable_timing=True), tc.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e))
    return out


def copy_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Device copy bandwidth in bytes/s: (read + write bytes) / time of tallow's copy_, best of 10."""
    import tallow

    n = nbytes // 2
    src = tallow.ops.fill_uniform_(tallow.empty([n], "bfloat16", device), -1.0, 1.0, 1)
    dst = tallow.empty([n], "bfloat16", device)
    ms = min(time_events(lambda: dst.copy_(src), 10))
    return 2 * nbytes / (ms * 1e-3)


def gemm_rate(device: str, m: int = 4096, n: int = 14336, k: int = 4096) -> float:
    """bf16 GEMM FLOP/s of tallow.ops.linear x[m,k] @ w[n,k]^T, best of 10 (after the first call, which picks
    the algorithm)."""
    import tallow

    x = tallow.ops.fill_uniform_(tallow.empty([m, k], "bfloat16", device), -1.0, 1.0, 2)
    w = tallow.ops.fill_uniform_(tallow.empty([n, k], "bfloat16", device), -k ** -0.5, k ** -0.5, 3)
    out = tallow.empty([m, n], "bfloat16", device)
    tallow.ops.linear(x, w, out=out)
    ms = min(time_events(lambda: tallow.ops.linear(x, w, out=out), 10, warm=3))
    return 2.0 * m * n * k / (ms * 1e-3)


def release_device_memory() -> None:
    import tallow.cuda as tc

    gc.collect()
    tc.synchronize()
    tc.empty_cache()


# ---- the engine ---------------------------------------------------------------------------------

def make_llm(model_dir: str, args, **extra):
    import tallow

    kw = dict(device=args.device, dtype="bfloat16", load_format="dummy", enforce_eager=args.enforce_eager,
              kv_cache_dtype=args.kv_cache_dtype)
    if args.isq:
        kw["quantization"] = args.isq
    if args.tp > 1:
        kw["tensor_parallel_size"] = args.tp
    kw.update(extra)
    t0 = time.perf_counter()
    llm = tallow.LLM(model=model_dir, **kw)
    return llm, time.perf_counter() - t0


def engine_of(llm):
    return getattr(llm, "engine", None) or getattr(llm, "llm_engine")


def assert_pool_free(llm, what: str) -> None:
    """Every request finished and every KV block back in the pool, unreferenced."""
    eng = engine_of(llm)
    pool = eng.kv.pool
    held = pool.num_blocks - pool.num_free_blocks
    refs = sum(1 for b in pool.blocks if b.ref_cnt)
    if held or refs or eng.has_unfinished_requests():
        raise AssertionError(f"--check-pool after {what}: {held} of {pool.num_blocks} KV blocks still held, "
                             f"{refs} referenced, unfinished requests: {eng.has_unfinished_requests()}")


def after_run(llm, args, what: str) -> None:
    if args.check_pool:
        assert_pool_free(llm, what)


def kv_bytes_per_token(cfg: dict, kv_dtype: str) -> int:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    size = 1 if kv_dtype in ("fp8", "float8_e4m3") else 2
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * size


def model_cfg(cfg: dict):
    from tallow.config import ModelConfig

    return ModelConfig.from_hf_dict(cfg)


def decode_weight_bytes(cfg: dict, llm=None) -> int:
    """Bytes of weights one decode step reads: all but the token embedding table (one row per token), but
    the table is read whole as the lm_head when the embeddings are tied. bf16 from the shape; with --isq the
    model's own parameter bytes (block types) less an untied embedding table."""
    from tallow.models import num_params

    c = model_cfg(cfg)
    if llm is not None and engine_of(llm).args.quantization:
        from tallow.models import weight_bytes

        model = engine_of(llm).executor.worker.model
        total = sum(weight_bytes(model).values())
        if not c.tie_word_embeddings:
            total -= model.embed_tokens.weight.nbytes
        return total
    n = num_params(c, include_embedding=False)
    if c.tie_word_embeddings:
        n += c.vocab_size * c.hidden_size
    return 2 * n


def prefill_flops(cfg: dict, t: int) -> tuple[float, dict]:
    """FLOPs of prefilling one t-token prompt: 2 * params * t for every GEMM (the lm_head runs for the last
    token only, as the runner computes logits for the rows that sample), plus causal attention
    QK^T and PV: 2 * 2 * head_dim * t(t+1)/2 per head and layer."""
    from tallow.models import num_params

    c = model_cfg(cfg)
    head = c.vocab_size * c.hidden_size
    body = num_params(c, include_embedding=False) - (0 if c.tie_word_embeddings else head)
    gemm = 2.0 * body * t + 2.0 * head
    attn = c.num_hidden_layers * c.num_attention_heads * 4.0 * c.head_dim * t * (t + 1) / 2
    return gemm + attn, {"gemm_flops": gemm, "attention_flops": attn, "params_in_gemms_per_token": body}


# ---- targets ------------------------------------------------------------------------------------

def sampling(args, **kw):
    from tallow import SamplingParams

    if args.no_detokenize:
        kw["detokenize"] = False
    return SamplingParams(ignore_eos=True, **kw)


def run_decode8b(llm, args, rng, bw: float) -> list[dict]:
    prompt_len, gen = 128, 256
    params = sampling(args, max_tokens=gen, temperature=0)

    def one(n_gen):
        prompt = {"prompt_token_ids": rng.integers(0, LLAMA3_8B["vocab_size"], prompt_len).tolist()}
        sp = params if n_gen == gen else sampling(args, max_tokens=n_gen, temperature=0)
        t_start = time.perf_counter()
        t_first = t_last = None
        n_first = n_total = 0
        for delta in llm.generate_stream(prompt, sp):
            k = sum(len(o.token_ids) for o in delta.outputs)
            if k and t_first is None:
                t_first, n_first = time.perf_counter(), k
            n_total += k
            if delta.finished:
                t_last = time.perf_counter()
        after_run(llm, args, "decode8b")
        if n_total != n_gen:
            raise AssertionError(f"decode8b: asked for {n_gen} tokens, got {n_total}")
        return (n_total - n_first) / (t_last - t_first), t_first - t_start

    one(16)  # warm-up (lazy initialisation, first graph replays)
    runs = [one(gen) for _ in range(args.repeats)]
    tok_s = statistics.median(r[0] for r in runs)
    ttft = statistics.median(r[1] for r in runs)
    avg_ctx = statistics.mean(prompt_len + j for j in range(1, gen))  # KV read by the steps that make tokens 2..gen
    w_bytes = decode_weight_bytes(LLAMA3_8B, llm)
    kv_bytes = kv_bytes_per_token(LLAMA3_8B, args.kv_cache_dtype) * avg_ctx
    bound = args.tp * bw / (w_bytes + kv_bytes)  # tensor parallelism: each GPU reads its share
    return [
        measurement(args, "decode8b", f"llama3_8b_{args.isq or 'bf16'}_decode_b1_p{prompt_len}_g{gen}_tok_s", tok_s,
                    "tok/s", bound,
                    {"runs_tok_s": [r[0] for r in runs], "ttft_ms_128_tokens": ttft * 1e3,
                     "copy_bandwidth_GB_s": bw / 1e9, "weight_bytes_per_token": w_bytes,
                     "kv_bytes_per_token": kv_bytes, "average_context": avg_ctx,
                     "ceiling_is": "copy bandwidth / (weights except the embedding table + KV of the average "
                                   "context) bytes per token"}),
    ]


def nanovllm_workload():
    """nano-vllm's benchmark requests: (prompt token id lists, output lengths, the generator for
    further draws). 256 sequences, input and output lengths uniform in 100..1024, numpy seed 0."""
    rng = np.random.default_rng(0)
    num_seqs, lo, hi = 256, 100, 1024
    in_lens = rng.integers(lo, hi + 1, num_seqs)
    prompts = [rng.integers(0, 10001, int(n)).tolist() for n in in_lens]
    out_lens = rng.integers(lo, hi + 1, num_seqs)
    return prompts, [int(n) for n in out_lens], rng


def decode_bytes(cfg: dict, kv_dtype: str, prompt_lens, out_lens) -> tuple[float, float]:
    """(weight bytes, KV bytes) the decode steps of a batch read when every request runs from the start:
    a request with output length n is in n - 1 decode steps (its first token comes from its prefill),
    the one making token j reads the prompt and j keys; the weights are read once a step (as many
    steps as the longest output needs). Prefill is not counted."""
    kv = sum((n - 1) * p + (n - 1) * n // 2 for p, n in zip(prompt_lens, out_lens))
    return float(decode_weight_bytes(cfg)) * (max(out_lens) - 1), float(kv_bytes_per_token(cfg, kv_dtype)) * kv


def run_nanovllm(llm, args, bw: float) -> list[dict]:
    token_lists, out_lens, rng = nanovllm_workload()
    prompts = [{"prompt_token_ids": t} for t in token_lists]
    in_lens = np.array([len(t) for t in token_lists])
    params = [sampling(args, max_tokens=n, temperature=args.temperature) for n in out_lens]

    warm = [{"prompt_token_ids": rng.integers(0, 10001, 64).tolist()} for _ in range(4)]
    llm.generate(warm, sampling(args, max_tokens=16, temperature=args.temperature))
    after_run(llm, args, "nanovllm warm-up")
    eng = engine_of(llm)
    expected = sum(out_lens)
    runs = []
    for _ in range(args.repeats):
        eng.kv.pool.reset_prefix_cache()  # each run prefills every prompt (no hits from the previous run)
        steps0 = eng.stats.get("steps", 0)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        steps = eng.stats.get("steps", 0) - steps0
        after_run(llm, args, "nanovllm")
        produced = sum(o.completion_tokens for o in outs)
        if produced != expected:
            raise AssertionError(f"nanovllm: expected {expected} output tokens, got {produced}")
        if any(o.num_cached_tokens for o in outs):
            raise AssertionError("nanovllm: a prompt was served from the prefix cache")
        runs.append((produced / wall, wall, steps))
    tok_s, wall, steps = sorted(runs)[len(runs) // 2]  # the median run
    w_bytes, kv_bytes = decode_bytes(QWEN3_06B, args.kv_cache_dtype, in_lens.tolist(), out_lens)
    details = {"wall_s": wall, "output_tokens": produced, "input_tokens": int(in_lens.sum()),
               "engine_steps": steps, "ms_per_step": wall / max(steps, 1) * 1e3,
               "runs_tok_s": [r[0] for r in runs], "temperature": args.temperature,
               "ceiling_is": "the issue's target of 20,000 output tok/s on one H100 (a target, not a bound)"}
    return [
        measurement(args, "nanovllm", f"qwen3_0.6b_{args.isq or 'bf16'}_nanovllm_256seq_output_tok_s", tok_s, "tok/s",
                    ISSUE_NANOVLLM_TARGET, details),
        measurement(args, "nanovllm", "qwen3_0.6b_nanovllm_256seq_engine_steps", steps, "steps", None,
                    {"what": "engine steps (prefill chunks and decode steps, batched together) of the timed run"}),
        measurement(args, "nanovllm", "qwen3_0.6b_nanovllm_256seq_ms_per_step", wall / max(steps, 1) * 1e3, "ms",
                    None, {"what": "wall time of the timed run / engine steps"}),
        measurement(args, "nanovllm", "qwen3_0.6b_nanovllm_256seq_vs_decode_bytes", tok_s, "tok/s",
                    produced / ((w_bytes + kv_bytes) / bw),
                    {"weight_bytes": w_bytes, "kv_bytes": kv_bytes, "copy_bandwidth_GB_s": bw / 1e9,
                     "ceiling_is": "output tokens / the time the decode steps' bytes take at the copy bandwidth: "
                                   "KV of every context each step attends plus the weights once a step "
                                   "(benchmarks/gpu_e2e.py decode_bytes); prefill not counted, so no run "
                                   "reaches it"}),
    ]


def run_prefill8b(llm, args, rng, gemm: float) -> list[dict]:
    t = 4096
    sp = sampling(args, max_tokens=1, temperature=0)

    def one():
        prompt = {"prompt_token_ids": rng.integers(0, LLAMA3_8B["vocab_size"], t).tolist()}  # no prefix-cache hits
        t0 = time.perf_counter()
        out = llm.generate(prompt, sp)
        dt = time.perf_counter() - t0
        after_run(llm, args, "prefill8b")
        assert out[0].completion_tokens == 1
        return dt

    one()  # warm-up: first large GEMMs pick their algorithms
    times = [one() for _ in range(args.repeats)]
    dt = statistics.median(times)
    flops, parts = prefill_flops(LLAMA3_8B, t)
    tflops = flops / dt / 1e12
    details = {"runs_s": times, "flops": flops, **parts, "gemm_TFLOP_s": gemm / 1e12,
               "gemm_shape": "[4096,4096] x [14336,4096]^T bf16, best of 10"}
    return [
        measurement(args, "prefill8b", f"llama3_8b_bf16_prefill_{t}_tok_s", t / dt, "tok/s", gemm / flops * t,
                    {**details, "ceiling_is": "prompt tokens/s if every FLOP ran at the measured GEMM rate"}),
        measurement(args, "prefill8b", f"llama3_8b_bf16_prefill_{t}_TFLOP_s", tflops, "TFLOP/s", gemm / 1e12,
                    {**details, "ceiling_is": "bf16 GEMM rate of tallow.ops.linear measured in the same run"}),
    ]


# ---- results ------------------------------------------------------------------------------------

def variant_suffix(args) -> str:
    s = ""
    if args.kv_cache_dtype in ("fp8", "float8_e4m3"):
        s += "_fp8kv"
    if args.enforce_eager:
        s += "_eager"
    if args.no_detokenize:
        s += "_nodetok"
    if args.tp > 1:
        s += f"_tp{args.tp}"
    return s


def reproduce_command(args, target: str) -> str:
    cmd = ["python", "benchmarks/gpu_e2e.py", "--target", target]
    if args.tp > 1:
        cmd += ["--tp", str(args.tp)]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    if args.kv_cache_dtype != "auto":
        cmd += ["--kv-cache-dtype", args.kv_cache_dtype]
    if args.no_tokenizer:
        cmd.append("--no-tokenizer")
    if args.device != "cuda:0":
        cmd += ["--device", args.device]
    if args.no_detokenize:
        cmd.append("--no-detokenize")
    if target == "nanovllm" and args.temperature:
        cmd += ["--temperature", str(args.temperature)]
    if args.repeats != 3:
        cmd += ["--repeats", str(args.repeats)]
    return shlex.join(cmd)


def measurement(args, target: str, name: str, value: float, unit: str, ceiling, details: dict) -> dict:
    name += variant_suffix(args)
    pred = args.predictions.get(name)
    if pred is None and unit == "tok/s":  # a prediction given by target name applies to its tok/s result
        pred = args.predictions.get(target)
    return {"name": name, "device": args.device_name, "value": float(value), "unit": unit,
            "ceiling": None if ceiling is None else float(ceiling),
            "ratio": None if not ceiling else float(value) / float(ceiling),
            "prediction": pred, "command": reproduce_command(args, target),
            "details": {**details, "enforce_eager": args.enforce_eager, "kv_cache_dtype": args.kv_cache_dtype,
                        "detokenize": not args.no_detokenize}}


def save(path: str, results: list[dict]) -> None:
    old = []
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    by_key = {(r.get("name"), r.get("device")): r for r in old}
    for r in results:  # a rerun keeps the prediction recorded before optimising unless it gives a new one
        prev = by_key.get((r["name"], r["device"]))
        if r["prediction"] is None and prev is not None and prev.get("prediction") is not None:
            r["prediction"] = prev["prediction"]
            if r["ceiling"]:
                r["details"]["prediction_ratio"] = r["prediction"] / r["ceiling"]
    new_keys = {(r["name"], r["device"]) for r in results}
    merged = [r for r in old if (r.get("name"), r.get("device")) not in new_keys] + results
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(merged, f, indent=1)
        f.write("\n")


def print_table(results: list[dict]) -> None:
    def fmt(v):
        if v is None:
            return "-"
        return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"

    rows = [(r["name"], fmt(r["value"]), r["unit"], fmt(r["ceiling"]),
             "-" if r["ratio"] is None else f"{100 * r['ratio']:.1f}%", fmt(r["prediction"])) for r in results]
    head = ("measurement", "value", "unit", "ceiling", "ratio", "prediction")
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for row in (head, *rows):
        print("  ".join(str(x).ljust(w) if i == 0 else str(x).rjust(w) for i, (x, w) in enumerate(zip(row, widths))))


# ---- main ---------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", choices=(*TARGETS, "all"), default="all")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--enforce-eager", action="store_true", help="run decode steps eagerly (no CUDA graphs)")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (bf16) or fp8")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel size: the first N GPUs from --device's on (ceilings scale by N)")
    p.add_argument("--isq", default=None, help="quantize the dummy weights at load (e.g. q4k, q8_0), as --isq does")
    p.add_argument("--json", default=None, help="results file (default benchmarks/results/e2e_<device>.json)")
    p.add_argument("--prediction", action="append", default=[], metavar="NAME=VALUE",
                   help="the prediction written before optimising; NAME is a measurement name or a target "
                        "(decode8b, nanovllm, prefill8b: its tok/s result); repeatable")
    p.add_argument("--check-pool", action="store_true",
                   help="assert after every generate call that the KV block pool is entirely free")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="nanovllm: the engine's token budget a step (default: the engine's, 8192)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of decode8b / prefill8b / nanovllm (median reported)")
    p.add_argument("--temperature", type=float, default=0.0, help="nanovllm sampling temperature (nano-vllm: 0.6)")
    p.add_argument("--no-tokenizer", action="store_true",
                   help="model folders with config.json only (the engine then needs its own stand-in tokenizer)")
    p.add_argument("--no-detokenize", action="store_true",
                   help="SamplingParams(detokenize=False): token ids only, no incremental detokenization (as "
                        "nano-vllm's benchmark, which decodes nothing while generating); needs engine support")
    args = p.parse_args(argv)
    args.predictions = {}
    for item in args.prediction:
        name, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError
            args.predictions[name.strip()] = float(value)
        except ValueError:
            p.error(f"--prediction takes NAME=VALUE with a number, got {item!r}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import tallow
    import tallow.cuda as tc

    if not tc.is_available():
        print("gpu_e2e: needs a CUDA build of tallow and a CUDA device", file=sys.stderr)
        return 2
    args.device_name = tc.get_device_name(args.device)
    path = args.json or os.path.join(REPO, "benchmarks", "results", f"e2e_{device_slug(args.device_name)}.json")
    targets = TARGETS if args.target == "all" else (args.target,)
    print(f"gpu_e2e: {args.device_name}, targets {', '.join(targets)}, tallow {tallow.__version__}")

    # Ceilings first, on an otherwise empty device; their buffers go back before the engines size their KV caches.
    bw = gemm = None
    if "decode8b" in targets or "nanovllm" in targets:
        bw = copy_bandwidth(args.device)
        print(f"  copy bandwidth: {bw / 1e9:,.0f} GB/s (read + write, 1 GiB, best of 10)")
    if "prefill8b" in targets:
        gemm = gemm_rate(args.device)
        print(f"  bf16 GEMM [4096,4096]x[14336,4096]^T: {gemm / 1e12:,.0f} TFLOP/s (best of 10)")
    release_device_memory()

    results: list[dict] = []
    rng = np.random.default_rng(1234)
    with tempfile.TemporaryDirectory(prefix="tallow_e2e_") as root:
        tok = not args.no_tokenizer
        if "decode8b" in targets or "prefill8b" in targets:
            d = write_model_dir(root, "llama3_8b", LLAMA3_8B, tok)
            llm, load_s = make_llm(d, args, max_model_len=8192)
            print(f"  Llama-3-8B shape: engine ready in {load_s:.1f} s")
            if "decode8b" in targets:
                results += run_decode8b(llm, args, rng, bw)
            if "prefill8b" in targets:
                results += run_prefill8b(llm, args, rng, gemm)
            for r in results:
                r["details"]["engine_load_s"] = load_s
            del llm
            release_device_memory()
        if "nanovllm" in targets:
            d = write_model_dir(root, "qwen3_0.6b", QWEN3_06B, tok)
            extra = {"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}
            llm, load_s = make_llm(d, args, max_model_len=4096, max_num_seqs=256, **extra)  # nano-vllm's bench settings
            print(f"  Qwen3-0.6B shape: engine ready in {load_s:.1f} s")
            new = run_nanovllm(llm, args, bw)
            for r in new:
                r["details"]["engine_load_s"] = load_s
            results += new
            del llm
            release_device_memory()
    if "decode8b" in targets or "nanovllm" in targets:
        target = "decode8b" if "decode8b" in targets else "nanovllm"
        results.append(measurement(args, target, "copy_bandwidth_GB_s", bw / 1e9, "GB/s", None,
                                   {"what": "tallow copy_ of 1 GiB bf16, (read + write bytes) / time, best of 10"}))
    if "prefill8b" in targets:
        results.append(measurement(args, "prefill8b", "gemm_bf16_4096x14336x4096_TFLOP_s", gemm / 1e12, "TFLOP/s",
                                   None, {"what": "tallow.ops.linear [4096,4096] x [14336,4096]^T, best of 10"}))
    save(path, results)
    print()
    print_table(results)
    print(f"\nwrote {len(results)} results to {os.path.relpath(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
