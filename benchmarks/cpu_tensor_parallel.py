"""CPU tensor parallelism (issue 25's CPU part): what its pieces cost.

    python benchmarks/cpu_tensor_parallel.py [--ranks 2] [--model DIR]

1. The shared-memory all-reduce (tallow/parallel/shm_communicator.py) per message size, median of
   `--iters` calls over `--ranks` processes.
2. Sending a StepData to the workers: one pickle per step written to every pipe (what the executor
   does) against one pickle per rank, for a decode step of 64 running requests and a step admitting 8
   new 512-token prompts.
3. Greedy decode through `LLM` at tensor_parallel_size 1 and `--ranks` (a random Llama of 4 layers,
   hidden 512, or --model), output tokens per second over 8 prompts x 64 tokens.
The ranks share the machine's cores, so on a small shared box (2 cores) TP > 1 is slower end to end: the
CPU path exists to check the sharding without a GPU, not to be faster."""
from __future__ import annotations

import argparse
import multiprocessing
import pathlib
import pickle
import statistics
import sys
import tempfile
import time

import numpy as np

import tallow
from tallow.parallel.shm_communicator import ShmCommunicator

SIZES = [256, 4096, 65536, 1 << 20, 4 << 20]  # bytes (f32)


def _reduce_loop(comm, iters: int) -> list[tuple[int, float]]:
    out = []
    for size in SIZES:
        t = tallow.from_numpy(np.zeros(size // 4, np.float32))  # zeros: repeated sums stay finite
        for _ in range(3):
            comm.all_reduce(t)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            comm.all_reduce(t)
            times.append(time.perf_counter() - t0)
        out.append((size, statistics.median(times)))
    return out


def _peer(handle, rank: int, iters: int) -> None:
    comm = ShmCommunicator.attach(handle, rank)
    _reduce_loop(comm, iters)
    comm.close()


def bench_all_reduce(ranks: int, iters: int) -> None:
    ctx = multiprocessing.get_context("spawn")
    comm = ShmCommunicator.create(ranks, 4 << 20, timeout_s=120)
    procs = [ctx.Process(target=_peer, args=(comm.handle, r, iters)) for r in range(1, ranks)]
    for p in procs:
        p.start()
    res = _reduce_loop(comm, iters)
    for p in procs:
        p.join()
    comm.close()
    for size, s in res:
        print(f"all_reduce {ranks} ranks {size:>8} B: {s * 1e6:9.1f} us  ({size / s / 1e9:.2f} GB/s algorithm bw)")


def bench_step_pickle(ranks: int) -> None:
    from tallow.engine.sampling_params import SamplingParams
    from tallow.engine.step_data import NewRequestData, StepData

    grown = {f"req-{i}": [i] for i in range(0, 64, 16)}  # a few requests got a new block this step
    decode = StepData([f"req-{i}" for i in range(64)], [1] * 64, [], grown, [], 64)
    news = [NewRequestData(f"new-{i}", list(range(512)), [], SamplingParams(max_tokens=100), list(range(32)), 0)
            for i in range(8)]
    prefill = StepData([n.req_id for n in news], [512] * 8, news, {}, [], 8)
    ctx = multiprocessing.get_context("spawn")
    for name, step in (("decode, 64 requests", decode), ("prefill, 8 new 512-token prompts", prefill)):
        pipes = [ctx.Pipe() for _ in range(ranks - 1)]
        n = 2000
        t0 = time.perf_counter()
        for _ in range(n):
            data = pickle.dumps(("step", step), protocol=pickle.HIGHEST_PROTOCOL)
            for a, b in pipes:
                a.send_bytes(data)
                b.recv_bytes()
        once = (time.perf_counter() - t0) / n
        t0 = time.perf_counter()
        for _ in range(n):
            for a, b in pipes:
                a.send_bytes(pickle.dumps(("step", step), protocol=pickle.HIGHEST_PROTOCOL))
                b.recv_bytes()
        each = (time.perf_counter() - t0) / n
        print(f"StepData {name} ({len(data)} B) to {ranks - 1} worker(s): pickled once {once * 1e6:.1f} us/step, "
              f"per rank {each * 1e6:.1f} us/step (pickling, pipe write and read; unpickling not counted)")


def bench_decode(ranks: int, model: str | None) -> None:
    from tallow import LLM, SamplingParams

    if model is None:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "python"))
        from engine_models import make_checkpoint

        model = tempfile.mkdtemp()
        make_checkpoint(pathlib.Path(model), "llama", dtype="float32", hidden_size=512, intermediate_size=1536,
                        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, 32).tolist() for _ in range(8)]
    sp = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    tokens = {}
    for tp in (1, ranks):
        llm = LLM(weights_dir=model, dtype="float32", tensor_parallel_size=tp, num_kv_blocks=256, max_model_len=512)
        llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        tokens[tp] = [o.outputs[0].token_ids for o in outs]
        print(f"decode tp={tp}: {sum(len(t) for t in tokens[tp]) / dt:.1f} output tok/s ({dt:.2f} s)")
        llm.engine.shutdown()
    print(f"tp={ranks} tokens equal tp=1: {tokens[1] == tokens[ranks]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--model", help="a checkpoint folder (default: a random Llama)")
    a = ap.parse_args()
    bench_all_reduce(a.ranks, a.iters)
    bench_step_pickle(a.ranks)
    bench_decode(a.ranks, a.model)


if __name__ == "__main__":
    main()
