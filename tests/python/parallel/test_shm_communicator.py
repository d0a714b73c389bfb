"""The CPU shared-memory collectives against numpy, over 2 and 3 spawned ranks (fresh random inputs each
run): all_reduce sums in rank order (so every rank holds the same bits as numpy's s0 + s1 + s2),
all_gather concatenates, broadcast copies; messages larger than a slot go in rounds; a dead peer or a
timeout raises instead of hanging; the segment is gone from /dev/shm afterwards."""
from __future__ import annotations

import multiprocessing
import os
import time

import numpy as np
import pytest

import tallow
from tallow.parallel.communicator import CollectiveError
from tallow.parallel.shm_communicator import ShmCommunicator

SLOT = 4096  # small slots: the larger inputs below need several rounds


def _inputs(seed: int, world: int):
    rng = np.random.default_rng(seed)
    shapes = [(3, 5), (64, 100), (1,), (7, 333)]  # 7 * 333 * 4 bytes > SLOT: several rounds
    return [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(world)]


def _rank_main(handle, rank: int, seed: int, conn) -> None:
    comm = ShmCommunicator.attach(handle, rank)
    try:
        conn.send(_collectives(comm, seed))
    except Exception as e:  # report to the test instead of dying silently
        conn.send(repr(e))
    finally:
        comm.close()


def _collectives(comm, seed: int) -> dict:
    mine = _inputs(seed, comm.world_size)[comm.rank]
    out = {"reduce": [], "gather": [], "bcast": []}
    for a in mine:
        t = tallow.from_numpy(a.copy())
        comm.all_reduce(t)
        out["reduce"].append(np.asarray(t.numpy()).copy())
    for a in mine:
        g = comm.all_gather(tallow.from_numpy(a.copy()), dim=-1)
        out["gather"].append(np.asarray(g.numpy()).copy())
    # a strided view reduced in place (a narrow of columns), and a bf16 tensor (widened to f32 and back)
    base = tallow.from_numpy(mine[1].copy())
    comm.all_reduce(base.narrow(1, 10, 20))
    out["narrow"] = np.asarray(base.numpy()).copy()
    ids = tallow.from_numpy(np.arange(9, dtype=np.int32) * (comm.rank + 1))
    comm.broadcast(ids, src=comm.world_size - 1)
    out["bcast"] = np.asarray(ids.numpy()).copy()
    half = tallow.from_numpy(mine[0].copy()).to(tallow.bfloat16)
    comm.all_reduce(half)
    out["bf16"] = np.asarray(half.to(tallow.float32).numpy()).copy()
    return out


def _run(world: int, seed: int) -> list[dict]:
    ctx = multiprocessing.get_context("spawn")
    comm = ShmCommunicator.create(world, SLOT, timeout_s=60)
    pipes, procs = [], []
    try:
        for r in range(1, world):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_rank_main, args=(comm.handle, r, seed, child), daemon=True)
            p.start()
            child.close()
            pipes.append(parent)
            procs.append(p)
        results = [_collectives(comm, seed)] + [p.recv() if p.poll(120) else "no answer" for p in pipes]
    finally:
        comm.close()
        for p in procs:
            p.join(30)
    assert not os.path.exists(f"/dev/shm/{comm.handle.name}"), "the segment must be unlinked"
    for r in results:
        assert isinstance(r, dict), r
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_match_numpy(world):
    seed = int.from_bytes(os.urandom(4), "little")
    results = _run(world, seed)
    inputs = _inputs(seed, world)
    for i in range(len(inputs[0])):
        want = inputs[0][i] + inputs[1][i]
        for j in range(2, world):
            want = want + inputs[j][i]
        for r, res in enumerate(results):
            np.testing.assert_array_equal(res["reduce"][i], want, err_msg=f"seed {seed} rank {r} input {i}")
            np.testing.assert_array_equal(res["gather"][i], np.concatenate([x[i] for x in inputs], axis=-1))
    narrow = inputs[0][1].copy()
    for x in inputs[1:]:  # in rank order, as the ranks add
        narrow[:, 10:30] += x[1][:, 10:30]
    for r, res in enumerate(results):
        np.testing.assert_array_equal(res["narrow"][:, 10:30], narrow[:, 10:30])
        np.testing.assert_array_equal(np.delete(res["narrow"], np.s_[10:30], 1),
                                      np.delete(inputs[r][1], np.s_[10:30], 1), err_msg="outside the view")
        np.testing.assert_array_equal(res["bcast"], np.arange(9, dtype=np.int32) * world)
        np.testing.assert_array_equal(res["bf16"], results[0]["bf16"])  # every rank the same bits
    assert np.allclose(results[0]["bf16"], sum(x[0] for x in inputs), rtol=2e-2, atol=2e-2)


def _sleep_then_exit(handle, rank: int) -> None:
    ShmCommunicator.attach(handle, rank)
    time.sleep(0.5)
    os._exit(3)  # dies without joining the collective rank 0 waits in


def test_dead_peer_and_timeout_raise():
    ctx = multiprocessing.get_context("spawn")
    comm = ShmCommunicator.create(2, SLOT, timeout_s=60)
    p = ctx.Process(target=_sleep_then_exit, args=(comm.handle, 1), daemon=True)
    p.start()
    comm.alive_check = lambda: None if p.exitcode is None else f"rank 1 exited with {p.exitcode}"
    t0 = time.monotonic()
    with pytest.raises(CollectiveError, match="rank 1 exited with 3"):
        comm.all_reduce(tallow.from_numpy(np.ones(4, np.float32)))
    assert time.monotonic() - t0 < 20
    with pytest.raises(CollectiveError, match="aborted"):  # the abort flag stays up for later collectives
        comm.all_reduce(tallow.from_numpy(np.ones(4, np.float32)))
    comm.close()
    p.join(10)
    assert not os.path.exists(f"/dev/shm/{comm.handle.name}")

    lone = ShmCommunicator.create(2, SLOT, timeout_s=0.3)  # rank 1 never comes: the timeout
    with pytest.raises(CollectiveError, match=r"timed out after 0.3 s waiting for rank\(s\) \[1\]"):
        lone.broadcast(tallow.from_numpy(np.ones(4, np.int32)))
    lone.close()
    assert not os.path.exists(f"/dev/shm/{lone.handle.name}")
