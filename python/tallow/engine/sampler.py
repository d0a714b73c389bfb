"""Turning logits into tokens: penalties, temperature, top-k / top-p / min-p, seeded sampling,
logprobs. Works on a [batch, vocab] float32 numpy array (the GPU path samples on the device)."""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from tallow.engine.request import Request


@dataclasses.dataclass
class SampleResult:
    token_id: int
    logprob: Optional[float] = None  # of the sampled token under the model's distribution
    top_logprobs: Optional[list[tuple[int, float]]] = None  # (token, logprob), best first


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x, axis=-1, keepdims=True)
    z = x - m
    return z - np.log(np.sum(np.exp(z), axis=-1, keepdims=True))


class Sampler:
    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._rngs: dict[str, np.random.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._rngs.pop(request_id, None)

    def _rng(self, req: Request) -> np.random.Generator:
        rng = self._rngs.get(req.request_id)
        if rng is None:
            rng = np.random.default_rng(req.params.seed)  # None: fresh entropy
            self._rngs[req.request_id] = rng
        return rng

    def apply_penalties(self, logits: np.ndarray, req: Request, eos_ids: set[int]) -> np.ndarray:
        p = req.params
        out = logits
        if p.repetition_penalty != 1.0:
            seen = np.unique(np.asarray(req.all_token_ids, dtype=np.int64))
            seen = seen[seen < len(out)]
            vals = out[seen]
            out[seen] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and req.output_token_ids:
            ids, counts = np.unique(np.asarray(req.output_token_ids, dtype=np.int64), return_counts=True)
            keep = ids < len(out)
            ids, counts = ids[keep], counts[keep]
            out[ids] -= p.frequency_penalty * counts + p.presence_penalty
        if req.num_output_tokens < p.min_tokens:
            banned = [t for t in (set(p.stop_token_ids) | (set() if p.ignore_eos else eos_ids)) if t < len(out)]
            out[banned] = -np.inf
        return out

    def sample_one(self, raw_logits: np.ndarray, req: Request, eos_ids: set[int]) -> SampleResult:
        p = req.params
        logits = self.apply_penalties(raw_logits.astype(np.float32, copy=True), req, eos_ids)
        if p.greedy:
            token = int(np.argmax(logits))
        else:
            z = logits / p.temperature
            if 0 < p.top_k < len(z):
                kth = np.partition(z, -p.top_k)[-p.top_k]
                z = np.where(z < kth, -np.inf, z)
            probs = np.exp(z - np.max(z))
            probs /= probs.sum()
            if p.min_p > 0.0:
                probs = np.where(probs < p.min_p * probs.max(), 0.0, probs)
            if p.top_p < 1.0:
                order = np.argsort(-probs, kind="stable")
                cum = np.cumsum(probs[order])
                # keep the smallest prefix whose mass reaches top_p (always at least one token)
                cutoff = int(np.searchsorted(cum, p.top_p * cum[-1])) + 1
                mask = np.zeros_like(probs, dtype=bool)
                mask[order[:cutoff]] = True
                probs = np.where(mask, probs, 0.0)
            probs = probs.astype(np.float64)
            probs /= probs.sum()
            u = self._rng(req).random()
            token = int(np.searchsorted(np.cumsum(probs), u, side="right"))
            token = min(token, len(probs) - 1)
            while probs[token] == 0.0 and token > 0:  # guard against rounding at the top end
                token -= 1
        result = SampleResult(token)
        if p.logprobs is not None:
            lp = log_softmax(raw_logits.astype(np.float64))
            result.logprob = float(lp[token])
            if p.logprobs > 0:
                top = np.argpartition(-lp, p.logprobs - 1)[:p.logprobs]
                top = top[np.argsort(-lp[top], kind="stable")]
                result.top_logprobs = [(int(t), float(lp[t])) for t in top]
        return result

    def sample(self, logits: np.ndarray, reqs: list[Request], eos_ids: set[int]) -> list[SampleResult]:
        if len(reqs) and all(r.params.greedy and r.params.logprobs is None and r.params.repetition_penalty == 1.0
                             and not r.params.frequency_penalty and not r.params.presence_penalty
                             and r.num_output_tokens >= r.params.min_tokens for r in reqs):
            return [SampleResult(int(t)) for t in np.argmax(logits, axis=-1)]
        return [self.sample_one(logits[i], r, eos_ids) for i, r in enumerate(reqs)]
