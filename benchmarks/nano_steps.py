"""The nano-vllm workload (benchmarks/gpu_e2e.py --target nanovllm: Qwen3-0.6B shape, random weights,
256 sequences, input and output lengths uniform in 100-1024, seed 0, ignore_eos) through the engine
one step at a time, reporting wall time per step: mixed steps (with prompt tokens) against decode-only
steps, and decode-only steps by batch size (buckets of 32 sequences). For A/B runs of engine and
kernel switches (environment variables) in one session, where gpu_e2e.py's whole-run figure hides
where a change acts.

    python benchmarks/nano_steps.py [--no-detokenize] [--max-num-batched-tokens N]

A step's wall time is from the previous step's return to this one's: with overlapped scheduling that
is the GPU time of about one step plus whatever the host adds."""
import argparse
import collections
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_e2e  # noqa: E402

from tallow import LLM, SamplingParams  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-detokenize", action="store_true", help="skip detokenizing the outputs")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--device", default="cuda:0")
    args = ap.parse_args()
    root = tempfile.mkdtemp()
    path = gpu_e2e.write_model_dir(root, "qwen3_0.6b", gpu_e2e.QWEN3_06B, True)
    kw = {} if args.max_num_batched_tokens is None else {"max_num_batched_tokens": args.max_num_batched_tokens}
    llm = LLM(model=path, device=args.device, dtype="bfloat16", load_format="dummy", max_model_len=4096,
              max_num_seqs=256, **kw)
    rng = np.random.default_rng(0)
    in_lens = rng.integers(100, 1025, 256)
    prompts = [{"prompt_token_ids": rng.integers(0, 10001, int(n)).tolist()} for n in in_lens]
    out_lens = rng.integers(100, 1025, 256)
    params = [SamplingParams(max_tokens=int(n), ignore_eos=True, temperature=0.0, detokenize=not args.no_detokenize)
              for n in out_lens]
    warm = [{"prompt_token_ids": rng.integers(0, 10001, 64).tolist()} for _ in range(4)]
    llm.generate(warm, SamplingParams(max_tokens=16, ignore_eos=True))

    eng = llm.engine
    kinds = []  # per step: (prompt tokens, decode sequences)
    schedule = eng.scheduler.schedule

    def recording_schedule():
        out = schedule()
        n = [out.num_scheduled_tokens[r.request_id] for r in out.requests]
        kinds.append((sum(x for x in n if x > 1), sum(1 for x in n if x == 1)))
        return out

    eng.scheduler.schedule = recording_schedule
    for p, sp in zip(prompts, params):
        eng.add_request(p, sp)
    times = []
    t0 = last = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
        now = time.perf_counter()
        times.append(now - last)
        last = now
    eng.scheduler.schedule = schedule
    wall = last - t0
    print("wall %.3f s, %d steps, %.0f output tok/s (detokenize=%s)"
          % (wall, len(times), out_lens.sum() / wall, not args.no_detokenize))
    by_kind = collections.defaultdict(lambda: [0, 0.0])
    by_batch = collections.defaultdict(lambda: [0, 0.0])
    for (prompt_tokens, decodes), t in zip(kinds, times):
        by_kind["mixed" if prompt_tokens else "decode"][0] += 1
        by_kind["mixed" if prompt_tokens else "decode"][1] += t
        if not prompt_tokens and decodes:
            b = by_batch[(decodes + 31) // 32 * 32]
            b[0] += 1
            b[1] += t
    for k, (n, t) in by_kind.items():
        print("  %-6s %5d steps %.3f s (%.2f ms/step)" % (k, n, t, t / n * 1e3))
    for k in sorted(by_batch):
        n, t = by_batch[k]
        print("  decode batch <=%3d: %4d steps %.2f ms/step" % (k, n, t / n * 1e3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
