"""Ranks 1..N-1 of a tensor-parallel engine, each a spawned process (never forked: the engine process
holds threads and, on a GPU, a CUDA context) holding its Worker: its shard of the model and its slice of
the KV cache.

Rank 0 is the engine's own process, with its Worker in process as at tp=1: the scheduler, the sampler
and the structured-output masks (Executor.execute_model's mask_fn) stay where they were, rank 0's
results need no extra hop, and the tp=1 path is untouched. Each step rank 0 pickles the StepData once
and writes the same bytes to every worker's pipe, then runs its own share; the ranks meet in the
collectives of the forward pass, and rank 0 broadcasts the sampled ids (the other ranks' next inputs,
worker/model_runner.py).

Messages to a worker (pickled (command, payload)): ("cache", num_blocks), ("step", StepData),
("release", request ids), ("embed", EmbedData), ("eos", ids), ("stop", None). A worker answers only at
start-up, ("ready", kv bytes per block, kv budget bytes) or ("error", summary, traceback); an error later
is answered the same way after it aborts the communicator, so rank 0 stops waiting in its collective.

The communicator: on the CPU a ShmCommunicator (shared memory); on GPUs an NcclCommunicator, rank r on
GPU devices[r], every rank joining NCCL as it starts (rank 0 once its workers are spawned).

Faults: a waiting rank 0 checks its workers' exit codes (on GPUs also a monitor thread, which aborts NCCL
so that kernels waiting on a dead peer end); a worker whose engine process is gone (its pipe closes, its
parent pid changes while it waits in a collective, or its watchdog thread sees the parent change) exits;
the daemon flag ends workers with the engine process; the shared-memory segment is unlinked by rank 0 on
shutdown (and by a finalizer at exit)."""
from __future__ import annotations

import faulthandler
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
import traceback
import weakref

from tallow.parallel.communicator import CollectiveError, set_tp_group
from tallow.parallel.shm_communicator import ShmCommunicator, ShmHandle

log = logging.getLogger("tallow.parallel")

READY_TIMEOUT_S = 3600.0  # loading a large checkpoint from a slow disk
WATCH_S = 0.2  # how often the watchdog / monitor threads look at the other processes


def _describe_exit(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"


def _watch_parent(ppid: int) -> None:
    """A worker's watchdog: exit at once when the engine process is gone, wherever the main thread
    waits (a GPU copy behind a collective whose peer died never returns by itself)."""
    while True:
        time.sleep(WATCH_S)
        if os.getppid() != ppid:
            os._exit(1)


def serve_rank(rank: int, world_size: int, args, cfg, device: str, eos_ids, overlap_depth: int, num_threads,
               recv, send_ready) -> None:
    """Build rank `rank`'s Worker (its shard, its KV cache), tell rank 0 it is ready, then run the commands
    recv() returns until "stop". The process's tensor-parallel group is set already. Shared by the spawned
    workers (a pipe) and the ranks mpirun starts on other hosts (parallel/mpi.py)."""
    import dataclasses

    from tallow.engine.executor import graph_batch_size, load_source, worker_config
    from tallow.worker.worker import Worker

    _cfg, source = load_source(args)
    wc = dataclasses.replace(worker_config(args, cfg, device, eos_ids, overlap_depth), tp_rank=rank,
                             tp_size=world_size, num_threads=num_threads)
    worker = Worker(cfg, source, wc)
    # the same profiling steps as rank 0 (their collectives must pair up)
    graph_bs = graph_batch_size(args, device)
    send_ready(("ready", worker.kv_bytes_per_block(),
                worker.kv_budget_bytes(args.mem, args.gpu_memory_fraction, graph_bs)))
    while True:
        cmd, payload = recv()
        if cmd == "step":
            worker.execute_model(payload).result()  # writes rank 0's ids into the request states
        elif cmd == "release":
            worker.release(payload)
        elif cmd == "embed":
            worker.embed(payload)
        elif cmd == "eos":
            worker.runner.eos_ids = set(payload)
        elif cmd == "cache":
            worker.initialize_cache(payload, graph_bs)  # the same decode graphs as rank 0
        elif cmd == "stop":
            return


def _worker_main(rank: int, handle, args, cfg, device: str, eos_ids, overlap_depth: int, num_threads, conn) -> None:
    """A spawned worker process: its communicator, then serve_rank with rank 0's pipe."""
    ppid = os.getppid()
    threading.Thread(target=_watch_parent, args=(ppid,), name="tallow-tp-watchdog", daemon=True).start()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: where a worker waits

    def parent_gone():
        return None if os.getppid() == ppid else "the engine process (rank 0) is gone"

    if isinstance(handle, ShmHandle):
        comm = ShmCommunicator.attach(handle, rank, alive_check=parent_gone)
    else:
        import tallow.cuda
        from tallow.parallel.nccl_communicator import NcclCommunicator

        device = handle.device_of(rank)
        tallow.cuda.set_device(handle.devices[rank])
        comm = NcclCommunicator.attach(handle, rank, alive_check=parent_gone)
    set_tp_group(comm)
    try:
        serve_rank(rank, handle.world_size, args, cfg, device, eos_ids, overlap_depth, num_threads,
                   lambda: pickle.loads(conn.recv_bytes()), conn.send)
    except (EOFError, BrokenPipeError):  # the engine process is gone: nothing to report to
        pass
    except BaseException as e:  # noqa: BLE001 - report, release the other ranks, exit non-zero
        comm.abort()
        try:
            conn.send(("error", f"{type(e).__name__}: {e}".strip(), traceback.format_exc()))
        except OSError:
            pass
        comm.close()
        os._exit(1)
    comm.close()


class WorkerGroup:
    """The worker processes of ranks 1..world_size-1 and the communicator of all ranks (rank 0's end)."""

    def __init__(self, world_size: int, args, cfg, device: str, eos_ids, overlap_depth: int, num_threads,
                 slot_bytes: int, timeout_s: float, device_ids=None):
        """device_ids: the GPU of each rank (NCCL); None on the CPU (shared memory)."""
        self.world_size = world_size
        self.procs: list = []
        self.conns: list = []
        me = weakref.ref(self)  # the communicator must not keep the group alive

        def alive_check():
            group = me()
            return group.dead_worker() if group is not None else None
        if device_ids is None:
            self.comm = ShmCommunicator.create(world_size, slot_bytes, timeout_s, alive_check=alive_check)
        else:
            from tallow.parallel.nccl_communicator import NcclCommunicator

            self.comm = NcclCommunicator.create(list(device_ids), timeout_s, alive_check=alive_check)
        self._closed = False
        self._finalizer = weakref.finalize(self, WorkerGroup._cleanup, self.procs, self.conns, self.comm)
        ctx = multiprocessing.get_context("spawn")
        for rank in range(1, world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, name=f"tallow-tp-rank{rank}", daemon=True,
                            args=(rank, self.comm.handle, args, cfg, device, sorted(eos_ids), overlap_depth,
                                  num_threads, child))
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        if device_ids is not None:
            try:
                self.comm.connect()  # rank 0 joins NCCL (the workers join as they start)
            except BaseException:
                self.shutdown()
                raise
            threading.Thread(target=WorkerGroup._monitor, args=(me,), name="tallow-tp-monitor", daemon=True).start()

    @staticmethod
    def _monitor(ref) -> None:
        """GPUs: abort NCCL as soon as a worker is gone, so that kernels waiting on it end (rank 0 may be
        blocked in a device copy behind them) and the next wait or collective raises CollectiveError."""
        while True:
            time.sleep(WATCH_S)
            group = ref()
            if group is None or group._closed:
                return
            why = group.dead_worker()
            if why is not None:
                group.comm.abort(why)
                return
            del group

    def dead_worker(self):
        """Why a worker is gone (its error, or how it exited), or None while all run."""
        for rank, p in enumerate(self.procs, 1):
            if p.exitcode is not None:
                return self._error_of(rank) or f"tensor-parallel worker rank {rank} (pid {p.pid}) " \
                                               f"{_describe_exit(p.exitcode)}"
        return None

    def why_gone(self, wait_s: float = 2.0):
        """dead_worker(), waiting up to wait_s for a worker whose pipe already closed to be reaped (its
        exit code says how it ended)."""
        deadline = time.monotonic() + wait_s
        while True:
            why = self.dead_worker()
            if why is not None or time.monotonic() > deadline:
                return why
            time.sleep(0.01)

    def _error_of(self, rank: int):
        conn = self.conns[rank - 1]
        try:
            while conn.poll(0):
                msg = conn.recv()
                if msg[0] == "error":
                    log.debug("tensor-parallel worker rank %d: %s", rank, msg[2])
                    return f"tensor-parallel worker rank {rank} failed: {msg[1]}"
        except (EOFError, OSError):
            pass
        return None

    def wait_ready(self) -> list[tuple[int, int]]:
        """(kv bytes per block, kv budget bytes) of each worker, once it has loaded its shard."""
        out = []
        deadline = time.monotonic() + READY_TIMEOUT_S
        for rank, conn in enumerate(self.conns, 1):
            while not conn.poll(0.1):
                why = self.dead_worker()
                if why:
                    raise RuntimeError(why)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel worker rank {rank} did not load within {READY_TIMEOUT_S:g} s")
            try:
                msg = conn.recv()
            except EOFError:
                raise RuntimeError(self.dead_worker() or f"tensor-parallel worker rank {rank} exited") from None
            if msg[0] == "error":
                log.debug("tensor-parallel worker rank %d: %s", rank, msg[2])
                raise ValueError(f"tensor-parallel worker rank {rank}: {msg[1]}")
            out.append((msg[1], msg[2]))
        return out

    def send(self, cmd: str, payload=None) -> None:
        """The same message to every worker (pickled once)."""
        data = pickle.dumps((cmd, payload), protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            try:
                conn.send_bytes(data)
            except OSError:
                raise CollectiveError(self.why_gone() or "a tensor-parallel worker's pipe is closed") from None

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in self.conns:
            try:
                conn.send_bytes(pickle.dumps(("stop", None)))
            except OSError:
                pass
        self._finalizer()

    @staticmethod
    def _cleanup(procs, conns, comm) -> None:
        comm.abort()  # a worker inside a collective stops waiting
        deadline = time.monotonic() + 5
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.exitcode is None:
                p.kill()
                p.join(5)
        for conn in conns:
            conn.close()
        comm.close()
