"""What generation returns, shaped like vLLM's RequestOutput / CompletionOutput."""
from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list[dict[int, Logprob]]] = None
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | None while running
    stop_reason: Optional[int | str] = None  # the stop string or token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    delta: bool = False  # outputs hold only what is new since the last RequestOutput
    # With SamplingParams.prompt_logprobs: per prompt token, None for the first, else {token id: Logprob}
    # holding the prompt token (its log-probability given the tokens before it, and rank) and the top
    # prompt_logprobs tokens; set once the whole prompt has been processed.
    prompt_logprobs: Optional[list[Optional[dict[int, "Logprob"]]]] = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    @property
    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}
