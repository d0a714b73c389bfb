"""The GPU communicator: NCCL through tallow._core.cuda (cuda/nccl.cpp), one rank per device.

Collectives are queued on the current stream of the tensor's device and return at once, so the decode
CUDA graphs capture them and a step's collectives cost no host round trip. Where they finish is where the
host waits for the step's results: `wait(event)` polls the event instead of blocking in the driver, so a
rank that dies (or a collective stuck past the timeout) becomes a CollectiveError rather than a hang.
abort() (a monitor thread of rank 0, or a failing rank) calls ncclCommAbort, which also ends kernels
already waiting on a dead peer.

The library: TALLOW_NCCL_LIBRARY when set, else libnccl.so.2 of an installed nvidia-nccl wheel, else the
system's (the dynamic linker's search). The unique id is made by rank 0 and travels to the other ranks
with their start-up arguments (NcclHandle), or through MPI across hosts."""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import threading
import time
from typing import Callable, Optional

import tallow
import tallow.cuda
from tallow import envs
from tallow.parallel.communicator import CollectiveError, Communicator

_POLL_S = 20e-6  # between event polls while the host waits for a step (sub-step latency matters)
# All-reduces up to this size go through the one-shot IPC kernel (cuda/ipc_allreduce.cu) when every GPU
# reaches the others' memory (NVLink / P2P); larger ones, and machines without peer access, use NCCL.
IPC_ALLREDUCE_MAX_BYTES = 512 * 1024
_IPC_DTYPES = (tallow.float32, tallow.float16, tallow.bfloat16)
_CHECK_S = 0.05  # how often a waiting rank checks its peers' liveness


@dataclasses.dataclass(frozen=True)
class NcclHandle:
    """What a rank needs to join (plain data, sent to the worker processes)."""
    unique_id: bytes
    world_size: int
    devices: tuple  # CUDA device index of each rank
    library: str
    timeout_s: float

    def device_of(self, rank: int) -> str:
        return f"cuda:{self.devices[rank]}"


def find_nccl_library() -> str:
    """Path of libnccl.so.2 to open: TALLOW_NCCL_LIBRARY, else an nvidia wheel's copy, else '' (the
    dynamic linker's default search)."""
    path = envs.TALLOW_NCCL_LIBRARY
    if path:
        return path
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    for root in list(spec.submodule_search_locations or []) if spec else []:
        for sub in ("nccl", "cu13", "cu12"):
            cand = os.path.join(root, sub, "lib", "libnccl.so.2")
            if os.path.exists(cand):
                return cand
    return ""


def load_nccl() -> str:
    """Open NCCL once in this process; returns the path used. RuntimeError with one clear line if none.
    NVLink multicast (NVLS) stays off unless the user sets NCCL_NVLS_ENABLE: the spawned ranks inherit
    this environment (on the machines tallow is developed on it must be off)."""
    if envs.NCCL_NVLS_ENABLE is None:
        envs.export("NCCL_NVLS_ENABLE", "0")
    core = tallow._core.cuda
    path = find_nccl_library()
    if not core.nccl_loaded():
        try:
            core.nccl_load(path)
        except RuntimeError as e:
            raise RuntimeError(f"tensor parallelism on GPUs needs NCCL 2.9+: {e}; install it (pip install "
                               "nvidia-nccl-cu13) or point TALLOW_NCCL_LIBRARY at libnccl.so.2") from None
    return path


def nccl_version() -> str:
    v = tallow._core.cuda.nccl_version()
    major, rest = divmod(v, 10000)
    return f"{major}.{rest // 100}.{rest % 100}"


class NcclCommunicator(Communicator):
    def __init__(self, handle: NcclHandle, rank: int, alive_check: Optional[Callable[[], Optional[str]]] = None):
        """Use create() (rank 0) then connect(), or attach() (the other ranks)."""
        self.handle, self.rank, self.world_size = handle, rank, handle.world_size
        self.device = handle.device_of(rank)
        self.alive_check = alive_check  # returns why a peer is gone, or None
        self._comm = None
        self._ipc = None  # the one-shot IPC all-reduce (small messages), when every GPU reaches the others
        self._why: Optional[str] = None  # set once aborted

    @classmethod
    def create(cls, devices: list[int], timeout_s: float,
               alive_check: Optional[Callable[[], Optional[str]]] = None) -> "NcclCommunicator":
        library = load_nccl()
        uid = tallow._core.cuda.nccl_unique_id()
        return cls(NcclHandle(uid, len(devices), tuple(int(d) for d in devices), library, float(timeout_s)), 0,
                   alive_check)

    @classmethod
    def attach(cls, handle: NcclHandle, rank: int,
               alive_check: Optional[Callable[[], Optional[str]]] = None) -> "NcclCommunicator":
        comm = cls(handle, rank, alive_check)
        comm.connect()
        return comm

    def connect(self) -> None:
        """ncclCommInitRank, which waits for every rank: run in a thread while this one watches the peers
        (a rank that died before joining would leave it waiting forever), then one small all-reduce so
        that NCCL sets up its connections outside any graph capture."""
        if not tallow._core.cuda.nccl_loaded():
            tallow._core.cuda.nccl_load(self.handle.library)
        idx = self.handle.devices[self.rank]
        tallow.cuda.set_device(idx)  # this process's GPU (the probe's event is recorded on its stream)
        box: dict = {}

        def init():
            try:
                box["comm"] = tallow._core.cuda.NcclComm(self.handle.unique_id, self.world_size, self.rank, idx)
            except BaseException as e:  # noqa: BLE001 - re-raised by the waiting thread
                box["error"] = e
        th = threading.Thread(target=init, name="tallow-nccl-init", daemon=True)
        th.start()
        deadline = time.monotonic() + max(self.handle.timeout_s, 600.0)  # the others may still be importing
        while th.is_alive():
            th.join(_CHECK_S)
            why = self.alive_check() if self.alive_check is not None else None
            if why is None and time.monotonic() > deadline:
                why = "the ranks did not all join NCCL in time"
            if why is not None and th.is_alive():
                raise CollectiveError(f"NCCL start-up of rank {self.rank}: {why}")
        if "error" in box:
            raise CollectiveError(f"NCCL start-up of rank {self.rank}: {box['error']}")
        self._comm = box["comm"]
        probe = tallow.ops.fill_uniform_(tallow.empty([self.world_size], tallow.float32, self.device), 1.0, 1.0, 0)
        self.all_reduce(probe)
        self._ipc = self._open_ipc(idx)
        ev = tallow.cuda.Event()
        ev.record()
        self.wait(ev)

    def _open_ipc(self, idx: int):
        """The IPC all-reduce for small messages, or None. Every rank's buffer handle is all-gathered over
        NCCL; a rank that cannot map its peers' buffers (no peer access) says so in a second all-gather,
        and then all ranks stay with NCCL (their collectives must stay paired)."""
        import numpy as np

        core = tallow._core.cuda
        if self.world_size > 8:  # the kernel's largest world
            return None
        ipc, ok = None, 1
        mine = np.zeros(64, np.uint8)
        if (envs.NCCL_P2P_DISABLE or "0").strip() not in ("", "0"):
            ok = 0  # peer access is off for NCCL (separate hosts simulated on one machine): off here too
        else:
            try:
                ipc = core.IpcAllReduce(idx, self.rank, self.world_size, IPC_ALLREDUCE_MAX_BYTES)
                mine = np.frombuffer(ipc.handle(), dtype=np.uint8).copy()
            except RuntimeError:
                ok = 0
        every = self.all_gather(tallow.from_numpy(mine).to(self.device), dim=0).to("cpu").numpy()
        if ok:
            try:
                ipc.open([every[64 * r:64 * (r + 1)].tobytes() for r in range(self.world_size)])
            except RuntimeError:
                ok = 0
        flags = self.all_gather(tallow.from_numpy(np.array([ok], np.int32)).to(self.device), dim=0).to("cpu").numpy()
        return ipc if flags.all() else None

    # -- collectives (queued on the current stream) ----------------------------------------------------
    def _live(self):
        if self._why is not None:
            raise CollectiveError(self._why)
        return self._comm

    def all_reduce(self, t: tallow.Tensor) -> tallow.Tensor:
        comm = self._live()
        # The path depends only on what every rank's tensor shares (dtype, size), never on where this
        # rank's copy sits: ranks taking different paths would wait on each other forever.
        if self._ipc is None or t.dtype not in _IPC_DTYPES or t.nbytes > IPC_ALLREDUCE_MAX_BYTES or t.nbytes % 16:
            comm.all_reduce(t)
        elif self._ipc.supports(t):
            self._ipc.all_reduce(t)
        else:  # a strided or unaligned view: through a fresh (aligned, contiguous) copy
            tmp = t.clone()
            self._ipc.all_reduce(tmp)
            t.copy_(tmp)
        return t

    def all_gather(self, t: tallow.Tensor, dim: int = -1) -> tallow.Tensor:
        comm = self._live()
        t = t.contiguous()
        shape = list(t.shape)
        dim = dim % len(shape)
        parts = tallow.empty([self.world_size] + shape, t.dtype, t.device)
        comm.all_gather(parts, t)
        if dim == 0:
            return parts.reshape([self.world_size * shape[0]] + shape[1:])
        order = list(range(1, dim + 1)) + [0] + list(range(dim + 1, len(shape) + 1))
        out = parts.permute(order).contiguous()  # [..., world, shape[dim], ...]
        return out.reshape(shape[:dim] + [self.world_size * shape[dim]] + shape[dim + 1:])

    def broadcast(self, t: tallow.Tensor, src: int = 0) -> tallow.Tensor:
        self._live().broadcast(t, src)
        return t

    # -- waiting and failing ----------------------------------------------------------------------------
    def wait(self, event) -> None:
        """Wait for `event` (recorded after a step's collectives) without blocking in the driver: a dead
        peer, NCCL's own error or the timeout aborts the communicator and raises CollectiveError."""
        if event.query():
            self._live()
            return
        deadline = time.monotonic() + self.handle.timeout_s
        next_check = time.monotonic() + _CHECK_S
        while not event.query():
            time.sleep(_POLL_S)
            now = time.monotonic()
            if now < next_check:
                continue
            next_check = now + _CHECK_S
            why = self._why or (self.alive_check() if self.alive_check is not None else None)
            if why is None and self._comm is not None:
                why = self._comm.async_error() or None
            if why is None and now > deadline:
                why = f"a collective did not complete within {self.handle.timeout_s:g} s (a stuck rank)"
            if why is not None:
                self.abort(why)
                raise CollectiveError(why)
        self._live()

    def abort(self, reason: str = "") -> None:
        if self._why is None:
            self._why = reason or "aborted"
        if self._comm is not None:
            self._comm.abort()

    @property
    def aborted(self) -> bool:
        return self._why is not None

    def close(self) -> None:
        self._ipc = None
        self._comm = None  # ncclCommDestroy (or nothing after an abort) when the last reference goes
