"""Tensor parallelism across hosts: the ranks started by an MPI runner instead of spawned by rank 0.

    mpirun -np 2 -hostfile hosts tallow serve --w DIR --port 8000        (candle-vllm's MPI runner)

Every rank runs `tallow serve`; MPI rank 0 serves HTTP with the engine in its own process (the engine
thread; no separate engine-core process, whose MPI identity would clash with its parent's), and the
other ranks run `worker_main`: the same serve_rank loop as the spawned workers, with MPI broadcasts
instead of a pipe. The tensor-parallel size is the MPI world's size. Rank 0 sends every rank one
"init" message first (the engine arguments, the model config, and on GPUs the NCCL unique id), so the
other ranks parse no flags and read no config of their own.

The collectives: on GPUs NCCL (each rank's GPU is its rank on its host, OMPI_COMM_WORLD_LOCAL_RANK or
MPI_LOCALRANKID; CUDA_VISIBLE_DEVICES picks others), between CPU hosts MpiCommunicator (mpi4py:
all-gather, then a float32 sum in rank order, so every rank gets the same bits). Faults: a rank that
dies ends the MPI job (mpirun stops every rank), which ends the server."""
from __future__ import annotations

import dataclasses
import logging
import pickle
import sys
import time
import traceback
from typing import Optional

import numpy as np

import tallow
from tallow import envs
from tallow.parallel.communicator import CollectiveError, Communicator, set_tp_group
from tallow.parallel.shm_communicator import ShmCommunicator

log = logging.getLogger("tallow.parallel")

_SPIN_S = 0.002  # a waiting rank polls without sleeping this long (a step's command comes fast) ...
_NAP_S = 0.0002  # ... then sleeps this long between polls (an idle server costs no core)


@dataclasses.dataclass(frozen=True)
class MpiWorld:
    size: int
    rank: int
    local_rank: int


def mpi_world() -> Optional[MpiWorld]:
    """This process's place in an MPI job of two or more ranks (Open MPI's or MPICH's runner), or None."""
    if envs.OMPI_COMM_WORLD_SIZE > 1:
        return MpiWorld(envs.OMPI_COMM_WORLD_SIZE, envs.OMPI_COMM_WORLD_RANK, envs.OMPI_COMM_WORLD_LOCAL_RANK)
    if envs.PMI_SIZE > 1:
        return MpiWorld(envs.PMI_SIZE, envs.PMI_RANK, envs.MPI_LOCALRANKID)
    return None


def mpi_module():
    """mpi4py.MPI (importing it initialises MPI in this process), or RuntimeError saying what to install."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise RuntimeError(f"tallow under an MPI runner needs mpi4py and an MPI library ({e}); "
                           "pip install 'tallow[mpi]'") from None
    return MPI


def _wait(req) -> None:
    """Wait for a nonblocking MPI request, spinning briefly, then napping between polls."""
    t0 = time.monotonic()
    while not req.Test():
        if time.monotonic() - t0 > _SPIN_S:
            time.sleep(_NAP_S)


class MpiChannel:
    """Rank 0's commands to the other ranks: pickled objects broadcast over their own communicator (the
    size first, then the bytes)."""

    def __init__(self, comm):
        self.comm = comm

    def send(self, obj) -> None:
        data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
        _wait(self.comm.Ibcast(np.array([data.size], dtype=np.int64), root=0))
        _wait(self.comm.Ibcast(data, root=0))

    def recv(self):
        n = np.zeros(1, dtype=np.int64)
        _wait(self.comm.Ibcast(n, root=0))
        buf = np.empty(int(n[0]), dtype=np.uint8)
        _wait(self.comm.Ibcast(buf, root=0))
        return pickle.loads(buf.tobytes())


class MpiCommunicator(Communicator):
    """CPU collectives between hosts through MPI (mpi4py's buffer interface on numpy arrays)."""

    def __init__(self, comm):
        self.comm = comm
        self.rank, self.world_size = comm.Get_rank(), comm.Get_size()
        self._why: Optional[str] = None

    def _gather(self, arr: np.ndarray) -> np.ndarray:
        if self._why is not None:
            raise CollectiveError(self._why)
        arr = np.ascontiguousarray(arr)
        out = np.empty((self.world_size,) + arr.shape, arr.dtype)
        _wait(self.comm.Iallgather(arr, out))
        return out

    def all_reduce(self, t: tallow.Tensor) -> tallow.Tensor:
        arr, back = ShmCommunicator._host(t)
        if arr.dtype != np.float32:
            raise CollectiveError(f"all_reduce sums floating-point tensors, got {t.dtype.name}")
        parts = self._gather(arr)
        total = parts[0].copy()
        for j in range(1, self.world_size):  # rank order on every rank: the same bits everywhere
            total += parts[j]
        arr[...] = total
        if back is not None:
            back(arr)
        return t

    def all_gather(self, t: tallow.Tensor, dim: int = -1) -> tallow.Tensor:
        arr, back = ShmCommunicator._host(t)
        out = tallow.from_numpy(np.ascontiguousarray(np.concatenate(list(self._gather(arr)), axis=dim)))
        return out if back is None else out.to(t.dtype)

    def broadcast(self, t: tallow.Tensor, src: int = 0) -> tallow.Tensor:
        arr, back = ShmCommunicator._host(t)
        buf = np.ascontiguousarray(arr)
        _wait(self.comm.Ibcast(buf, root=src))
        if self.rank != src:
            arr[...] = buf
            if back is not None:
                back(arr)
        return t

    def abort(self, reason: str = "") -> None:
        self._why = self._why or reason or "aborted"


class MpiWorkerGroup:
    """Rank 0's view of the other MPI ranks, with WorkerGroup's interface (engine/executor.py)."""

    procs: list = []  # no processes of its own: mpirun owns them

    def __init__(self, world_size: int, args, cfg, device: str, eos_ids, overlap_depth: int, num_threads,
                 timeout_s: float):
        MPI = mpi_module()
        world = MPI.COMM_WORLD
        if world.Get_size() != world_size:
            raise ValueError(f"tensor_parallel_size {world_size} under an MPI runner of {world.Get_size()} ranks: "
                             "they must be equal (leave -tp out under mpirun)")
        self.world_size, self._closed = world_size, False
        self.channel = MpiChannel(world.Dup())
        coll = world.Dup()  # the other ranks duplicate in the same order (worker_main)
        handle = None
        if device == "cpu":
            self.comm = MpiCommunicator(coll)
        else:
            from tallow.parallel.nccl_communicator import NcclCommunicator

            # Each rank's GPU is its local rank: rank 0's entry here, the others' set by themselves.
            self.comm = NcclCommunicator.create([int(str(device).split(":")[-1])] * world_size, timeout_s)
            handle = self.comm.handle
        self.channel.send(("init", dict(args=args, cfg=cfg, device=device, eos_ids=sorted(eos_ids),
                                        overlap_depth=overlap_depth, num_threads=num_threads, handle=handle)))
        if handle is not None:
            self.comm.connect()

    def dead_worker(self) -> Optional[str]:
        return None  # a rank that dies ends the MPI job

    def why_gone(self, wait_s: float = 0.0) -> Optional[str]:
        return None

    def wait_ready(self) -> list[tuple[int, int]]:
        msgs = self.channel.comm.gather(None, root=0)[1:]
        for rank, msg in enumerate(msgs, 1):
            if msg[0] == "error":
                log.debug("tensor-parallel rank %d: %s", rank, msg[2])
                raise ValueError(f"tensor-parallel rank {rank}: {msg[1]}")
        return [(m[1], m[2]) for m in msgs]

    def send(self, cmd: str, payload=None) -> None:
        self.channel.send((cmd, payload))

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.channel.send(("stop", None))
        finally:
            self.comm.close()


def worker_main(world: MpiWorld) -> int:
    """An MPI rank > 0: wait for rank 0's init, build this rank's share, serve rank 0's commands."""
    from tallow.parallel.workers import serve_rank

    MPI = mpi_module()
    comm = MPI.COMM_WORLD
    channel = MpiChannel(comm.Dup())
    coll = comm.Dup()
    _, init = channel.recv()
    handle, device = init["handle"], init["device"]
    ready_sent = False

    def send_ready(msg) -> None:
        nonlocal ready_sent
        ready_sent = True
        channel.comm.gather(msg, root=0)

    try:
        if handle is None:
            group: Communicator = MpiCommunicator(coll)
        else:
            import tallow.cuda
            from tallow.parallel.nccl_communicator import NcclCommunicator

            devices = list(handle.devices)
            devices[world.rank] = world.local_rank
            handle = dataclasses.replace(handle, devices=tuple(devices))
            device = handle.device_of(world.rank)
            tallow.cuda.set_device(world.local_rank)
            group = NcclCommunicator.attach(handle, world.rank)
        set_tp_group(group)
        serve_rank(world.rank, world.size, init["args"], init["cfg"], device, init["eos_ids"], init["overlap_depth"],
                   init["num_threads"], channel.recv, send_ready)
    except BaseException as e:  # noqa: BLE001 - reported to rank 0 at start-up, else the job ends
        traceback.print_exc(file=sys.stderr)
        if not ready_sent:
            channel.comm.gather(("error", f"{type(e).__name__}: {e}".strip(), traceback.format_exc()), root=0)
            return 1
        comm.Abort(1)
    return 0
