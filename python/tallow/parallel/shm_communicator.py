"""The CPU communicator: collectives between processes over one multiprocessing.shared_memory segment.

Layout: a header of int64 words, each on its own 64-byte line: [0] the abort flag, then one arrival
counter per rank; then two buffer sets of world_size slots of slot_bytes each. A collective moves its
data in slot-sized rounds. In a round each rank writes its piece into its own slot of buffer set
(round % 2), publishes the round number in its counter and waits until every counter has reached it
(the barrier: each counter has one writer, so no atomics are needed; x86 keeps stores in order, so the
data is visible before the counter). The two sets make one barrier per round enough: a rank writes set
s again two rounds later, after every rank passed the barrier between, i.e. finished reading s.

all_reduce sums in float32 in rank order (slot 0 + slot 1 + ...) on every rank, so every rank gets the
same bits. Waiting spins briefly, then yields the core (the ranks share few cores), and checks the abort
flag, the peers' liveness and the timeout."""
from __future__ import annotations

import dataclasses
import os
import time
import weakref
from multiprocessing import shared_memory
from typing import Callable, Optional

import numpy as np

import tallow
from tallow.parallel.communicator import CollectiveError, Communicator

_LINE = 8  # int64 words per 64-byte line
_SPINS = 200  # busy polls before yielding the core
_YIELDS = 2000  # sched_yield polls before sleeping between polls
_CHECK_S = 0.05  # how often a waiting rank checks its peers' liveness

_NATIVE = {"float32": np.float32, "int32": np.int32, "int64": np.int64}


@dataclasses.dataclass(frozen=True)
class ShmHandle:
    """What a rank needs to attach (plain data, sent to the worker processes)."""
    name: str
    world_size: int
    slot_bytes: int
    timeout_s: float


def _header_words(world_size: int) -> int:
    return _LINE * (world_size + 1)


def _unlink(shm: shared_memory.SharedMemory) -> None:
    try:
        shm.unlink()
    except FileNotFoundError:
        pass


class ShmCommunicator(Communicator):
    def __init__(self, shm: shared_memory.SharedMemory, handle: ShmHandle, rank: int,
                 alive_check: Optional[Callable[[], Optional[str]]] = None, owner: bool = False):
        """Use create() (rank 0, the owner) or attach() (the other ranks)."""
        self.rank, self.world_size = rank, handle.world_size
        self.handle, self._shm, self._owner = handle, shm, owner
        self.alive_check = alive_check  # returns why a peer is gone, or None
        self.timeout_s = handle.timeout_s
        hw = _header_words(self.world_size)
        self._header = np.ndarray((hw,), np.int64, shm.buf)
        self._counters = self._header[_LINE::_LINE][:self.world_size]
        self._data = np.ndarray((2, self.world_size, handle.slot_bytes), np.uint8, shm.buf, offset=hw * 8)
        self._round = 0
        self._finalizer = weakref.finalize(self, _unlink, shm) if owner else None

    @classmethod
    def create(cls, world_size: int, slot_bytes: int, timeout_s: float,
               alive_check: Optional[Callable[[], Optional[str]]] = None) -> "ShmCommunicator":
        slot_bytes = max(4096, -(-int(slot_bytes) // 64) * 64)
        size = _header_words(world_size) * 8 + 2 * world_size * slot_bytes
        shm = shared_memory.SharedMemory(create=True, size=size, name=f"tallow_tp_{os.getpid()}_{os.urandom(4).hex()}")
        np.ndarray((_header_words(world_size),), np.int64, shm.buf)[:] = 0
        return cls(shm, ShmHandle(shm.name, world_size, slot_bytes, float(timeout_s)), 0, alive_check, owner=True)

    @classmethod
    def attach(cls, handle: ShmHandle, rank: int,
               alive_check: Optional[Callable[[], Optional[str]]] = None) -> "ShmCommunicator":
        return cls(shared_memory.SharedMemory(name=handle.name), handle, rank, alive_check)

    # -- synchronisation ------------------------------------------------------------------------------
    def abort(self, reason: str = "") -> None:
        if self._header is not None:
            self._header[0] = 1

    @property
    def aborted(self) -> bool:
        return self._header is None or bool(self._header[0])

    def _arrive(self) -> np.ndarray:
        """Publish this rank's piece of the current round and wait for every rank's; returns the round's
        buffer set [world_size, slot_bytes]."""
        if self._header is None:
            raise CollectiveError("the tensor-parallel communicator is closed")
        data = self._data[self._round % 2]
        self._round += 1
        target = self._round
        counters = self._counters
        counters[self.rank] = target
        if counters.min() >= target:
            return data
        spins, deadline, next_check = 0, None, 0.0
        while counters.min() < target:
            if self._header[0]:
                raise CollectiveError("a tensor-parallel rank failed; the collective was aborted")
            spins += 1
            if spins < _SPINS:
                continue
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.timeout_s
            if now >= next_check:
                next_check = now + _CHECK_S
                why = self.alive_check() if self.alive_check is not None else None
                if why:
                    self.abort(why)
                    raise CollectiveError(f"tensor-parallel collective aborted: {why}")
            if now > deadline:
                late = [r for r in range(self.world_size) if counters[r] < target]
                self.abort("timeout")
                raise CollectiveError(f"tensor-parallel collective timed out after {self.timeout_s:g} s waiting "
                                      f"for rank(s) {late}")
            if spins < _YIELDS:
                os.sched_yield()
            else:
                time.sleep(0.0002)
        return data

    # -- tensors <-> host arrays --------------------------------------------------------------------------
    @staticmethod
    def _host(t: tallow.Tensor):
        """(numpy array of t's values, writeback or None): a view of t when numpy has its dtype, else a
        float32 copy and the function that writes an array back into t."""
        if t.device != "cpu":
            raise CollectiveError(f"the shared-memory communicator works on CPU tensors, got one on {t.device}")
        if t.dtype.name in _NATIVE:
            return np.asarray(t.numpy()), None

        def back(arr: np.ndarray) -> None:
            t.copy_(tallow.from_numpy(np.ascontiguousarray(arr)).to(t.dtype))

        return np.asarray(t.to(tallow.float32).numpy()), back

    # -- collectives ------------------------------------------------------------------------------------
    def all_reduce(self, t: tallow.Tensor) -> tallow.Tensor:
        arr, back = self._host(t)
        if arr.dtype != np.float32:
            raise CollectiveError(f"all_reduce sums floating-point tensors, got {t.dtype.name}")
        flat = arr.reshape(-1) if arr.flags.c_contiguous else np.ascontiguousarray(arr).reshape(-1)
        per = self.handle.slot_bytes // 4
        for off in range(0, flat.size, per):
            m = min(per, flat.size - off)
            mine = self._data[self._round % 2, self.rank, :4 * m].view(np.float32)
            mine[:] = flat[off:off + m]
            slots = self._arrive()
            out = flat[off:off + m]
            np.add(slots[0, :4 * m].view(np.float32), slots[1, :4 * m].view(np.float32), out=out)
            for j in range(2, self.world_size):
                out += slots[j, :4 * m].view(np.float32)
        if not arr.flags.c_contiguous:
            arr[...] = flat.reshape(arr.shape)
        if back is not None:
            back(arr)
        return t

    def _exchange(self, raw: np.ndarray, out: np.ndarray, src: Optional[int]) -> None:
        """Raw bytes in slot-sized rounds: with src None every rank's `raw` into out[rank] (out:
        [world, nbytes] uint8), else rank src's `raw` into out (nbytes)."""
        per = self.handle.slot_bytes
        for off in range(0, raw.size, per):
            m = min(per, raw.size - off)
            if src is None or src == self.rank:
                self._data[self._round % 2, self.rank, :m] = raw[off:off + m]
            slots = self._arrive()
            if src is None:
                out[:, off:off + m] = slots[:, :m]
            elif src != self.rank:
                out[off:off + m] = slots[src, :m]

    def all_gather(self, t: tallow.Tensor, dim: int = -1) -> tallow.Tensor:
        arr, back = self._host(t)
        arr = np.ascontiguousarray(arr)
        parts = np.empty((self.world_size,) + arr.shape, arr.dtype)
        self._exchange(arr.reshape(-1).view(np.uint8), parts.reshape(self.world_size, -1).view(np.uint8), None)
        out = tallow.from_numpy(np.ascontiguousarray(np.concatenate(list(parts), axis=dim)))
        return out if back is None else out.to(t.dtype)

    def broadcast(self, t: tallow.Tensor, src: int = 0) -> tallow.Tensor:
        arr, back = self._host(t)
        flat = np.ascontiguousarray(arr).reshape(-1)
        recv = np.empty_like(flat) if self.rank != src else flat
        self._exchange(flat.view(np.uint8), recv.view(np.uint8), src)
        if self.rank != src:
            arr[...] = recv.reshape(arr.shape)
            if back is not None:
                back(arr)
        return t

    def close(self) -> None:
        if self._header is None:
            return
        self._header = self._counters = self._data = None  # drop the views before the mapping
        try:
            self._shm.close()
        except BufferError:  # a caller still holds a view; the mapping goes with the process
            pass
        if self._owner:
            self._finalizer()
