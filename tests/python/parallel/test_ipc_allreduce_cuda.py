"""The one-shot CUDA IPC all-reduce (tallow._core.cuda.IpcAllReduce, cuda/ipc_allreduce.cu) over 2 spawned
ranks on cuda:0 and cuda:1, against numpy.

Every input is fresh (a random seed per run, values of both signs from 1e-3 to ~400, never 0) and each
rank can rebuild the other's, so each rank checks its own output: the bits must equal numpy's f32 sum in
rank order rounded once to the dtype (f32: the sum itself), and the float64 sum must lie within that
rounding (f32 rel 1e-6; bf16/f16 half an ulp of the dtype, plus slack for the f32 step). The parent then
checks that both ranks hold the same bits for every call (sha256 of each output).

- every dtype (f32, bf16, f16) at 16 B .. max_bytes (1 MiB, 64 blocks); element counts like 13 * 16 B
  (not powers of two; an odd count of elements cannot be a multiple of 16 bytes in these dtypes),
  one call at a time;
- 200 calls back to back without a host wait, sizes and dtypes mixed (grids of 1 to 64 blocks change
  between calls: the epoch/phase bookkeeping of blocks a call does not launch), with host pauses on
  alternate ranks so one rank runs ahead;
- a CUDA graph of 3 all-reduces captured once and replayed 50 times, new inputs copied into the
  captured tensors between replays, then eager calls again (the epoch continues on the device).
A rank that hangs or dies fails the test within TIMEOUT_S (children are joined with a timeout, then
killed). Argument checks run in-process on one device."""
from __future__ import annotations

import hashlib
import multiprocessing
import multiprocessing.connection
import os
import re
import time
import traceback

import numpy as np
import pytest

import tallow
import tallow.cuda as tc

WORLD = 2
MAX_BYTES = 1 << 20
DTYPES = ("float32", "bfloat16", "float16")
SIZES = (16, 48, 208, 4112, 8192, 65456, 393232, MAX_BYTES)  # bytes; 4112 = 257 * 16, 393232 = 24577 * 16
N_BACK_TO_BACK = 200
GRAPH_CASES = (("bfloat16", 8192), ("float32", 65456), ("float16", 208))
GRAPH_REPLAYS = 50
N_EAGER_AFTER = 5
TIMEOUT_S = 240
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
BITS = {"float32": np.uint32, "bfloat16": np.uint16, "float16": np.uint16}


def _two_gpus_skip():
    if not tc.is_available():
        return "needs a CUDA build of tallow and a CUDA device"
    if tc.device_count() < WORLD:
        return f"needs {WORLD} CUDA devices, {tc.device_count()} present"
    return None


# ---- numpy side: inputs and the reference -------------------------------------------------------
def _bf16_bits(x32: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even (no NaN in these inputs)."""
    u = x32.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _to_f32(bits: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return bits.view(np.float32)
    if dtype == "float16":
        return bits.view(np.float16).astype(np.float32)
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _from_f32(x32: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return x32.astype(np.float32).view(np.uint32)
    if dtype == "float16":
        return x32.astype(np.float16).view(np.uint16)
    return _bf16_bits(x32)


def _input_bits(seed: int, rank: int, case: int, dtype: str, nbytes: int) -> np.ndarray:
    """Rank `rank`'s input of call `case` as the dtype's bits: any rank can rebuild any other's."""
    rng = np.random.default_rng([seed, rank, case])
    n = nbytes // ITEMSIZE[dtype]
    mag = np.maximum(10.0 ** rng.uniform(-2.0, 2.0, n) * np.abs(rng.standard_normal(n)), 1e-3)
    x = np.where(rng.random(n) < 0.5, -mag, mag).astype(np.float32)
    return _from_f32(x, dtype)


def _reference(seed: int, case: int, dtype: str, nbytes: int):
    """(bits of the f32 sum in rank order rounded once to dtype, float64 sum)."""
    ins = [_to_f32(_input_bits(seed, r, case, dtype, nbytes), dtype) for r in range(WORLD)]
    acc = ins[0].copy()
    for x in ins[1:]:
        acc = (acc + x).astype(np.float32)
    return _from_f32(acc, dtype), np.sum([x.astype(np.float64) for x in ins], axis=0)


def _check(out_bits: np.ndarray, seed: int, case: int, dtype: str, nbytes: int) -> str | None:
    want, exact = _reference(seed, case, dtype, nbytes)
    got = _to_f32(out_bits, dtype).astype(np.float64)
    bad = np.flatnonzero(out_bits != want)
    if bad.size:
        i = bad[0]
        return (f"case {case} {dtype} {nbytes} B: {bad.size} elements differ from numpy's f32 rank-order sum, "
                f"first at {i}: got {got[i]!r} (bits {out_bits[i]:#x}) want bits {want[i]:#x}, exact {exact[i]!r}")
    rel, tiny = {"float32": (1e-6, 0.0), "bfloat16": (2.0 ** -8 * 1.001, 0.0),
                 "float16": (2.0 ** -11 * 1.001, 2.0 ** -25)}[dtype]
    err = np.abs(got - exact) - (rel * np.abs(exact) + tiny)
    if (err > 0).any():
        i = int(np.argmax(err))
        return f"case {case} {dtype} {nbytes} B: element {i} = {got[i]!r}, float64 sum {exact[i]!r}: past one rounding"
    return None


# ---- the ranks ------------------------------------------------------------------------------------
def _tensor(bits: np.ndarray, dtype: str, device: str):
    return tallow.from_buffer(np.ascontiguousarray(bits), dtype, [1, bits.size]).to(device)


def _out_bits(t, dtype: str) -> np.ndarray:
    return np.ascontiguousarray(t.to("cpu").numpy(raw=True)).reshape(-1).view(BITS[dtype])


class _Rank:
    def __init__(self, comm, rank: int, device: int, seed: int):
        self.comm, self.rank, self.seed = comm, rank, seed
        self.device = device
        self.dev = f"cuda:{device}"
        self.errors: list[str] = []
        self.digests: dict[int, str] = {}

    def make(self, case: int, dtype: str, nbytes: int):
        return _tensor(_input_bits(self.seed, self.rank, case, dtype, nbytes), dtype, self.dev)

    def verify(self, t, case: int, dtype: str, nbytes: int) -> None:
        bits = _out_bits(t, dtype)
        self.digests[case] = hashlib.sha256(bits.tobytes()).hexdigest()
        err = _check(bits, self.seed, case, dtype, nbytes)
        if err and len(self.errors) < 20:  # keep going: the other rank still expects every call
            self.errors.append(f"rank {self.rank}: {err}")

    def expect(self, cond: bool, what: str) -> None:
        if not cond:
            self.errors.append(f"rank {self.rank}: {what}")

    def run(self) -> None:
        comm, dev = self.comm, self.dev
        # supports(): the right tensors yes, the other GPU's or a 12-byte one no
        self.expect(comm.supports(self.make(0, "bfloat16", 8192)), "supports(bf16 [1, 4096]) is False")
        other = f"cuda:{(self.device + 1) % tc.device_count()}"
        self.expect(not comm.supports(_tensor(np.zeros(4, np.uint32), "float32", other)),
                    f"supports() accepted a tensor on {other}")
        self.expect(not comm.supports(_tensor(np.zeros(3, np.uint32), "float32", dev)), "supports(12 bytes)")

        # one call at a time, every dtype and size
        case = 1000
        for dtype in DTYPES:
            for nbytes in SIZES:
                t = self.make(case, dtype, nbytes)
                comm.all_reduce(t)
                self.verify(t, case, dtype, nbytes)
                case += 1

        # back to back: the same mixed sequence on both ranks (shared seed), no host wait in between
        plan = np.random.default_rng([self.seed, 7])
        cases = [(10000 + i, DTYPES[plan.integers(len(DTYPES))], int(SIZES[plan.integers(len(SIZES))]))
                 for i in range(N_BACK_TO_BACK)]
        tensors = [self.make(*c) for c in cases]
        tc.synchronize(dev)
        for i, (t, _) in enumerate(zip(tensors, cases)):
            if i % 25 == 7 and (i // 25) % WORLD == self.rank:
                time.sleep(0.003)  # this rank falls behind for a moment; the other runs ahead
            comm.all_reduce(t)
        for t, c in zip(tensors, cases):
            self.verify(t, *c)

        # a graph of 3 all-reduces, replayed with new inputs copied into its tensors
        xs = [self.make(20000 + j, d, n) for j, (d, n) in enumerate(GRAPH_CASES)]
        g = tc.CUDAGraph()
        with tc.graph(g, pool=tc.graph_pool_handle(dev), stream=tc.Stream(self.device)):
            for x in xs:
                comm.all_reduce(x)
        for rep in range(GRAPH_REPLAYS):
            cases = [(20100 + rep * len(xs) + j, d, n) for j, (d, n) in enumerate(GRAPH_CASES)]
            for x, c in zip(xs, cases):
                x.copy_(tallow.from_buffer(_input_bits(self.seed, self.rank, *c), c[1], [1, c[2] // ITEMSIZE[c[1]]]))
            g.replay()
            for x, c in zip(xs, cases):
                self.verify(x, *c)
        # eager calls after the replays: the device-side epoch went on counting
        for i in range(N_EAGER_AFTER):
            c = (30000 + i, DTYPES[i % len(DTYPES)], SIZES[(3 * i) % len(SIZES)])
            t = self.make(*c)
            comm.all_reduce(t)
            self.verify(t, *c)
        tc.synchronize(dev)


def _rank_main(rank: int, device: int, seed: int, conn) -> None:
    try:
        tc.set_device(device)  # graph replay and the default stream go to this rank's GPU
        comm = tallow._core.cuda.IpcAllReduce(device, rank, WORLD, MAX_BYTES)
        conn.send(comm.handle())
        comm.open(conn.recv())
        r = _Rank(comm, rank, device, seed)
        r.run()
        conn.send({"errors": r.errors, "digests": r.digests})
    except BaseException:  # report to the test instead of dying silently
        conn.send({"exception": traceback.format_exc()})


def _kill_all(procs) -> None:
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(10)


def _run_ranks(seed: int) -> list[dict]:
    ctx = multiprocessing.get_context("spawn")
    conns, procs = [], []
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for rank in range(WORLD):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(rank, rank, seed, child), daemon=True)
            p.start()
            child.close()
            conns.append(parent)
            procs.append(p)
        handles = []
        for rank, c in enumerate(conns):
            assert c.poll(max(0.0, deadline - time.monotonic())), f"rank {rank} sent no handle within {TIMEOUT_S} s"
            h = c.recv()
            assert isinstance(h, bytes), f"rank {rank} failed before sending its handle: {h}"
            handles.append(h)
        for c in conns:
            c.send(handles)
        results: dict[int, dict] = {}
        while len(results) < WORLD:
            pending = [c for r, c in enumerate(conns) if r not in results]
            ready = multiprocessing.connection.wait(pending, timeout=max(0.0, deadline - time.monotonic()))
            missing = [r for r, c in enumerate(conns) if r not in results and c not in ready]
            assert ready, f"rank(s) {missing} did not finish within {TIMEOUT_S} s (a hang in the all-reduce?)"
            for c in ready:
                rank = conns.index(c)
                try:
                    results[rank] = c.recv()
                except EOFError:
                    results[rank] = {"exception": f"rank {rank} died (exit code {procs[rank].exitcode})"}
                # a rank that raised leaves the other waiting in a collective: stop here
                assert "exception" not in results[rank], f"rank {rank}:\n{results[rank]['exception']}"
        return [results[r] for r in range(WORLD)]
    finally:
        _kill_all(procs)


@pytest.mark.skipif(_two_gpus_skip() is not None, reason=_two_gpus_skip() or "")
def test_ipc_all_reduce_two_ranks():
    seed = int.from_bytes(os.urandom(4), "little")
    results = _run_ranks(seed)
    errors = [e for r in results for e in r["errors"]]
    assert not errors, f"seed {seed}:\n" + "\n".join(errors)
    d0 = results[0]["digests"]
    n_expected = len(DTYPES) * len(SIZES) + N_BACK_TO_BACK + GRAPH_REPLAYS * len(GRAPH_CASES) + N_EAGER_AFTER
    assert len(d0) == n_expected, (len(d0), n_expected)
    for r in range(1, WORLD):
        differ = sorted(k for k in d0 if results[r]["digests"].get(k) != d0[k])
        assert not differ, f"seed {seed}: rank {r}'s outputs differ in bits from rank 0's in calls {differ[:10]}"


@pytest.mark.skipif(not tc.is_available(), reason="needs a CUDA build of tallow and a CUDA device")
def test_ipc_all_reduce_arguments():
    IpcAllReduce = tallow._core.cuda.IpcAllReduce
    with pytest.raises(ValueError, match="world_size 1 not in 2..8"):
        IpcAllReduce(0, 0, 1, 4096)
    with pytest.raises(ValueError, match="rank 2 not in 0..1"):
        IpcAllReduce(0, 2, 2, 4096)
    with pytest.raises(ValueError, match="max_bytes 8 must be at least 16"):
        IpcAllReduce(0, 0, 2, 8)
    with pytest.raises(ValueError, match=r"device 99 not in"):
        IpcAllReduce(99, 0, 2, 4096)
    comm = IpcAllReduce(0, 0, 2, 4096)
    assert len(comm.handle()) == 64 and (comm.rank, comm.world_size, comm.max_bytes) == (0, 2, 4096)
    assert not comm.opened

    def f32(n, device="cuda:0"):
        return tallow.from_numpy(np.ones(n, np.float32)).to(device)

    cases = [
        (f32(64), r"open\(\) has not been called"),
        (f32(64, "cpu"), "on cpu: the communicator is on cuda:0"),
        (tallow.from_numpy(np.ones(64, np.int32)).to("cuda:0"), "dtype must be float32, float16 or bfloat16"),
        (f32(3), "12 bytes, not a multiple of 16"),
        (f32(2048), "8192 bytes, more than max_bytes 4096"),
        (f32(64).view(8, 8).transpose(0, 1), "not contiguous"),
        (f32(65).narrow(0, 1, 64), "not 16-byte aligned"),
    ]
    for t, why in cases:
        assert not comm.supports(t)
        assert re.search(why, comm.unsupported_reason(t)), (why, comm.unsupported_reason(t))
        with pytest.raises(ValueError, match="ipc all_reduce: tensor .*" + why):
            comm.all_reduce(t)
    with pytest.raises(ValueError, match="1 handles for world_size 2"):
        comm.open([comm.handle()])
    with pytest.raises(ValueError, match="handle 1 has 3 bytes, not 64"):
        comm.open([comm.handle(), b"abc"])
    with pytest.raises(ValueError, match="handle 0 is not this rank's own"):
        comm.open([bytes(64), comm.handle()])
    assert not comm.opened
