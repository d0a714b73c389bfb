"""The API server's side of an engine core in its own process (vLLM v1's AsyncLLM): the same
interface as AsyncEngine (add_request -> RequestStream, abort, embed, is_running, dead_error,
num_unfinished, stats, tokenizer, shutdown), with input and output processing done here, in the API
process, and the scheduler, KV cache and model in the engine-core process (core_process.py).

    client = await EngineCoreClient.launch(EngineArgs(model=...))   # spawns the core, waits for it
    stream = await client.add_request(prompt, params, request_id)
    async for delta in stream: ...
    await client.shutdown()

Why a process: the step loop and the HTTP event loop in one interpreter fight over the GIL; on a GPU,
where a step is short and mostly Python, that hand-off made tokens arrive in bursts (issue 26's
figures). Here the event loop holds the GIL alone: it tokenizes (large prompts in a thread),
sends a request (one msgpack message), and for each step receives one message with every request's
new tokens, detokenizes them, finds stop strings (and tells the core to stop those), and feeds the
streams. Tokenization happens once, here; the core never sees text.

The core dying (an exception, or killed) turns is_running false, fails every in-flight stream and
embeddings call with EngineDeadError and calls the on_dead callbacks (the server ends itself).
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import shutil
import tempfile
import time
import types
from typing import Any, Callable, Optional

import numpy as np

from tallow.engine.async_engine import RequestStream, _aborted_output
from tallow.engine.engine import make_request_group
from tallow.engine.errors import EngineDeadError, EngineStepError, KVCacheFullError

log = logging.getLogger("tallow.engine")

# A text prompt longer than this is tokenized in a worker thread, not on the event loop.
INLINE_TOKENIZE_CHARS = 4096
WATCHDOG_S = 0.5  # how often the core process's liveness is checked
# Step messages handled back to back when the API process is behind, before the streams write: a
# stream then sends the steps' tokens in one chunk (RequestStream.merge), which is how one process
# catches up, at the price of longer gaps. H100, Qwen3-0.6B shape, 256 streams, one API process
# (benchmarks/results/serve_h100/cap_experiment): 1 -> 84.4% of offline tok/s, ITL p99 27.9 ms;
# 3 -> 96.8%, 64.8 ms; 8 -> 96.6%, 97.5 ms. (--api-server-count 2: 101.7%, 46.8 ms.)
MAX_STEPS_PER_TURN = 3


@dataclasses.dataclass
class CoreAddresses:
    inp: str
    outs: list[str]
    pid: int = 0


def start_engine_core(args, num_clients: int = 1) -> tuple[multiprocessing.Process, CoreAddresses, str]:
    """Spawn the engine-core process (never forked: CUDA and threads do not survive a fork); returns
    (process, its ZMQ addresses, the temporary folder holding the ipc sockets)."""
    from tallow.engine.core_process import run_engine_core

    tmp = tempfile.mkdtemp(prefix="tallow-core-")
    addrs = CoreAddresses(f"ipc://{tmp}/in", [f"ipc://{tmp}/out{i}" for i in range(num_clients)])
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=run_engine_core, args=(args, addrs.inp, addrs.outs, logging.getLogger().level or 20),
                       name="tallow-engine-core", daemon=False)
    proc.start()
    addrs.pid = proc.pid
    return proc, addrs, tmp


class EngineCoreClient:
    """One API process's connection to the engine core. Use ``launch`` (spawns the core) or, for an
    extra API server process, ``connect`` with the addresses the first one got."""

    structured_output = True  # the core's EngineCore honours SamplingParams.structured_outputs

    def __init__(self, args, addrs: CoreAddresses, client_index: int = 0,
                 proc: Optional[multiprocessing.Process] = None, tmpdir: Optional[str] = None, loaded=None):
        from tallow.engine.core import load_model_source
        from tallow.engine.input_processor import InputProcessor
        from tallow.engine.output_processor import OutputProcessor
        from tallow.tokenizer.byte_level import byte_table

        self.args, self.addrs, self.index = args, addrs, client_index
        self._proc, self._tmpdir = proc, tmpdir
        self.input_processor = InputProcessor(args, None, 0, 0)  # validates the server-wide defaults
        cfg, src, tok = loaded or load_model_source(args)
        self.input_processor.use_generation_config(src.generation_config_path)
        byte_table(tok)
        self.config, self.tokenizer = cfg, tok
        self.output_processor = OutputProcessor(tok)
        self.engine = types.SimpleNamespace(config=cfg, tokenizer=tok, max_model_len=0, dtype="", source=src)
        self.stats: dict[str, Any] = {}
        self._streams: dict[str, RequestStream] = {}
        self._embed_futs: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._job_ids = itertools.count()
        self._dead: Optional[BaseException] = None
        self._stopping = False
        self._tasks: list[asyncio.Task] = []
        self.on_dead: list[Callable[[BaseException], None]] = []
        self._ctx = self._push = self._pull = None

    # -- lifecycle -------------------------------------------------------------------------------
    @classmethod
    async def launch(cls, args, num_clients: int = 1, ready_timeout: Optional[float] = None) -> "EngineCoreClient":
        """Spawn the core and connect to it as client 0; returns once the model is loaded."""
        proc, addrs, tmp = start_engine_core(args, num_clients)
        try:
            client = await asyncio.to_thread(cls, args, addrs, 0, proc, tmp)
            await client.start(ready_timeout)
        except BaseException:
            _stop_process(proc)
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return client

    async def start(self, ready_timeout: Optional[float] = None) -> None:
        import msgspec
        import zmq
        import zmq.asyncio

        self._zmq = zmq
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder()
        self._ctx = zmq.asyncio.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)  # small messages; never block the event loop on a send
        self._push.setsockopt(zmq.LINGER, 1000)
        self._push.connect(self.addrs.inp)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.connect(self.addrs.outs[self.index])
        self._loop = asyncio.get_running_loop()
        watchdog = asyncio.ensure_future(self._watch())
        try:
            msg = await asyncio.wait_for(self._recv_ready(), ready_timeout)
        except BaseException:
            watchdog.cancel()
            raise
        info = msg[1]
        self.max_model_len = int(info["max_model_len"])
        ip = self.input_processor
        ip.tokenizer, ip.vocab_size, ip.max_model_len = self.tokenizer, self.config.vocab_size, self.max_model_len
        self.engine.max_model_len, self.engine.dtype = self.max_model_len, info["dtype"]
        self.engine.eos_ids = set(info["eos_ids"])
        self._tasks = [watchdog, asyncio.ensure_future(self._output_loop())]
        _freeze_startup_heap()

    async def _recv_ready(self):
        while True:
            msg = self._dec.decode(await self._pull.recv())
            if msg[0] == "ready":
                return msg
            if msg[0] == "dead":
                raise EngineDeadError(f"the engine core failed while loading: {msg[1]}")
            if self._dead is not None:
                raise self._dead

    @property
    def is_running(self) -> bool:
        return self._dead is None and not self._stopping and bool(self._tasks)

    @property
    def dead_error(self) -> Optional[BaseException]:
        return self._dead

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine has stopped: {self._dead}")
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")

    async def shutdown(self, timeout: float = 30.0) -> None:
        if self._stopping:
            return
        self._stopping = True
        if self._push is not None and self._dead is None:
            try:
                self._push.send(self._enc.encode(("shutdown",)), self._zmq.NOBLOCK)
            except Exception:  # noqa: BLE001 - the core is gone already
                pass
        if self._proc is not None:
            await asyncio.to_thread(_stop_process, self._proc, timeout)
        for t in self._tasks:
            t.cancel()
        self._fail_everything(EngineDeadError("the engine shut down"))
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    # -- requests --------------------------------------------------------------------------------
    def _send(self, msg) -> None:
        self._push.send(self._enc.encode(msg), copy=False)

    async def _process_input(self, prompt, params):
        ip = self.input_processor
        text = prompt if isinstance(prompt, str) else (prompt.get("prompt") if isinstance(prompt, dict) else None)
        if isinstance(text, str) and len(text) > INLINE_TOKENIZE_CHARS:
            return await asyncio.to_thread(ip.process, prompt, params)
        return ip.process(prompt, params)

    async def add_request(self, prompt, params=None, request_id: Optional[str] = None,
                          arrival_time: Optional[float] = None) -> RequestStream:
        """Validate, tokenize and queue a request; returns its stream of delta RequestOutputs.
        ValueError (nothing queued) for a bad prompt or parameters."""
        self._check_alive()
        request_id = request_id or f"req-{self.index}-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids, params = await self._process_input(prompt, params)
        self._check_alive()
        op = self.output_processor
        if request_id in self._streams or request_id in op.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        group, creq, seqs = make_request_group(request_id, text, ids, params)
        op.add_request(group, seqs)
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream
        self._send(("add", self.index, request_id, ids, [(rid, _params_dict(p)) for rid, p in seqs],
                    arrival_time or time.monotonic()))
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (the client went away); its blocks return to the pool at the core's next
        loop turn; a reader of its stream sees it end."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.finished = True
            stream._queue.put_nowait(_aborted_output(request_id))
        rids = self.output_processor.abort_request(request_id)
        if rids and self._dead is None and not self._stopping:
            self._send(("abort", rids))

    async def embed(self, prompts, pooling: str = "last", normalize: bool = True):
        """(float32 vector, number of tokens) per prompt, computed by the core in prefill-sized chunks
        between steps; cancelling the call drops the job there."""
        self._check_alive()
        if pooling not in ("last", "mean"):
            raise ValueError(f"pooling must be 'last' or 'mean', got {pooling!r}")
        ip = self.input_processor
        big = sum(len(p) if isinstance(p, str) else len(p.get("prompt") or "") if isinstance(p, dict) else 0
                  for p in prompts) > INLINE_TOKENIZE_CHARS
        encoded = await asyncio.to_thread(ip.embedding_inputs, prompts) if big else ip.embedding_inputs(prompts)
        self._check_alive()
        job = next(self._job_ids)
        fut = self._loop.create_future()
        self._embed_futs[job] = fut
        self._send(("embed", self.index, job, encoded, pooling, normalize))
        try:
            vecs = await fut
        except asyncio.CancelledError:
            if self._dead is None and not self._stopping:
                self._send(("abort_embed", job))
            raise
        finally:
            self._embed_futs.pop(job, None)
        return [(np.frombuffer(v, dtype=np.float32), len(ids)) for v, ids in zip(vecs, encoded)]

    # -- what the core sends -----------------------------------------------------------------------
    async def _output_loop(self) -> None:
        dec, pull, zmq = self._dec, self._pull, self._zmq
        taken = 0
        try:
            while True:
                frame = await pull.recv(copy=False)
                self._handle(dec.decode(frame.buffer))
                taken += 1
                # Let the streams write this step before taking the next, unless steps are waiting (this
                # process is behind): then a few more first, which each stream writes as one chunk.
                if taken >= MAX_STEPS_PER_TURN or not pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    taken = 0
                    await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a bug here would hang every stream: fail them instead
            log.exception("the engine client's output loop failed")
            self._die(EngineDeadError(f"the engine client failed: {type(e).__name__}: {e}"))

    def _handle(self, msg) -> None:
        kind = msg[0]
        if kind == "out":
            _, outs, plp, stats = msg
            self.stats = stats
            outputs, stopped = self.output_processor.process(outs, plp)
            if stopped:
                self._send(("stop", stopped))
            streams = self._streams
            for out in outputs:
                stream = streams.get(out.request_id)
                if stream is None:
                    continue  # aborted meanwhile
                stream._put(out)
                if out.finished:
                    del streams[out.request_id]
        elif kind == "stats":
            self.stats = msg[1]
        elif kind == "embed":
            _, job, vecs, err_kind, message = msg
            fut = self._embed_futs.get(job)
            if fut is None or fut.done():
                return
            if vecs is not None:
                fut.set_result(vecs)
            elif err_kind == "kv_full":
                fut.set_exception(KVCacheFullError(message))
            else:
                fut.set_exception(EngineStepError(f"the embeddings pass failed: {message}"))
        elif kind == "fail":
            _, rids, message = msg
            err = EngineStepError(message)
            op = self.output_processor
            groups = {op.seq_of[r][0].request_id for r in rids if r in op.seq_of}
            for gid in groups:
                op.abort_request(gid)
                stream = self._streams.pop(gid, None)
                if stream is not None:
                    stream._put(err)
            self.stats = dict(self.stats, step_errors=self.stats.get("step_errors", 0) + 1)
        elif kind == "dead":
            self._die(EngineDeadError(f"the engine core failed: {msg[1]}"))
        elif kind == "ready":
            pass
        else:
            log.error("engine client: unknown message %r", kind)

    async def _watch(self) -> None:
        """Notice a core that died without a word (killed, out of memory)."""
        while self._dead is None:
            await asyncio.sleep(WATCHDOG_S)
            if self._stopping:
                return
            code = _exit_code(self._proc, self.addrs.pid)
            if code is not None:
                self._die(EngineDeadError(f"the engine core process exited (code {code})"))
                return

    def _die(self, err: BaseException) -> None:
        if self._dead is not None or self._stopping:
            return
        log.error("%s", err)
        self._dead = err
        self._fail_everything(err)
        for t in self._tasks:
            if t is not asyncio.current_task():
                t.cancel()
        for cb in list(self.on_dead):
            try:
                cb(err)
            except Exception:  # noqa: BLE001
                log.exception("an on_dead callback failed")

    def _fail_everything(self, err: BaseException) -> None:
        for rid, stream in list(self._streams.items()):
            stream.finished = True
            stream._queue.put_nowait(err)
            self.output_processor.abort_request(rid)
        self._streams.clear()
        for fut in list(self._embed_futs.values()):
            if not fut.done():
                fut.set_exception(err)


def _freeze_startup_heap() -> None:
    """Everything alive once the client is up (the tokenizer's tables: ~550k entries at a 152k vocabulary)
    moves to the collector's permanent generation, and the youngest generation is collected every 50,000
    allocations, as the engine core does on a GPU (TALLOW_GC_FREEZE): each step allocates per stream, and
    with 256 streams the collections took ~11% of this process's CPU (benchmarks/bench_api_process.py)."""
    import gc

    from tallow import envs

    if envs.TALLOW_GC_FREEZE:
        gc.collect()
        gc.freeze()
        young, middle, old = gc.get_threshold()
        gc.set_threshold(max(young, 50_000), middle, old)


def _params_dict(p) -> dict:
    d = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}
    if d["logit_bias"]:
        d["logit_bias"] = {int(k): float(v) for k, v in d["logit_bias"].items()}
    if d["structured_outputs"] is not None:
        d["structured_outputs"] = d["structured_outputs"].to_dict()
    return d


def _exit_code(proc: Optional[multiprocessing.Process], pid: int) -> Optional[int]:
    """The core's exit code once it has exited, else None."""
    if proc is not None:
        return proc.exitcode
    try:  # a process we did not start (another API server's core): gone or a zombie
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return -1 if state in ("Z", "X") else None
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return -1
    except OSError:
        return None


def _stop_process(proc: multiprocessing.Process, timeout: float = 30.0) -> None:
    proc.join(timeout)
    if proc.is_alive():
        proc.terminate()
        proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


__all__ = ["EngineCoreClient", "CoreAddresses", "start_engine_core"]
