"""The engine core in its own process (vLLM v1's EngineCoreProc): it owns the model, the KV cache and
the scheduler, and speaks plain msgpack messages over ZMQ with one or more API server processes,
which own HTTP, tokenization, detokenization, stop strings and tool parsing (core_client.py).

    API process(es) ── PUSH ──> [input: PULL, bound]  engine core  [output i: PUSH, bound] ── PULL ──> API process i

Messages in (tuples, the first item names them):
    ("add", client, group id, prompt ids, [(engine request id, params dict)], arrival time)
    ("abort", [engine request ids])        the client went away, or the API side aborted
    ("stop", [engine request ids])         a stop string ended these (found by the API side)
    ("embed", client, job id, [ids], pooling, normalize)  /  ("abort_embed", job id)
    ("shutdown",)
Messages out, on the client's own socket:
    ("ready", describe dict)               once, after the model loaded
    ("out", [CoreOutput], prompt logprobs or None, stats)   one per step that produced tokens
    ("stats", stats)                       when idle after a change (e.g. KV usage back to 0)
    ("fail", [engine request ids], message)   a step failed: those requests are gone
    ("embed", job id, [vectors as bytes] or None, error kind, message)
    ("dead", message)                      the core is exiting on an error

Between two steps the loop takes every waiting message; when there is no work it blocks on the
socket (waking each second to notice a parent that died). An embeddings request is computed one
chunk (the prefill chunk size) between two steps, so it delays streams as a prompt would.
"""
from __future__ import annotations

import collections
import logging
import os
import time
from typing import Optional

from tallow.engine.core import CoreRequest, EmbedJob, EngineCore
from tallow.engine.errors import EngineDeadError, KVCacheFullError
from tallow.engine.sampling_params import SamplingParams

log = logging.getLogger("tallow.engine")

POLL_IDLE_MS = 1000  # how often an idle core checks that its parent lives


def _params(d: dict) -> SamplingParams:
    lb = d.get("logit_bias")
    if lb:
        d["logit_bias"] = {int(k): v for k, v in lb.items()}
    return SamplingParams(**d)


class EngineCoreProc:
    def __init__(self, core, in_addr: str, out_addrs: list[str]):
        import msgspec
        import zmq

        self.core = core
        self.ctx = zmq.Context(io_threads=1)
        self.inp = self.ctx.socket(zmq.PULL)
        self.inp.bind(in_addr)
        self.outs = []
        for a in out_addrs:
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 2000)
            s.setsockopt(zmq.SNDHWM, 0)
            s.bind(a)
            self.outs.append(s)
        self.enc = msgspec.msgpack.Encoder()
        self.dec = msgspec.msgpack.Decoder()
        self.zmq = zmq
        self.owner: dict[str, int] = {}  # engine request id -> client index (several clients only)
        self.embed_jobs: collections.deque = collections.deque()
        self.parent = os.getppid()
        self.stats_dirty = True
        self.stopping = False

    # -- sending ---------------------------------------------------------------------------------
    def send(self, client: int, msg) -> None:
        self._send(self.outs[client], self.enc.encode(msg))

    def broadcast(self, msg) -> None:
        data = self.enc.encode(msg)
        for s in self.outs:
            self._send(s, data)

    def _send(self, sock, data) -> None:
        """Never block the step loop on a client that went away: what it would not take is dropped
        (a live client's queue has no limit, so nothing is dropped for being slow)."""
        try:
            sock.send(data, self.zmq.NOBLOCK, copy=False)
        except self.zmq.Again:
            log.warning("engine core: an API server is not reading its outputs; a message was dropped")

    def stats(self) -> dict:
        core = self.core
        sched, kv = core.scheduler, core.kv
        st = core.stats
        return {"num_running": len(sched.running), "num_waiting": len(sched.waiting),
                "kv_usage": kv.usage, "kv_free_blocks": kv.num_free_blocks, "kv_total_blocks": kv.pool.num_blocks,
                "prefix_cache_queries": kv.pool.queries, "prefix_cache_hits": kv.pool.hits,
                "prefix_cache_hit_rate": kv.prefix_cache_hit_rate, "prompt_tokens": st["prompt_tokens"],
                "generation_tokens": st["generation_tokens"], "steps": st["steps"],
                "num_embed_jobs": len(self.embed_jobs)}

    # -- receiving -------------------------------------------------------------------------------
    def take_messages(self, block: bool) -> None:
        inp, zmq = self.inp, self.zmq
        if block:
            while not inp.poll(POLL_IDLE_MS):
                if os.getppid() != self.parent:
                    raise SystemExit("the API server process is gone")
        while True:
            try:
                data = inp.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.apply(self.dec.decode(data.buffer))

    def apply(self, msg) -> None:
        kind = msg[0]
        core = self.core
        self.stats_dirty = True
        if kind == "add":
            _, client, group_id, ids, seqs, arrival = msg
            creq = CoreRequest(group_id, ids, [(rid, _params(p)) for rid, p in seqs], arrival)
            if len(self.outs) > 1:
                for rid, _ in seqs:
                    self.owner[rid] = client
            try:
                core.add_core_request(creq)
            except ValueError as e:  # a duplicate id: the client checked, so this is a bug there
                self.send(client, ("fail", [rid for rid, _ in seqs], str(e)))
        elif kind == "abort":
            core.abort(msg[1])
            self._forget(msg[1])
        elif kind == "stop":
            core.finish_stopped(msg[1])
            self._forget(msg[1])
        elif kind == "embed":
            _, client, job_id, encoded, pooling, normalize = msg
            self.embed_jobs.append(EmbedJob((client, job_id), encoded, pooling, normalize))
        elif kind == "abort_embed":
            for job in [j for j in self.embed_jobs if j.key[1] == msg[1]]:
                core.release_embed(job)
                self.embed_jobs.remove(job)
        elif kind == "shutdown":
            self.stopping = True
        else:
            log.error("engine core: unknown message %r", kind)

    def _forget(self, rids) -> None:
        if self.owner:
            for rid in rids:
                self.owner.pop(rid, None)

    # -- the loop --------------------------------------------------------------------------------
    def run(self) -> None:
        core = self.core
        ready = self.enc.encode(("ready", core.describe()))
        for s in self.outs:  # blocks until each API server has connected
            s.send(ready)
        while not self.stopping:
            if os.getppid() != self.parent:
                raise SystemExit("the API server process is gone")
            busy = core.has_unfinished() or bool(self.embed_jobs)
            self.take_messages(block=not busy)
            if self.stopping:
                break
            if core.has_unfinished():
                self.step()
            if self.embed_jobs:
                self.embed_step()
            if self.stats_dirty and not core.has_unfinished():
                self.broadcast(("stats", self.stats()))
                self.stats_dirty = False

    def step(self) -> None:
        core = self.core
        try:
            res = core.step_core()
        except Exception as e:  # noqa: BLE001 - a failed step fails the requests it held
            self.fail_all(e)
            if isinstance(e, EngineDeadError):  # the devices are gone (a tensor-parallel rank died): exit
                raise
            return
        if not res.outputs and not res.prompt_logprobs:
            return
        stats = self.stats()
        self.stats_dirty = False
        if len(self.outs) == 1:
            self.send(0, ("out", res.outputs, res.prompt_logprobs, stats))
            return
        by_client: dict[int, list] = collections.defaultdict(list)
        owner = self.owner
        for o in res.outputs:
            by_client[owner.get(o[0], 0)].append(o)
            if o[3] is not None:
                owner.pop(o[0], None)
        plp_by: dict[int, dict] = collections.defaultdict(dict)
        for rid, entries in (res.prompt_logprobs or {}).items():
            plp_by[owner.get(rid, 0)][rid] = entries
        for client in range(len(self.outs)):
            outs, plp = by_client.get(client), plp_by.get(client)
            if outs or plp:
                self.send(client, ("out", outs or [], plp, stats))

    def fail_all(self, error: Exception) -> None:
        log.error("an engine step failed (%s: %s); aborting the requests it held", type(error).__name__, error,
                  exc_info=error)
        core = self.core
        rids = list(core.scheduler.requests)
        try:
            core.abort(rids)
        except Exception:  # noqa: BLE001
            log.exception("aborting after a failed step")
        core._pending.clear()  # their tokens will never be read  # noqa: SLF001
        msg = f"the model step failed: {type(error).__name__}: {error}"
        if len(self.outs) == 1:
            self.send(0, ("fail", rids, msg))
        else:
            by: dict[int, list] = collections.defaultdict(list)
            for rid in rids:
                by[self.owner.pop(rid, 0)].append(rid)
            for client, ids in by.items():
                self.send(client, ("fail", ids, msg))

    def embed_step(self) -> None:
        job = self.embed_jobs[0]
        client, job_id = job.key
        self.stats_dirty = True
        try:
            done = self.core.embed_chunk(job, self.core.embed_chunk_tokens)
        except KVCacheFullError as e:
            self._end_job(job)
            self.send(client, ("embed", job_id, None, "kv_full", str(e)))
            return
        except Exception as e:  # noqa: BLE001
            log.exception("an embeddings pass failed")
            self._end_job(job)
            self.send(client, ("embed", job_id, None, "error", f"{type(e).__name__}: {e}"))
            return
        if done:
            self.embed_jobs.popleft()
            self.send(client, ("embed", job_id, [v.tobytes() for v in job.results], None, None))

    def _end_job(self, job) -> None:
        self.core.release_embed(job)
        self.embed_jobs.remove(job)

    def close(self) -> None:
        for s in [self.inp, *self.outs]:
            s.close()
        self.ctx.term()


def run_engine_core(args, in_addr: str, out_addrs: list[str], log_level: int = logging.INFO) -> None:
    """The engine-core process's entry point (spawned by core_client.start_engine_core)."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the API server, which shuts us down
    proc: Optional[EngineCoreProc] = None
    try:
        t0 = time.perf_counter()
        core = EngineCore(args)
        log.info("engine core ready in %.1f s (pid %d)", time.perf_counter() - t0, os.getpid())
        proc = EngineCoreProc(core, in_addr, out_addrs)
        proc.run()
    except SystemExit as e:
        log.info("engine core exiting: %s", e)
    except BaseException as e:  # noqa: BLE001 - tell the API server why, then die
        if isinstance(e, (ValueError, OSError)):  # a model that cannot load: the message says why
            log.error("the engine core failed: %s: %s", type(e).__name__, e)
        else:
            log.exception("the engine core failed")
        _report_death(proc, out_addrs, f"{type(e).__name__}: {e}")
        raise SystemExit(1) from None
    finally:
        if proc is not None:
            proc.close()


def _report_death(proc: Optional[EngineCoreProc], out_addrs: list[str], message: str) -> None:
    import msgspec
    import zmq

    ctx = None
    try:
        if proc is None:  # died while loading: bind the output sockets just to say so
            ctx = zmq.Context()
            socks = []
            for a in out_addrs:
                s = ctx.socket(zmq.PUSH)
                s.setsockopt(zmq.LINGER, 2000)
                s.bind(a)
                socks.append(s)
        else:
            socks = proc.outs
        data = msgspec.msgpack.encode(("dead", message))
        deadline = time.monotonic() + 5.0  # the client may still be connecting; never block for good
        for s in socks:
            while True:
                try:
                    s.send(data, zmq.NOBLOCK)
                    break
                except zmq.Again:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.01)
    except Exception:  # noqa: BLE001 - dying anyway; the client's watchdog sees the exit
        pass
    finally:
        if ctx is not None:
            ctx.destroy(linger=2000)
