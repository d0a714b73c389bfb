#!/usr/bin/env python3
"""All-reduce latency and bus bandwidth on N GPUs of one host, per message size: tallow's one-shot CUDA
IPC all-reduce (tallow._core.cuda.IpcAllReduce, cuda/ipc_allreduce.cu) against NCCL
(tallow._core.cuda.NcclComm), both in place on a bf16 (--dtype) tensor, so the engine can keep the
faster one per size.

One spawned process per GPU (rank r on cuda:r). Per size and method: one eager call (NCCL sets up its
connections), then a CUDA graph of --calls all-reduces captured once and replayed --replays times
between two CUDA events, after a host barrier; the time a call is the slowest rank's elapsed time over
calls x replays. Bus bandwidth = 2 (n - 1) / n x bytes / time (nccl-tests' definition). NCCL_NVLS_ENABLE=0
in every rank's environment. Sizes: --min-bytes to --max-bytes in steps of x--step (default 1 KiB to
64 MiB, x2). Without NcclComm in the build only the IPC column is filled.

  python benchmarks/allreduce_bench.py --world 2 --json benchmarks/results/allreduce_h100x2.json
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
import traceback

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def _size(s: str) -> int:
    s = s.strip().upper()
    for suffix, mult in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if s.endswith(suffix):
            return int(float(s[:-1]) * mult)
    return int(s)


def _sizes(args) -> list[int]:
    out, n = [], args.min_bytes
    while n <= args.max_bytes:
        out.append(n)
        n *= args.step
    return out


def _zeros(n_bytes: int, dtype: str, device: str):
    import numpy as np
    import tallow
    # zeros: repeated in-place sums stay finite; the timing does not depend on the values
    return tallow.from_buffer(np.zeros(n_bytes, np.uint8), dtype, [1, n_bytes // ITEMSIZE[dtype]]).to(device)


def _time_graph(all_reduce, t, device: int, calls: int, replays: int, barrier) -> float:
    """Microseconds a call: `calls` all-reduces in one graph, replayed `replays` times."""
    import tallow.cuda as tc
    all_reduce(t)  # eager, outside the capture
    tc.synchronize(device)
    stream = tc.Stream(device)
    g = tc.CUDAGraph()
    with tc.graph(g, stream=stream):
        for _ in range(calls):
            all_reduce(t)
    g.replay(stream)  # warm-up replay
    stream.synchronize()
    barrier.wait()
    start, end = tc.Event(True), tc.Event(True)
    start.record(stream)
    for _ in range(replays):
        g.replay(stream)
    end.record(stream)
    end.synchronize()
    us = start.elapsed_time(end) * 1000.0 / (calls * replays)
    g.reset()
    tc.synchronize(device)
    barrier.wait()  # no rank starts the next measurement while another still replays
    return us


def _rank_main(rank: int, args, conn, barrier) -> None:
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    try:
        import tallow
        import tallow.cuda as tc
        c = tallow._core.cuda
        tc.set_device(rank)
        dev = f"cuda:{rank}"
        sizes = _sizes(args)
        ipc = c.IpcAllReduce(rank, rank, args.world, args.ipc_max_bytes)
        has_nccl = hasattr(c, "NcclComm") and not args.no_nccl
        if has_nccl:
            from tallow.parallel.nccl_communicator import load_nccl

            load_nccl()
        conn.send({"handle": ipc.handle(), "uid": c.nccl_unique_id() if has_nccl and rank == 0 else None})
        peers = conn.recv()
        ipc.open(peers["handles"])
        nccl = c.NcclComm(peers["uid"], args.world, rank, rank) if has_nccl else None
        rows = []
        for n in sizes:
            t = _zeros(n, args.dtype, dev)
            row = {"bytes": n, "ipc_us": None, "nccl_us": None}
            if ipc.supports(t):  # the same answer on every rank: same size, dtype and max_bytes
                row["ipc_us"] = _time_graph(ipc.all_reduce, t, rank, args.calls, args.replays, barrier)
            if nccl is not None:
                row["nccl_us"] = _time_graph(nccl.all_reduce, t, rank, args.calls, args.replays, barrier)
            rows.append(row)
        conn.send({"rows": rows, "device": tc.get_device_name(rank), "nccl": nccl is not None})
    except BaseException:
        conn.send({"exception": traceback.format_exc()})


def _busbw(n_bytes: int, us, world: int):
    return None if us is None else 2.0 * (world - 1) / world * n_bytes / (us * 1e-6) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2, help="ranks, one GPU each (cuda:0 .. cuda:N-1)")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(ITEMSIZE))
    ap.add_argument("--min-bytes", type=_size, default=1 << 10)
    ap.add_argument("--max-bytes", type=_size, default=64 << 20)
    ap.add_argument("--step", type=int, default=2, help="size multiplier (2 or 4)")
    ap.add_argument("--ipc-max-bytes", type=_size, default=None, help="IpcAllReduce buffer (default: --max-bytes)")
    ap.add_argument("--calls", type=int, default=20, help="all-reduces captured in one graph")
    ap.add_argument("--replays", type=int, default=20, help="graph replays timed")
    ap.add_argument("--no-nccl", action="store_true", help="time the IPC all-reduce only")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds before the ranks are killed")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    args.ipc_max_bytes = args.ipc_max_bytes or args.max_bytes
    if args.step < 2 or args.min_bytes < 16 or args.min_bytes % 16:
        print("allreduce_bench: --step must be >= 2 and --min-bytes a multiple of 16 (>= 16)", file=sys.stderr)
        return 2

    import tallow.cuda as tc
    if not tc.is_available() or tc.device_count() < args.world:
        print(f"allreduce_bench: SKIPPED (needs {args.world} CUDA devices, {tc.device_count()} present)")
        return 0

    os.environ["NCCL_NVLS_ENABLE"] = "0"  # inherited by the spawned ranks too
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(args.world)
    conns, procs = [], []
    deadline = time.monotonic() + args.timeout
    try:
        for rank in range(args.world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(rank, args, child, barrier), daemon=True)
            p.start()
            child.close()
            conns.append(parent)
            procs.append(p)

        def recv(rank: int):
            if not conns[rank].poll(max(0.0, deadline - time.monotonic())):
                raise SystemExit(f"allreduce_bench: rank {rank} timed out after {args.timeout} s")
            msg = conns[rank].recv()
            if "exception" in msg:
                raise SystemExit(f"allreduce_bench: rank {rank} failed:\n{msg['exception']}")
            return msg

        hello = [recv(r) for r in range(args.world)]
        for cn in conns:
            cn.send({"handles": [h["handle"] for h in hello], "uid": hello[0]["uid"]})
        results = [recv(r) for r in range(args.world)]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(10)

    rows = []
    for i, r0 in enumerate(results[0]["rows"]):
        n = r0["bytes"]
        row = {"bytes": n}
        for m in ("ipc", "nccl"):
            times = [res["rows"][i][f"{m}_us"] for res in results]
            us = None if any(t is None for t in times) else max(times)
            row[f"{m}_us"] = us
            row[f"{m}_busbw_gbs"] = _busbw(n, us, args.world)
        cands = [(row[f"{m}_us"], m) for m in ("ipc", "nccl") if row[f"{m}_us"] is not None]
        row["faster"] = min(cands)[1] if cands else None
        rows.append(row)

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    print(f"all-reduce, {args.world} x {results[0]['device']}, {args.dtype}, graphs of {args.calls} calls "
          f"x {args.replays} replays (slowest rank); NCCL {'on' if results[0]['nccl'] else 'not in this build'}")
    print(f"{'bytes':>10} {'ipc us':>9} {'ipc GB/s':>9} {'nccl us':>9} {'nccl GB/s':>9}  faster")
    for r in rows:
        print(f"{r['bytes']:>10} {fmt(r['ipc_us'], '9.2f')} {fmt(r['ipc_busbw_gbs'], '9.1f')} "
              f"{fmt(r['nccl_us'], '9.2f')} {fmt(r['nccl_busbw_gbs'], '9.1f')}  {r['faster'] or '-'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world": args.world, "device": results[0]["device"], "dtype": args.dtype,
                       "calls": args.calls, "replays": args.replays, "ipc_max_bytes": args.ipc_max_bytes,
                       "nccl": results[0]["nccl"], "nccl_nvls_enable": os.environ["NCCL_NVLS_ENABLE"],
                       "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
