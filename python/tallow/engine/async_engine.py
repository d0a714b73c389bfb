"""AsyncEngine: an LLMEngine behind an asyncio interface, its step loop in a thread.

    engine = AsyncEngine.from_engine_args(EngineArgs(model=...))   # or AsyncEngine(LLMEngine(...))
    stream = await engine.add_request(prompt, params, request_id)   # ValueError: nothing queued
    async for delta in stream:                                       # delta RequestOutputs
        ...
    engine.abort(request_id)        # e.g. the client went away: KV blocks freed before the next step
    await engine.shutdown()

The step loop runs in its own thread, never on the event loop: the loop only queues commands
(add, abort, call) and receives each step's outputs in one batch through ``call_soon_threadsafe``,
so HTTP handling never waits for a model step. The LLMEngine is touched only by that thread.

`tallow serve` does not use this class: it runs the engine core in its own process
(core_client.EngineCoreClient, the same interface), because a step thread and the HTTP event loop
in one interpreter fight over the GIL. On an H100 (Qwen3-0.6B shape, 256 streams of 256 tokens) this
thread reached 62% of the offline output throughput (issue 26, at 0ee8c76) and the process 86% (102% with two API server
processes); results: benchmarks/results/serve_h100/. This class stays for what runs in one process:
tests drive the HTTP layer with it (and with scripted engines), and it needs no ZMQ. While it runs,
Python's GIL switch interval is 0.1 ms (GIL_SWITCH_INTERVAL): with the default 5 ms the event loop
fell behind the step thread and streamed tokens arrived in bursts.

Failures: a ValueError from LLMEngine.add_request (bad prompt or parameters) is raised by
``add_request`` to its caller. An exception inside a step fails every request the engine held at
that point (a step is one batch; any of them may be the cause): each is aborted (its blocks freed)
and its stream raises EngineStepError, so nothing hangs; the engine then serves new requests. If
the step thread itself dies, every stream and every later call raises EngineDeadError.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import sys
import threading
import time
from typing import Any, Callable, Optional

from tallow.engine.errors import EngineDeadError, EngineStepError
from tallow.engine.outputs import RequestOutput

log = logging.getLogger("tallow.engine")

__all__ = ["AsyncEngine", "RequestStream", "EngineDeadError", "EngineStepError"]

# The GIL hand-off interval while an AsyncEngine runs (Python's default is 5 ms). Every socket write of
# the event loop releases the GIL and must win it back from the step thread, which gives it up only
# when this interval has passed (kernels hold it while they run): with 5 ms, streamed tokens arrive in
# bursts and the loop falls behind (see the figures above).
GIL_SWITCH_INTERVAL = 1e-4


class _Mailbox:
    """asyncio.Queue's put_nowait / get / empty for one reader, cheaper per item (this is per token per
    stream): a deque, and a future only while the reader waits."""

    __slots__ = ("items", "waiter")

    def __init__(self):
        self.items: collections.deque = collections.deque()
        self.waiter: Optional[asyncio.Future] = None

    def put_nowait(self, item) -> None:
        self.items.append(item)
        w = self.waiter
        if w is not None:
            self.waiter = None
            if not w.done():  # done: the reader was cancelled while it waited
                w.set_result(None)

    def empty(self) -> bool:
        return not self.items

    async def get(self):
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        return self.items.popleft()


class RequestStream:
    """Async iterator of one request's delta RequestOutputs; ends after the finished one.

    With ``merge`` set, a reader that is behind gets the deltas waiting for it merged into one (one SSE
    chunk and one socket write instead of one per step: what lets a busy API process catch up). Only
    for readers to whom any split of the text is the same: not one that stops reading mid-way on what
    the text says (a forced tool call ends the request where the call ends).

    Leaving the iteration early (break, an exception, task cancellation) does not abort the request
    by itself: call ``abort()`` (or use ``async with``), which the server does in a ``finally``."""

    def __init__(self, engine: "AsyncEngine", request_id: str):
        self.request_id = request_id
        self._engine = engine
        self._queue = _Mailbox()
        self.finished = False
        self.merge = False
        self.arrival_time = time.monotonic()

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        q = self._queue
        if self.finished and not q.items:
            raise StopAsyncIteration
        item = q.items.popleft() if q.items else await q.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if q.items and self.merge and item.delta:
            item = _merge_pending(item, q.items)
        if item.finished:
            self.finished = True
        return item

    def _put(self, item) -> None:
        self._queue.put_nowait(item)

    def abort(self) -> None:
        """Abort the request unless it has finished; idempotent."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.abort()


def _merge_pending(first: RequestOutput, pending: collections.deque) -> RequestOutput:
    """first with the delta RequestOutputs at the head of pending appended to it (taken off pending;
    an exception stays there for the next read). New lists for the merged fields: never appended to
    in place, as the engine may still hold them."""
    outs = {o.index: o for o in first.outputs}
    last = first
    while pending and isinstance(pending[0], RequestOutput) and pending[0].delta and not last.finished:
        last = pending.popleft()
        for o in last.outputs:
            m = outs.get(o.index)
            if m is None:
                outs[o.index] = o
                continue
            m.text += o.text
            m.token_ids = m.token_ids + o.token_ids
            if o.logprobs:
                m.logprobs = (m.logprobs or []) + o.logprobs
            m.cumulative_logprob = o.cumulative_logprob
            if o.finish_reason is not None:
                m.finish_reason, m.stop_reason = o.finish_reason, o.stop_reason
        if last.prompt_logprobs is not None:
            first.prompt_logprobs = last.prompt_logprobs
    if last is not first:
        first.outputs = sorted(outs.values(), key=lambda o: o.index) if len(outs) > 1 else list(outs.values())
        first.finished, first.num_cached_tokens = last.finished, last.num_cached_tokens
    return first


class AsyncEngine:
    """Runs an LLMEngine's step loop in a daemon thread. The engine may be any object with the
    LLMEngine interface used here (add_request, step, abort_request, has_unfinished_requests,
    tokenizer); tests drive the server with a scripted one."""

    @property
    def structured_output(self) -> bool:
        """Whether the engine honours SamplingParams.structured_outputs (test doubles may not)."""
        return bool(getattr(self.engine, "structured_output", False))

    def __init__(self, engine, *, start: bool = True, switch_interval: Any = "default"):
        """switch_interval: the GIL hand-off interval to use while the engine runs ("default":
        GIL_SWITCH_INTERVAL; None leaves Python's setting alone)."""
        self.engine = engine
        self._switch_interval = GIL_SWITCH_INTERVAL if switch_interval == "default" else switch_interval
        self._old_switch_interval: Optional[float] = None
        self.tokenizer = getattr(engine, "tokenizer", None)
        self._cond = threading.Condition()
        self._cmds: collections.deque = collections.deque()
        self._stop = False
        self._dead: Optional[BaseException] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._streams: dict[str, RequestStream] = {}  # touched only on the event loop
        self._ids = itertools.count()
        self._thread: Optional[threading.Thread] = None
        self.num_step_errors = 0
        # called on the event loop once the engine is dead for good (a tensor-parallel rank died: every
        # later step would fail too); `tallow serve` ends itself through one, as with the core process
        self.on_dead: list[Callable[[BaseException], None]] = []
        self.stats: dict[str, Any] = {}
        self._publish_stats()
        if start:
            self.start()

    @classmethod
    def from_engine_args(cls, args) -> "AsyncEngine":
        from tallow.engine.engine import LLMEngine

        return cls(LLMEngine(args))

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            if self._switch_interval and sys.getswitchinterval() > self._switch_interval:
                self._old_switch_interval = sys.getswitchinterval()
                sys.setswitchinterval(self._switch_interval)
            self._thread = threading.Thread(target=self._run, name="tallow-engine", daemon=True)
            self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop and self._dead is None

    @property
    def dead_error(self) -> Optional[BaseException]:
        return self._dead

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine has stopped: {self._dead}")
        if self._stop:
            raise EngineDeadError("the engine is shutting down")

    def shutdown_nowait(self) -> None:
        """Ask the step thread to stop after its current step; requests still running are aborted
        (their blocks freed) and their streams raise EngineDeadError."""
        with self._cond:
            self._stop = True
            self._cond.notify()

    def join(self, timeout: Optional[float] = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    async def shutdown(self, timeout: Optional[float] = 30.0) -> None:
        self.shutdown_nowait()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)
        if self._old_switch_interval is not None and sys.getswitchinterval() == self._switch_interval:
            sys.setswitchinterval(self._old_switch_interval)
            self._old_switch_interval = None
        err = EngineDeadError("the engine shut down")
        for stream in list(self._streams.values()):
            stream.finished = True
            stream._queue.put_nowait(err)
        self._streams.clear()

    # -- requests (event loop side) --------------------------------------------------------------
    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None or self._loop.is_closed():
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("AsyncEngine is bound to another event loop")
        return loop

    def _submit(self, cmd: tuple) -> None:
        with self._cond:
            self._check_alive()
            self._cmds.append(cmd)
            self._cond.notify()

    async def add_request(self, prompt, params=None, request_id: Optional[str] = None) -> RequestStream:
        """Queue a request; returns its stream of delta RequestOutputs. Validation errors of the
        engine (ValueError) are raised here, and then nothing is queued."""
        self._bind_loop()
        self._check_alive()
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream
        fut: concurrent.futures.Future = concurrent.futures.Future()
        try:
            self._submit(("add", prompt, params, request_id, fut))
            await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            # The caller went away while the request was being queued: make sure it does not run.
            self._streams.pop(request_id, None)
            self._abort_cmd(request_id)
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (from the event loop thread). Its KV blocks go back to the pool before
        the next step; its stream, if someone still reads it, ends."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.finished = True
            stream._queue.put_nowait(_aborted_output(request_id))
        self._abort_cmd(request_id)

    def _abort_cmd(self, request_id: str) -> None:
        with self._cond:
            if self._dead is None and not self._stop:
                self._cmds.append(("abort", request_id))
                self._cond.notify()

    async def run_in_engine(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(llm_engine) on the step thread between two steps (e.g. embeddings, or reading
        state consistently) and return its result or raise its exception."""
        self._bind_loop()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(("call", fn, fut))
        return await asyncio.wrap_future(fut)

    async def embed(self, prompts, pooling: str = "last", normalize: bool = True):
        return await self.run_in_engine(lambda eng: eng.embed(prompts, pooling=pooling, normalize=normalize))

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    # -- the step thread -------------------------------------------------------------------------
    def _take_commands(self) -> list:
        with self._cond:
            while not self._cmds and not self._stop and not self._has_work():
                self._cond.wait()
            cmds = list(self._cmds)
            self._cmds.clear()
            return cmds

    def _has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def _apply(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, prompt, params, request_id, fut = cmd
            if not fut.set_running_or_notify_cancel():
                return
            try:
                self.engine.add_request(prompt, params, request_id)
            except BaseException as e:  # validation: the caller gets it
                fut.set_exception(e)
            else:
                fut.set_result(request_id)
        elif kind == "abort":
            self.engine.abort_request(cmd[1])
        elif kind == "call":
            _, fn, fut = cmd
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn(self.engine))
            except BaseException as e:
                fut.set_exception(e)

    def _run(self) -> None:
        try:
            while True:
                cmds = self._take_commands()
                for cmd in cmds:
                    self._apply(cmd)
                if self._stop:
                    break
                if not self._has_work():
                    self._publish_stats()
                    continue
                try:
                    outputs = self.engine.step()
                except EngineDeadError as e:  # the engine cannot step again
                    self._fail_all(e)
                    self._dead = e
                    for cb in list(self.on_dead):
                        self._post(cb, e)
                    break
                except Exception as e:  # noqa: BLE001 - any failure of a step fails its requests
                    self._fail_all(e)
                    continue
                self._publish_stats()
                if outputs:
                    self._post(self._dispatch, outputs)
        except BaseException as e:  # a bug in the loop itself: nothing can be served any more
            log.exception("the engine's step thread died")
            self._dead = e
        finally:
            self._drain_on_exit()

    def _fail_all(self, error: Exception) -> None:
        self.num_step_errors += 1
        log.error("an engine step failed (%s: %s); aborting the requests it held", type(error).__name__, error,
                  exc_info=error)
        ids = list(getattr(self.engine, "groups", {}))
        for rid in ids:
            try:
                self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001
                log.exception("aborting %s after a failed step", rid)
        self._publish_stats()
        err = EngineStepError(f"the model step failed: {type(error).__name__}: {error}")
        self._post(self._fail_streams, ids, err)

    def _drain_on_exit(self) -> None:
        with self._cond:
            self._stop = True
            cmds = list(self._cmds)
            self._cmds.clear()
        err = EngineDeadError("the engine has stopped" if self._dead is None else f"the engine failed: {self._dead}")
        for cmd in cmds:  # commands nobody will run: their callers must not hang
            fut = cmd[-1] if cmd[0] in ("add", "call") else None
            if fut is not None and fut.set_running_or_notify_cancel():
                fut.set_exception(err)
        try:
            for rid in list(getattr(self.engine, "groups", {})):
                self.engine.abort_request(rid)
        except Exception:  # noqa: BLE001
            log.exception("aborting requests at shutdown")
        self._publish_stats()
        self._post(self._fail_streams, None, err)

    def _post(self, fn, *args) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed meanwhile
            pass

    # -- event loop side of the step thread ------------------------------------------------------
    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            stream._put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _fail_streams(self, ids: Optional[list[str]], err: BaseException) -> None:
        targets = list(self._streams) if ids is None else ids
        for rid in targets:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream._put(err)

    # -- statistics (read by the server's /metrics) ----------------------------------------------
    def _publish_stats(self) -> None:
        eng = self.engine
        s: dict[str, Any] = {}
        sched = getattr(eng, "scheduler", None)
        if sched is not None:
            s["num_running"] = len(sched.running)
            s["num_waiting"] = len(sched.waiting)
        kv = getattr(eng, "kv", None)
        if kv is not None:
            s["kv_usage"] = kv.usage
            s["kv_free_blocks"] = kv.num_free_blocks
            s["kv_total_blocks"] = kv.pool.num_blocks
            s["prefix_cache_queries"] = kv.pool.queries
            s["prefix_cache_hits"] = kv.pool.hits
            s["prefix_cache_hit_rate"] = kv.prefix_cache_hit_rate
        st = getattr(eng, "stats", None)
        if isinstance(st, dict):
            s["prompt_tokens"] = st.get("prompt_tokens", 0)
            s["generation_tokens"] = st.get("generation_tokens", 0)
            s["steps"] = st.get("steps", 0)
        s["step_errors"] = self.num_step_errors
        self.stats = s  # one assignment: readers see a consistent snapshot


def _aborted_output(request_id: str) -> RequestOutput:
    from tallow.engine.outputs import CompletionOutput

    return RequestOutput(request_id, None, [], [CompletionOutput(0, "", [], finish_reason="abort")], True, delta=True)
