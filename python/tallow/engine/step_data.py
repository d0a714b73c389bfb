"""What crosses the line between the engine core and the executor's workers: plain data only
(ints, strings, lists, numpy arrays, SamplingParams), picklable, so a worker may live in another
process (vLLM v1's SchedulerOutput with NewRequestData / CachedRequestData, and ModelRunnerOutput).

A worker keeps its own state per request (prompt and output ids, block ids, sampling parameters,
progress; worker/model_runner.py) and appends the tokens it samples itself, as vLLM's InputBatch
does, so for a request it already holds a step sends only what changed: new block ids and the
number of tokens scheduled. Nothing here refers to a live Request, the KV manager or the tokenizer."""
from __future__ import annotations

import dataclasses
from typing import Optional

from tallow.engine.sampling_params import SamplingParams


@dataclasses.dataclass
class NewRequestData:
    """A request the worker does not hold: first scheduled, or scheduled again after a preemption."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens generated so far (a request resumed after preemption), all known
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hits: KV already in these blocks


@dataclasses.dataclass
class StepData:
    """One step, as the scheduler hands it to the executor."""

    req_ids: list[str]  # the batch, in order (new requests among them)
    num_scheduled_tokens: list[int]  # per batch entry
    new_reqs: list[NewRequestData]  # batch entries the worker does not hold yet
    new_block_ids: dict[str, list[int]]  # held requests that got blocks this step: the ids appended
    finished_req_ids: list[str]  # held requests to drop first (finished, aborted or preempted)
    num_sampled: int  # batch entries whose known sequence this step completes (they sample a token)

    @property
    def is_empty(self) -> bool:
        return not self.req_ids


@dataclasses.dataclass
class StepOutput:
    """What a worker returns for one step."""

    req_ids: list[str]  # the requests that sampled a token, in row order
    sampled_token_ids: list[int]
    # Per row None, or (logprob, rank, [(token, logprob)] of the top params.logprobs or None);
    # None when no row asked for log-probs.
    logprobs: Optional[list] = None
    # Per request: (position of the prompt token, token, log-prob, rank, [(token, log-prob)] of the
    # top params.prompt_logprobs) for the prompt positions this step computed.
    prompt_logprobs: dict[str, list] = dataclasses.field(default_factory=dict)
    gpu_s: Optional[float] = None  # the step's device time, with TALLOW_STEP_TIMING on a GPU


@dataclasses.dataclass
class EmbedData:
    """One chunk of a pooled-embedding input: tokens at positions start.. of the input, computed into
    the input's freshly taken KV blocks (earlier chunks' keys are already there). The worker returns
    the chunk's part of the pooling; the core adds the chunks up (core.py, EmbedJob)."""

    token_ids: list[int]
    block_ids: list[int]
    pooling: str  # "last": the chunk's last row; "mean": the sum of its rows (float64)
    start: int = 0
