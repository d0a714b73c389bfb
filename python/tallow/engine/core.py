"""EngineCore: requests, the KV manager, the scheduler and the executor behind one step loop; no
tokenization, detokenization or stop strings (vLLM v1's EngineCore). It runs inside LLMEngine (the
offline path and the in-thread server) or alone in its own process (engine/core_process.py), where
it speaks only plain data:

    add_requests(CoreRequest)  -> queued, one engine Request per completion (n > 1 gives n)
    abort(ids) / finish_stopped(ids)
    step() -> CoreStep(outputs, prompt_logprobs): per sampled token a CoreOutput tuple
              (output_processor.py's module docstring) and prompt log-prob entries by request

One step loop serves every device: step n is launched, and the tokens of the step launched `overlap
depth` steps earlier are read back and applied (depth 2 on a GPU, so the host schedules while the
device runs; 0 on the CPU, where the launch computes the step and reading it back right away costs
nothing)."""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import gc
import itertools
import logging
import time
from typing import Optional

import numpy as np

from tallow import envs
from tallow.engine.args import EngineArgs
from tallow.engine.errors import KVCacheFullError, SchedulerStalledError
from tallow.engine.executor import Executor, check_device, load_source, max_batched_tokens
from tallow.engine.kv_cache_manager import KVCacheManager
from tallow.engine.request import Request, RequestStatus
from tallow.engine.sampling_params import SamplingParams
from tallow.engine.scheduler import Scheduler, SchedulerConfig
from tallow.engine.step_data import EmbedData
from tallow.engine.structured_output import GrammarSet

log = logging.getLogger("tallow.engine")


def overlap_depth() -> int:
    """Overlapped steps: how many launched steps may be unread when step() returns
    (TALLOW_OVERLAP_DEPTH, default 2), read per engine. With two the host has a whole GPU step of
    slack: on some H100 machines the nano-vllm workload's GPU sat idle 0.05-0.13 s of a 7.5 s run
    between steps with one, after host pauses of 5-20 ms; on a quiet one both measured the same.
    Outputs then come two steps after their tokens were sampled."""
    return envs.TALLOW_OVERLAP_DEPTH


def _order_decode_batch(out) -> None:
    """Sort a decode-only step's requests by context length, longest first: the decode-attention grid
    then starts the longest CTAs first, so short ones fill the tail instead of one long CTA running
    alone at the end (H100, nano-vllm workload: 18.5k -> 18.9-19.1k output tok/s; cuda/README.md)."""
    if len(out.requests) > 1 and all(out.num_scheduled_tokens[r.request_id] == 1 for r in out.requests):
        out.requests.sort(key=lambda r: -r.num_tokens)


def load_model_source(args: EngineArgs):
    """(config, source, tokenizer) of args' model: what both the engine core and the API process
    (which tokenizes) need. Reads metadata and the tokenizer only, no weights."""
    from tallow.tokenizer import Tokenizer

    cfg, src = load_source(args)
    if src.kind == "gguf":
        tok = Tokenizer.from_gguf(src.gguf)
    elif args.load_format == "dummy" and not (src.tokenizer_path or src.tokenizer_model_path):
        from tallow.loader.dummy import placeholder_tokenizer

        tok = placeholder_tokenizer(cfg)  # benchmarks on a bare config.json: token i is "t<i>"
    else:
        tok = Tokenizer.from_pretrained_dir(src.model_dir)
    if args.chat_template:
        from tallow.tokenizer.chat_template import resolve_chat_template

        tok.chat_template = resolve_chat_template(None, None, args.chat_template)
    return cfg, src, tok


@dataclasses.dataclass
class CoreRequest:
    """A request group as the core receives it: validated prompt ids and, per completion, its
    engine request id and parameters (n > 1: the first is the parent whose prefill the others share)."""
    request_id: str
    prompt_token_ids: list[int]
    seqs: list[tuple[str, SamplingParams]]
    arrival_time: Optional[float] = None


@dataclasses.dataclass
class CoreStep:
    outputs: list[tuple]  # CoreOutput tuples (output_processor.py)
    prompt_logprobs: Optional[dict] = None  # request id -> [(pos, token, logprob, rank, top)]


class EngineCore:
    structured_output = True  # grammar-constrained requests (SamplingParams.structured_outputs)

    def __init__(self, args: EngineArgs, loaded=None):
        """loaded: (config, source, tokenizer) when the caller has them already."""
        self.args = args
        self.device = check_device(args.device)
        cfg, src, tok = loaded or load_model_source(args)
        self.config, self.tokenizer, self.source = cfg, tok, src
        self._eos_ids = set(tok.eos_token_ids) | set(cfg.eos_token_ids)

        # Overlapped steps (async_scheduling; the default on a GPU) leave `depth` launched steps unread.
        self.overlap = args.async_scheduling if args.async_scheduling is not None else self.device != "cpu"
        self._overlap_depth = overlap_depth() if self.overlap else 0
        self.executor = Executor(args, cfg, src, self.device, self._eos_ids, max(1, self._overlap_depth),
                                 step_timing=envs.TALLOW_STEP_TIMING)
        self.dtype = self.executor.dtype
        self.max_model_len = self.executor.max_model_len
        self.kv = KVCacheManager(self.executor.num_blocks, args.block_size, args.prefix_cache,
                                 args.prefix_cache_max_tokens)
        self.scheduler = Scheduler(SchedulerConfig(args.max_num_seqs, max_batched_tokens(args),
                                                   args.prefill_chunk_size), self.kv)
        # launched steps whose tokens are not read yet, oldest first (at most the overlap depth between steps)
        self._pending: collections.deque[_PendingStep] = collections.deque()
        # structured output: matchers of the constrained requests; groups waiting for their grammar
        self.grammars = GrammarSet(tok, cfg.vocab_size, self._eos_ids)
        self._compiling: list[tuple[list[Request], concurrent.futures.Future]] = []
        self.stats = {"schedule_s": 0.0, "model_s": 0.0, "sample_s": 0.0, "steps": 0,
                      "prompt_tokens": 0, "generation_tokens": 0}
        if self.device != "cpu" and envs.TALLOW_GC_FREEZE:
            # Once the engine is built (on a GPU), everything alive then (modules, the model, the
            # tokenizer's ~550k tables entries at a 152k vocabulary) moves to the collector's permanent
            # generation, and the youngest generation is collected every 50,000 allocations instead of
            # 700, so full collections, which stop the host while the GPU drains its queue, become rare
            # and scan only what came later. In the nano-vllm workload (H100, `python
            # benchmarks/nano_steps.py --gaps`) the run's three full collections took 20-33 ms each,
            # 9-13 ms with the freeze alone, and none ran with both. An engine built later unfreezes
            # first, so what an earlier one froze can still be collected.
            gc.unfreeze()
            gc.collect()
            gc.freeze()
            young, middle, old = gc.get_threshold()
            gc.set_threshold(max(young, 50_000), middle, old)

    # -- views for tests, benchmarks and the server ------------------------------------------------
    @property
    def runner(self):
        """The in-process worker's model runner."""
        return self.executor.runner

    @property
    def sampler(self):
        return self.executor.runner.sampler

    @property
    def eos_ids(self) -> set[int]:
        return self._eos_ids

    @eos_ids.setter
    def eos_ids(self, ids) -> None:
        self._eos_ids = set(ids)
        self.executor.set_eos_ids(self._eos_ids)

    def describe(self) -> dict:
        """What the API process needs to know of the running model (plain data)."""
        return {"max_model_len": self.max_model_len, "dtype": str(self.dtype), "num_blocks": self.kv.pool.num_blocks,
                "block_size": self.kv.block_size, "eos_ids": sorted(self._eos_ids)}

    # -- requests --------------------------------------------------------------------------------
    def has_request_id(self, rid: str) -> bool:
        return rid in self.scheduler.requests

    def add_core_request(self, creq: CoreRequest) -> None:
        parent = None
        reqs = []
        for rid, p in creq.seqs:
            req = Request(rid, creq.prompt_token_ids, p, self.max_model_len, parent=parent,
                          arrival_time=creq.arrival_time)
            parent = parent or req
            reqs.append(req)
        so = reqs[0].params.structured_outputs
        if so is not None:  # scheduled once its grammar is compiled (_admit_compiled)
            self._compiling.append((reqs, self.grammars.compile(so)))
        else:
            for req in reqs:
                self.scheduler.add_request(req)
        self.stats["prompt_tokens"] += len(creq.prompt_token_ids)

    def _admit_compiled(self, wait: bool = False) -> list[tuple]:
        """Schedule the groups whose grammar is compiled (each completion gets its own matcher); a
        grammar that fails ends its group (the API process compiled it first, so this is rare).
        wait: block briefly for one when nothing else can run. Returns the outputs of failed ones."""
        if wait:
            concurrent.futures.wait([f for _, f in self._compiling], timeout=0.05,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        outs, left = [], []
        for reqs, fut in self._compiling:
            if not fut.done():
                left.append((reqs, fut))
                continue
            try:
                matcher = fut.result()
            except Exception as e:  # noqa: BLE001 - reported per request
                log.error("structured output for %s failed to compile: %s", reqs[0].request_id, e)
                eos = min(self._eos_ids) if self._eos_ids else 0
                outs += [(r.request_id, eos, None, "abort", None, 1, 0) for r in reqs]
                continue
            for i, req in enumerate(reqs):
                self.grammars.add(req.request_id, matcher if i == 0 else matcher.deep_copy())
                self.scheduler.add_request(req)
        self._compiling = left
        return outs

    def abort(self, rids, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Finish these engine requests (unknown or finished ones are skipped); their blocks return
        to the pool now."""
        sched = self.scheduler
        for rid in rids:
            req = sched.requests.get(rid)
            if req is not None:
                sched.finish_request(req, status)
            self.grammars.release(rid)
        if self._compiling:
            gone = set(rids)
            self._compiling = [(reqs, f) for reqs, f in self._compiling
                               if not any(r.request_id in gone for r in reqs)]
        self._release_if_idle()

    def finish_stopped(self, rids) -> None:
        """Requests the API side stopped on a stop string."""
        self.abort(rids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._pending) or bool(self._compiling)

    # -- one step --------------------------------------------------------------------------------
    def step_core(self) -> CoreStep:
        """Run one scheduling step; returns the CoreOutputs of the step read back, if any.

        Step n is launched before the tokens of steps n-1 (and n-2: TALLOW_OVERLAP_DEPTH, default 2
        on a GPU; 0 on the CPU) are read back, and the outputs returned are the oldest unread step's.
        A request whose newest tokens are still on the device holds -(row + 1) for each in its output
        ids; the worker fills the newest in on the device. Penalised requests need their full history
        on the host, so a step after one sampling them waits (see _must_read_first)."""
        t0 = time.perf_counter()
        pending = self._pending
        if self._compiling:
            failed = self._admit_compiled(wait=not pending and not self.scheduler.has_unfinished)
            if failed:
                return CoreStep(failed)
        if pending and self._must_read_first():
            return self._finish(pending.popleft())
        out = self.scheduler.schedule()
        _order_decode_batch(out)
        t1 = time.perf_counter()
        if out.is_empty:
            if pending:
                return self._finish(pending.popleft())
            if self.scheduler.has_unfinished:
                raise SchedulerStalledError("scheduler made no progress: the KV cache cannot hold the waiting request")
            return CoreStep([])
        to_sample = [r for r in out.requests
                     if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] >= r.num_tokens]
        read: list[CoreStep] = []
        mask_fn = None
        if self.grammars.matchers and any(r.request_id in self.grammars.matchers for r in to_sample):
            def mask_fn():
                # Called by the runner between this step's forward pass and its sampling: read the
                # launched steps back (the device is busy with the forward meanwhile), advance the
                # matchers by their tokens, then this step's masks.
                while pending:
                    read.append(self._finish(pending.popleft(), release=False))
                return self.grammars.bitmask([r.request_id for r in to_sample])
        launched = self.executor.execute_model(self.scheduler.step_data(out, len(to_sample)), mask_fn)
        self.scheduler.after_step(out)
        slots = []
        mml = self.max_model_len
        needs_history = False
        for row, req in enumerate(to_sample):
            out_ids = req.output_token_ids
            out_ids.append(-(row + 1))
            slots.append(len(out_ids) - 1)
            p = req.params
            if (p.max_tokens is not None and len(out_ids) >= p.max_tokens) or req.num_tokens >= mml:
                req.awaiting_final = True
            if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
                needs_history = True
        pending.append(_PendingStep(to_sample, slots, launched, needs_history))
        t2 = time.perf_counter()
        self.stats["schedule_s"] += t1 - t0
        self.stats["model_s"] += t2 - t1
        self.stats["steps"] += 1
        if len(pending) > self._overlap_depth:
            read.append(self._finish(pending.popleft()))
        elif read:
            self._release_if_idle()
        if len(read) == 1:
            return read[0]
        if read:
            lps: dict = {}
            for r in read:
                for rid, entries in (r.prompt_logprobs or {}).items():
                    lps.setdefault(rid, []).extend(entries)
            return CoreStep([o for r in read for o in r.outputs], lps or None)
        return CoreStep([])

    def _must_read_first(self) -> bool:
        """Whether the oldest launched step's tokens must reach the host before the next step is
        scheduled. Penalised requests need their whole history there. And an unknown token is filled
        in on the device from the newest sampling step only (the worker's prev_ids), so a live request
        that an older launched step sampled but the newest did not (preempted, or left out for the
        token budget) waits until that older step is read."""
        pending = self._pending
        if any(p.needs_history for p in pending):
            return True
        if len(pending) < 2:
            return False
        newest = pending[-1].req_set
        return any(r not in newest and not r.is_finished and not r.awaiting_final
                   for i in range(len(pending) - 1) for r in pending[i].reqs)

    def _finish(self, pending: "_PendingStep", release: bool = True) -> CoreStep:
        """Read a launched step's sampled tokens (waiting for the device if needed) and decide the
        stops the core can see (stop ids, EOS, lengths, a completed grammar); stop strings are the
        output processor's. release: tell the workers of ended requests now if the engine is idle
        (not from inside a step being launched)."""
        t0 = time.perf_counter()
        res = pending.launched.result()
        if res.gpu_s is not None:
            self.stats["gpu_s"] = self.stats.get("gpu_s", 0.0) + res.gpu_s
        eos, mml, sched = self._eos_ids, self.max_model_len, self.scheduler
        grammars = self.grammars if self.grammars.matchers else None
        lps = res.logprobs or itertools.repeat(None)
        outs = []
        now = None
        for req, slot, token, lp in zip(pending.reqs, pending.slots, res.sampled_token_ids, lps):
            if req.is_finished:  # aborted or finished meanwhile: the token is dropped
                continue
            if req.first_token_time is None:
                req.first_token_time = now = now or time.monotonic()
            req.output_token_ids[slot] = token
            num_out = slot + 1
            p = req.params
            finish = stop_reason = None
            if grammars is not None and (g := grammars.consume(req.request_id, token)) is not None:
                if g != "stop":
                    log.error("request %s: %s", req.request_id, g)
                finish = "stop" if g == "stop" else "abort"
            if finish is None and num_out >= p.min_tokens:
                if token in p.stop_token_ids:
                    finish, stop_reason = "stop", token
                elif not p.ignore_eos and token in eos:
                    finish = "stop"
            if finish is None and ((p.max_tokens is not None and num_out >= p.max_tokens)
                                   or req.num_prompt_tokens + num_out >= mml):
                finish = "length"
            if finish is not None:
                sched.finish_request(req, RequestStatus.FINISHED_STOPPED if finish == "stop" else
                                     RequestStatus.FINISHED_LENGTH if finish == "length" else
                                     RequestStatus.FINISHED_ABORTED)
                if grammars is not None:
                    grammars.release(req.request_id)
            outs.append((req.request_id, token, lp, finish, stop_reason, num_out, req.num_cached_tokens))
        self.stats["generation_tokens"] += len(outs)
        if release:
            self._release_if_idle()
        self.stats["sample_s"] += time.perf_counter() - t0
        return CoreStep(outs, res.prompt_logprobs)

    def _release_if_idle(self) -> None:
        """With nothing left to schedule, tell the workers now which requests ended (a next step,
        which would carry them, may not come soon), so no request state outlives its request."""
        sched = self.scheduler
        if not sched.has_unfinished and sched.has_finished_ids:
            self.executor.release(sched.take_finished_ids())

    # -- embeddings (the server's /v1/embeddings) ------------------------------------------------
    @property
    def embed_chunk_tokens(self) -> int:
        """Tokens of embedding input computed between two steps: the prefill chunk (or the step's
        token budget), so an embeddings request delays the running streams no more than a prompt does."""
        c = self.scheduler.config
        return c.prefill_chunk_size or c.max_num_batched_tokens

    def embed_chunk(self, job: "EmbedJob", max_tokens: int) -> bool:
        """Compute up to max_tokens more of the job's current input; True when the whole job is
        done (job.results then holds a vector per input). An input takes its KV blocks when its first
        chunk runs and returns them after its last; KVCacheFullError when the pool lacks room."""
        ids = job.encoded[job.index]
        n, pool = len(ids), self.kv.pool
        if job.blocks is None:
            num_blocks = -(-n // self.kv.block_size)
            if num_blocks > pool.num_free_blocks:
                raise KVCacheFullError(f"the KV cache has no room for a {n}-token input right now "
                                       f"({pool.num_free_blocks} of {pool.num_blocks} blocks free); retry later")
            job.blocks = pool.get_new_blocks(num_blocks)
        start = job.done_tokens
        stop = min(n, start + max(1, max_tokens))
        part = self.executor.embed(EmbedData(ids[start:stop], [b.block_id for b in job.blocks], job.pooling, start))
        job.acc = part if job.acc is None or job.pooling == "last" else job.acc + part
        job.done_tokens = stop
        if stop == n:
            vec = job.acc if job.pooling == "last" else job.acc / n
            if job.normalize:
                norm = float(np.linalg.norm(vec))
                if norm > 0:
                    vec = vec / norm
            job.results.append(np.ascontiguousarray(vec, dtype=np.float32))
            self.release_embed(job)
            job.index, job.done_tokens, job.acc = job.index + 1, 0, None
        return job.index == len(job.encoded)

    def release_embed(self, job: "EmbedJob") -> None:
        """Return the blocks of the job's current input (after it finished, failed or was aborted)."""
        if job.blocks is not None:
            self.kv.pool.free_blocks(reversed(job.blocks))
            job.blocks = None

    def embed_ids(self, encoded: list[list[int]], pooling: str = "last", normalize: bool = True
                  ) -> list[np.ndarray]:
        """Pooled final hidden states (after the model's final norm) of each validated id list,
        without sampling: "last" is the last token's, "mean" the average over all its tokens;
        L2-normalised when normalize. Runs the whole job now, chunk by chunk (the engine-core
        process interleaves the chunks with steps instead)."""
        job = EmbedJob(None, encoded, pooling, normalize)
        try:
            while not self.embed_chunk(job, self.embed_chunk_tokens):
                pass
        finally:
            self.release_embed(job)
        return job.results

    def shutdown(self) -> None:
        self.grammars.shutdown()
        self.executor.shutdown()


class EmbedJob:
    """An embeddings request inside the core: its inputs (validated ids) computed in chunks."""

    def __init__(self, key, encoded: list[list[int]], pooling: str, normalize: bool):
        if pooling not in ("last", "mean"):
            raise ValueError(f"pooling must be 'last' or 'mean', got {pooling!r}")
        self.key = key  # who asked (the engine-core process's reply address)
        self.encoded, self.pooling, self.normalize = encoded, pooling, normalize
        self.results: list[np.ndarray] = []
        self.index = 0  # the input being computed
        self.done_tokens = 0  # of that input
        self.blocks = None
        self.acc = None


class _PendingStep:
    """A launched step whose sampled tokens have not been read back yet."""

    __slots__ = ("reqs", "slots", "launched", "needs_history", "_req_set")

    def __init__(self, reqs, slots, launched, needs_history: bool):
        self.reqs, self.slots, self.launched, self.needs_history = reqs, slots, launched, needs_history
        self._req_set = None

    @property
    def req_set(self) -> frozenset:
        if self._req_set is None:
            self._req_set = frozenset(self.reqs)
        return self._req_set
