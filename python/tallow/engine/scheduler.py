"""Continuous batching with one code path: every step hands out a token budget,
{request: num_tokens}, so decodes and prefill chunks share a batch (vLLM v1's scheduler).

Order of a step: running decodes first (they are never starved by a long prefill), then running
partial prefills, then waiting requests in FCFS order while budget, sequence slots and KV blocks
last. When blocks run out for a running request, the most recently admitted running request is
preempted (its blocks freed; it is recomputed later from its prompt and output so far).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Optional

from tallow.engine.kv_cache_manager import KVCacheManager
from tallow.engine.request import Request, RequestStatus
from tallow.engine.step_data import NewRequestData, StepData


@dataclasses.dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    prefill_chunk_size: int = 8192  # 0 disables chunked prefill: a prompt is computed in one step


@dataclasses.dataclass
class SchedulerOutput:
    num_scheduled_tokens: dict[str, int]  # request_id -> tokens computed this step
    requests: list[Request]  # in batch order
    preempted: list[Request]

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        if config.max_num_seqs <= 0 or config.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        self.config = config
        self.kv = kv
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []  # requests the worker holds that finished since the last step

    # -- admission -------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """Finish (stop, length) or abort a request; its blocks go back to the pool at once."""
        if req.is_finished:
            return
        req.status = status
        if req.held_by_worker:
            self._finished_ids.append(req.request_id)
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.kv.free(req)
        self.requests.pop(req.request_id, None)

    def abort(self, request_id: str) -> Optional[Request]:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish_request(req, RequestStatus.FINISHED_ABORTED)
        return req

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step --------------------------------------------------------------------------------
    def _chunk(self, remaining: int, budget: int) -> int:
        n = min(remaining, budget)
        if self.config.prefill_chunk_size > 0:
            n = min(n, self.config.prefill_chunk_size)
        return n

    def _preempt(self, victim: Request, preempted: list[Request]) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.worker_blocks = -1  # scheduled again, it goes to the worker as a new request
        self.waiting.appendleft(victim)
        preempted.append(victim)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        order: list[Request] = []
        preempted: list[Request] = []

        # 1. running requests: decodes first, then partial prefills (chunked or resumed).
        running = sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1)
        for req in running:
            if budget <= 0:
                break
            if preempted and req in preempted:  # preempted earlier in this loop
                continue
            remaining = req.num_tokens - req.num_computed_tokens
            if remaining <= 0 or req.awaiting_final:
                continue
            n = self._chunk(remaining, budget)
            if self.config.prefill_chunk_size == 0 and n < remaining:
                continue  # unchunked prefill that does not fit this step's budget
            while not self.kv.allocate_slots(req, n):
                # Preempt the most recently admitted request that is not scheduled yet.
                candidates = [r for r in self.running if r.request_id not in scheduled]
                victim = candidates[-1]
                self._preempt(victim, preempted)
                if victim is req:
                    break
            else:
                scheduled[req.request_id] = n
                order.append(req)
                budget -= n

        # 2. waiting requests, FCFS, unless this step had to preempt.
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.parent is not None and not self._parent_prefilled(req.parent):
                break  # FCFS: n > 1 siblings wait to share the parent's prompt blocks
            hits, num_hit_tokens = self.kv.get_computed_blocks(req)
            remaining = req.num_tokens - num_hit_tokens
            n = self._chunk(remaining, budget)
            if self.config.prefill_chunk_size == 0 and n < remaining:
                break
            req.num_computed_tokens = num_hit_tokens
            if not self.kv.allocate_slots(req, n, hits):
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if req.status == RequestStatus.WAITING:
                req.num_cached_tokens = num_hit_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.request_id] = n
            order.append(req)
            budget -= n

        return SchedulerOutput(scheduled, order, preempted)

    def step_data(self, out: SchedulerOutput, num_sampled: int) -> StepData:
        """The plain-data message of a scheduled step (step_data.py): new requests in full, for the
        others only the block ids added since the worker last heard of them, and the finished ones.
        Call it once per scheduled step, in order (it records what the worker now holds)."""
        kv_ids = self.kv.req_block_ids
        sched = out.num_scheduled_tokens
        req_ids, nums, new, new_blocks = [], [], [], {}
        for req in out.requests:
            rid = req.request_id
            req_ids.append(rid)
            nums.append(sched[rid])
            ids = kv_ids[rid]
            sent = req.worker_blocks
            if sent < 0:
                new.append(NewRequestData(rid, req.prompt_token_ids, list(req.output_token_ids), req.params,
                                          list(ids), req.num_computed_tokens))
                req.worker_blocks = len(ids)
                req.held_by_worker = True
            elif len(ids) > sent:
                new_blocks[rid] = ids[sent:]
                req.worker_blocks = len(ids)
        return StepData(req_ids, nums, new, new_blocks, self.take_finished_ids(), num_sampled)

    @property
    def has_finished_ids(self) -> bool:
        return bool(self._finished_ids)

    def take_finished_ids(self) -> list[str]:
        """Ids of the requests the worker holds that finished since the last call (once each)."""
        ids, self._finished_ids = self._finished_ids, []
        return ids

    @staticmethod
    def _parent_prefilled(parent: Request) -> bool:
        return parent.is_finished or parent.num_computed_tokens >= parent.num_prompt_tokens

    def after_step(self, out: SchedulerOutput) -> list[Request]:
        """Advance progress after the model ran; returns the requests that produced logits for
        their next token (their whole known sequence is now computed)."""
        sampled = []
        for req in out.requests:
            req.num_computed_tokens += out.num_scheduled_tokens[req.request_id]
            if req.num_computed_tokens >= req.num_tokens:
                sampled.append(req)
        return sampled
