"""One sequence being generated: its tokens, progress through the model and KV blocks."""
from __future__ import annotations

import enum
import time
from typing import Optional

from tallow.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


class Request:
    """Tokens = prompt + generated. num_computed_tokens of them have KV in the cache; a step
    computes more of them and, when it reaches the end, samples one more token."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 max_total_tokens: int, parent: Optional["Request"] = None, arrival_time: Optional[float] = None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.max_total_tokens = max_total_tokens  # prompt + output may not exceed this
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hits at first scheduling
        self.parent = parent  # n > 1: siblings wait for the parent's prefill to share its blocks
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_token_time: Optional[float] = None
        self.num_preemptions = 0
        self.stop_reason: Optional[int | str] = None
        self.block_hashes: list[int] = []  # chained hashes of full blocks, grown as tokens are known
        # Overlapped scheduling: the last output token may still be on the device, stored as -(row + 1)
        # of the step that sampled it; awaiting_final marks a request that reached its length limit
        # with that token, so it gets no further step while the token is on its way.
        self.awaiting_final = False
        # What the worker holds of this request (scheduler.step_data): the number of its block ids,
        # -1 when it holds none of this admission (new, or preempted since); held_by_worker stays set
        # from the first step on, so the worker hears when the request finishes.
        self.worker_blocks = -1
        self.held_by_worker = False

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, out={self.num_output_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.value})")
