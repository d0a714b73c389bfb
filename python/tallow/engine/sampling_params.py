"""Per-request generation settings, validated before anything is scheduled (vLLM's names)."""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Optional

from tallow.engine.structured_output import StructuredOutputsParams, as_params

# Fields a default may fill when a request leaves them unset (None): a server-wide one (EngineArgs), or
# the model's generation_config.json (loader/generation_config.py); else these values.
DEFAULTABLE = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
               "frequency_penalty": 0.0, "presence_penalty": 0.0}
GREEDY_EPS = 1e-5  # temperatures below this decode greedily (vLLM's rule)
# logit_bias values are applied in steps of 2^-16 (the samplers add whole steps: sampler.py), at most
# 100 in size (OpenAI's range).
LOGIT_BIAS_STEP = 2.0 ** -16
LOGIT_BIAS_MAX = 100.0


@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    temperature: Optional[float] = None  # None (these five and the penalties): the default, DEFAULTABLE's value
    top_p: Optional[float] = None  # unless the engine has another (EngineArgs, generation_config.json)
    top_k: Optional[int] = None  # -1 (or 0): off
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None  # None: the engine's default, else 0
    presence_penalty: Optional[float] = None
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16  # None: up to the model's context
    min_tokens: int = 0
    stop: Optional[list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # number of top logprobs per sampled token (0: only the sampled one)
    prompt_logprobs: Optional[int] = None  # top log-probs per prompt token (0: only the prompt token's own)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True  # False: token ids only, no text (and no stop strings), as vLLM's
    logit_bias: Optional[dict[int, float]] = None  # token id -> value added to its logit before sampling
    # a JSON schema, regex, choice or grammar the output must follow (engine/structured_output.py)
    structured_outputs: Optional[StructuredOutputsParams] = None

    def __post_init__(self) -> None:
        # which defaultable fields the caller left unset (the engine may fill them from its defaults)
        self._unset = frozenset(k for k in DEFAULTABLE if getattr(self, k) is None)
        for k in self._unset:
            setattr(self, k, DEFAULTABLE[k])
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        elif self.stop is not None:
            raise ValueError(f"invalid sampling parameter: stop must be a string or a list of strings, "
                             f"got {type(self.stop).__name__} {self.stop!r}")
        self.stop = self.stop or []
        if isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        elif self.stop_token_ids is not None:
            raise ValueError(f"invalid sampling parameter: stop_token_ids must be a list of token ids, "
                             f"got {type(self.stop_token_ids).__name__} {self.stop_token_ids!r}")
        self.stop_token_ids = self.stop_token_ids or []
        try:
            self.structured_outputs = as_params(self.structured_outputs)
        except (TypeError, ValueError) as e:
            raise ValueError(f"invalid sampling parameter: {e}") from None
        if isinstance(self.logit_bias, dict):  # a copy (validate() refuses anything else)
            self.logit_bias = dict(self.logit_bias) or None
        self.validate()

    @property
    def unset_fields(self) -> frozenset:
        """Defaultable fields (DEFAULTABLE) the caller did not set."""
        return getattr(self, "_unset", frozenset())

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"invalid sampling parameter: {msg}")

        def is_int(v) -> bool:
            return type(v) is int or (isinstance(v, numbers.Integral) and not isinstance(v, bool))

        def is_real(v) -> bool:
            return type(v) in (float, int) or (isinstance(v, numbers.Real) and not isinstance(v, bool))

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not is_real(v) or not math.isfinite(v):
                bad(f"{name} must be a finite number, got {v!r}")
        for name in ("n", "top_k", "min_tokens"):
            if not is_int(getattr(self, name)):
                bad(f"{name} must be an integer, got {getattr(self, name)!r}")
        if not isinstance(self.stop, list):
            bad(f"stop must be a string or a list of strings, got {type(self.stop).__name__} {self.stop!r}")
        if not isinstance(self.stop_token_ids, list):
            bad(f"stop_token_ids must be a list of token ids, got {type(self.stop_token_ids).__name__} "
                f"{self.stop_token_ids!r}")
        if self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            bad(f"top_k must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0:
            bad(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                hint = " (token ids go in stop_token_ids)" if isinstance(s, numbers.Integral) else ""
                bad(f"stop must be a non-empty string or a list of them, got {type(s).__name__} {s!r}{hint}")
        if not self.detokenize and self.stop:
            bad("stop strings need detokenize=True (use stop_token_ids to stop on tokens)")
        for t in self.stop_token_ids:
            if not is_int(t) or t < 0:
                bad(f"stop_token_ids must be non-negative integers, got {t!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < 0 or v > 20):
                bad(f"{name} must be an integer in [0, 20], got {v!r}")
        if self.seed is not None and not is_int(self.seed):
            bad(f"seed must be an integer, got {self.seed!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
            for t, v in self.logit_bias.items():
                if not is_int(t) or t < 0:
                    bad(f"logit_bias keys must be token ids (integers >= 0), got {t!r}")
                if not is_real(v) or not -LOGIT_BIAS_MAX <= v <= LOGIT_BIAS_MAX:
                    bad(f"logit_bias values must be numbers in [-100, 100], got {v!r} for token {t}")

    def logit_bias_steps(self) -> Optional[tuple[list[int], list[int]]]:
        """(token ids, biases in whole LOGIT_BIAS_STEPs) of logit_bias, None when it is empty."""
        if not self.logit_bias:
            return None
        ids = [int(t) for t in self.logit_bias]
        return ids, [int(round(float(v) / LOGIT_BIAS_STEP)) for v in self.logit_bias.values()]

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def clone(self, **changes) -> "SamplingParams":
        new = dataclasses.replace(self, **changes)
        new._unset = new._unset | frozenset(k for k in self.unset_fields if k not in changes)
        return new
