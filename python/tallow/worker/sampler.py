"""The sampler: turns a step's [batch, vocab] logits into tokens with the device ops
(tallow.ops.apply_penalties / logprobs / sample_tokens), on whatever device the logits are (CPU
tensors too), so on a GPU only the sampled ids (and requested log-probs) come back to the host.

Semantics (vLLM's / Hugging Face's; tests/python/reference_sampler.py is the numpy reference that
the tests hold this sampler to):
- repetition_penalty over prompt + output tokens: a positive logit is divided by it, a negative one
  multiplied; frequency_penalty * count + presence_penalty is subtracted for each token of the
  output so far. Penalties apply before temperature, and greedy decoding sees them too.
- logit_bias (token id -> value) is added first, before the penalties (vLLM's order), in whole steps
  of 2^-16 (LOGIT_BIAS_STEP).
- while a request has fewer than min_tokens output tokens, its stop token ids and (unless
  ignore_eos) the EOS ids are masked out.
- temperature < 1e-5 is greedy (argmax). Otherwise logits / temperature, then top-k (ties with the
  k-th value kept), min-p, top-p, and one draw.
- logprobs are log_softmax of the raw logits (before penalties and temperature, as vLLM's default);
  rank is 1 + the number of tokens with a strictly larger logit.

A request is any object with request_id, params, prompt_token_ids, output_token_ids and
num_output_tokens (the worker's per-request state; tests pass engine Requests).

Per step the host builds the per-row parameters in numpy and uploads them in one copy (one int64
buffer viewed as the six parameter vectors). Penalties and min_tokens bans go through one [B, L]
(id, count) table: per request the ids of prompt + output with their output counts, kept up to date
incrementally (no pass over the prompt per step); banned ids get count -1. logit_bias goes through
the same op before that, as two more tables with repetition 1 and presence 0: the positive biases as
counts of LOGIT_BIAS_STEP with frequency -LOGIT_BIAS_STEP, the negative ones with +LOGIT_BIAS_STEP
(the products are exact in float32, so this adds what Sampler adds).

Draws come from a counter-based Gumbel-max (not numpy generators: the reference's draws differ but
follow the same distribution). Seeds: a request's params.seed, else a random one drawn when it is first seen;
the offset is its number of output tokens, so a seeded request gives the same tokens whatever the
batch. When penalties apply to float32 logits they are modified in place."""
from __future__ import annotations

import dataclasses
import secrets
from typing import Optional

import numpy as np

import tallow
from tallow.engine.sampling_params import LOGIT_BIAS_STEP
from tallow.parallel.communicator import wait_event

_U64 = 1 << 64


@dataclasses.dataclass
class SampleResult:
    token_id: int
    logprob: Optional[float] = None  # of the sampled token under the model's distribution
    rank: Optional[int] = None  # of the sampled token (1 = most probable)
    top_logprobs: Optional[list[tuple[int, float]]] = None  # (token, logprob), best first


def _as_int64(seed: int) -> int:
    """Any Python int as a two's-complement int64 (seeds are hashed as 64 bits)."""
    s = int(seed) % _U64
    return s - _U64 if s >= 1 << 63 else s


class _PenaltyRow:
    """One request's penalty table: ids of prompt + output (first-seen order, within [0, vocab))
    and their counts in the output, grown as tokens are generated."""

    __slots__ = ("ids", "counts", "pos", "n", "num_out", "out_pos")

    def __init__(self, prompt_ids: list[int], vocab_size: int):
        uniq = [t for t in dict.fromkeys(prompt_ids) if 0 <= t < vocab_size]
        cap = max(16, 2 * len(uniq))
        self.ids = np.zeros(cap, dtype=np.int32)
        self.counts = np.zeros(cap, dtype=np.int32)
        self.ids[:len(uniq)] = uniq
        self.pos = {t: i for i, t in enumerate(uniq)}
        self.n = len(uniq)
        self.num_out = 0
        self.out_pos: list[int] = []  # positions of tokens with count > 0

    def update(self, output_ids: list[int], vocab_size: int) -> None:
        for t in output_ids[self.num_out:]:
            if not 0 <= t < vocab_size:
                continue
            i = self.pos.get(t)
            if i is None:
                if self.n == self.ids.size:
                    self.ids = np.concatenate([self.ids, np.zeros_like(self.ids)])
                    self.counts = np.concatenate([self.counts, np.zeros_like(self.counts)])
                i = self.pos[t] = self.n
                self.ids[i] = t
                self.n += 1
            if self.counts[i] == 0:
                self.out_pos.append(i)
            self.counts[i] += 1
        self.num_out = len(output_ids)

    def table(self, all_seen: bool) -> tuple[np.ndarray, np.ndarray]:
        """(ids, counts): every seen token (repetition penalty), else only the output's."""
        if all_seen:
            return self.ids[:self.n], self.counts[:self.n]
        p = np.asarray(self.out_pos, dtype=np.int64)
        return self.ids[p], self.counts[p]


class Sampler:
    def __init__(self, vocab_size: int, overlap_depth: int = 1):
        """overlap_depth: how many launched steps the engine leaves unread (sizes the host buffers)."""
        self.vocab_size = vocab_size
        self._seeds: dict[str, int] = {}
        self._penalty: dict[str, _PenaltyRow] = {}
        self._bias: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._pinned = _PinnedRing(overlap_depth)

    def forget(self, request_id: str) -> None:
        """Drop a finished or aborted request's seed, penalty and logit-bias state."""
        self._seeds.pop(request_id, None)
        self._penalty.pop(request_id, None)
        self._bias.pop(request_id, None)

    def _seed(self, req) -> int:
        s = self._seeds.get(req.request_id)
        if s is None:
            seed = req.params.seed if req.params.seed is not None else secrets.randbits(64)
            s = self._seeds[req.request_id] = _as_int64(seed)
        return s

    # -- host-side tables --------------------------------------------------------------------------
    def _params(self, reqs: list, device) -> dict[str, tallow.Tensor]:
        """The six [B] parameter vectors of sample_tokens, uploaded as one buffer."""
        B = len(reqs)
        raw = np.empty(4 * B, dtype=np.int64)
        raw[:B] = [self._seed(r) for r in reqs]
        raw[B:2 * B] = [r.num_output_tokens for r in reqs]
        f = raw[2 * B:].view(np.float32)
        f[:B] = [r.params.temperature for r in reqs]
        f[B:2 * B] = [r.params.top_p for r in reqs]
        f[2 * B:3 * B] = [r.params.min_p for r in reqs]
        f[3 * B:].view(np.int32)[:] = [max(r.params.top_k, -1) for r in reqs]
        t = tallow.from_numpy(raw)
        if device.type != "cpu":
            t = t.to(device)
        fl = t.narrow(0, 2 * B, 2 * B).view_as_dtype("float32", [4 * B])
        return dict(temperature=fl.narrow(0, 0, B), top_p=fl.narrow(0, B, B), min_p=fl.narrow(0, 2 * B, B),
                    top_k=fl.narrow(0, 3 * B, B).view_as_dtype("int32", [B]),
                    seeds=t.narrow(0, 0, B), offsets=t.narrow(0, B, B))

    def _penalty_tables(self, reqs: list, eos_ids: set[int]) -> Optional[tuple[np.ndarray, ...]]:
        """(ids [B, L], counts [B, L], repetition, frequency, presence) or None when nothing applies."""
        V = self.vocab_size
        rows: list[Optional[tuple[np.ndarray, np.ndarray]]] = []
        for req in reqs:
            p = req.params
            ids = counts = None
            if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
                st = self._penalty.get(req.request_id)
                if st is None:
                    st = self._penalty[req.request_id] = _PenaltyRow(req.prompt_token_ids, V)
                st.update(req.output_token_ids, V)
                ids, counts = st.table(p.repetition_penalty != 1.0)
            if req.num_output_tokens < p.min_tokens:
                banned = set(p.stop_token_ids)
                if not p.ignore_eos:
                    banned |= eos_ids
                banned = np.array(sorted(t for t in banned if 0 <= t < V), dtype=np.int32)
                if banned.size:
                    if ids is None:
                        ids, counts = banned, np.full(banned.size, -1, dtype=np.int32)
                    else:
                        hit = np.isin(ids, banned)
                        counts = np.where(hit, -1, counts).astype(np.int32)
                        extra = banned[~np.isin(banned, ids)]
                        ids = np.concatenate([ids, extra]).astype(np.int32)
                        counts = np.concatenate([counts, np.full(extra.size, -1, dtype=np.int32)])
            rows.append(None if ids is None else (ids, counts))
        if all(r is None for r in rows):
            return None
        B, L = len(reqs), max(len(r[0]) for r in rows if r is not None)
        tid = np.full((B, max(L, 1)), -1, dtype=np.int32)
        tcnt = np.zeros((B, max(L, 1)), dtype=np.int32)
        for i, r in enumerate(rows):
            if r is not None:
                tid[i, :len(r[0])] = r[0]
                tcnt[i, :len(r[1])] = r[1]
        rep = np.array([r.params.repetition_penalty for r in reqs], dtype=np.float32)
        freq = np.array([r.params.frequency_penalty for r in reqs], dtype=np.float32)
        pres = np.array([r.params.presence_penalty for r in reqs], dtype=np.float32)
        return tid, tcnt, rep, freq, pres

    def _bias_tables(self, reqs: list) -> list[tuple[np.ndarray, ...]]:
        """apply_penalties arguments adding the requests' logit_bias (up to two tables: positive and
        negative biases); empty when no request has one."""
        rows = []
        for req in reqs:
            b = None
            if req.params.logit_bias:
                b = self._bias.get(req.request_id)
                if b is None:
                    ids, steps = req.params.logit_bias_steps()
                    ids, steps = np.asarray(ids, dtype=np.int64), np.asarray(steps, dtype=np.int64)
                    ok = (ids < self.vocab_size) & (steps != 0)
                    b = self._bias[req.request_id] = (ids[ok].astype(np.int32), steps[ok])
            rows.append(b)
        if all(b is None for b in rows):
            return []
        B, tables = len(reqs), []
        for sign in (1, -1):
            picked = [None if b is None else (b[0][b[1] * sign > 0], (b[1][b[1] * sign > 0] * sign)) for b in rows]
            L = max((len(p[0]) for p in picked if p is not None), default=0)
            if L == 0:
                continue
            tid = np.full((B, L), -1, dtype=np.int32)
            tcnt = np.zeros((B, L), dtype=np.int32)
            for i, p in enumerate(picked):
                if p is not None:
                    tid[i, :len(p[0])] = p[0]
                    tcnt[i, :len(p[1])] = p[1]
            freq = np.full(B, -sign * LOGIT_BIAS_STEP, dtype=np.float32)
            tables.append((tid, tcnt, np.ones(B, dtype=np.float32), freq, np.zeros(B, dtype=np.float32)))
        return tables

    # -- sampling ------------------------------------------------------------------------------------
    def sample(self, logits: tallow.Tensor, reqs: list, eos_ids: set[int]) -> list[SampleResult]:
        return self.launch(logits, reqs, eos_ids).results() if reqs else []

    def launch(self, logits: tallow.Tensor, reqs: list, eos_ids: set[int],
               bitmask: Optional[np.ndarray] = None) -> "LaunchedSample":
        """Queue the sampling of one step on the logits' device; the returned object holds the sampled
        ids on the device (`ids`) and reads the results back when asked (`results()`). bitmask:
        [B, ceil(V / 32)] int32 grammar masks (structured output), applied before everything else:
        a token the grammar forbids is -inf for greedy and random draws alike."""
        B = len(reqs)
        if logits.ndim != 2 or logits.shape[0] != B:
            raise ValueError(f"logits of shape {tuple(logits.shape)} for {B} requests")
        device = logits.device

        def up(a: np.ndarray) -> tallow.Tensor:
            t = tallow.from_numpy(np.ascontiguousarray(a))
            return t if device.type == "cpu" else t.to(device)

        num_top = max((r.params.logprobs for r in reqs if r.params.logprobs is not None), default=None)
        raw = logits
        x = logits
        pen = self._penalty_tables(reqs, eos_ids)
        tables = self._bias_tables(reqs) + ([pen] if pen is not None else [])  # logit_bias first
        if bitmask is not None:
            x = tallow.ops.cast(x, tallow.float32) if x.dtype != tallow.float32 else x.clone()
            tallow.ops.apply_token_bitmask_(x, up(bitmask))
        if tables:
            if x.dtype != tallow.float32:
                x = tallow.ops.cast(x, tallow.float32)
            elif num_top is not None and x is raw:
                x = x.clone()  # logprobs are of the raw logits
            x = x.contiguous()
            for table in tables:
                tallow.ops.apply_penalties(x, *(up(a) for a in table))
        tokens_t = tallow.ops.sample_tokens(x, **self._params(reqs, device))
        lp = tallow.ops.logprobs(raw, tokens_t, num_top) if num_top is not None else None
        return LaunchedSample(reqs, tokens_t, lp, self._pinned)


class _PinnedRing:
    """Page-locked host buffers reused round-robin (allocating them costs far more than a step's copy).
    At most overlap depth + 1 launched steps are alive at once (the engine's unread ones and the one
    being launched), each taking up to two buffers of one shape (ids and ranks), so a ring of
    2 * (depth + 1) per shape is never overtaken."""

    def __init__(self, overlap_depth: int = 1):
        self.slots = 2 * (max(1, overlap_depth) + 1)
        self._rings: dict[tuple, list] = {}

    def take(self, shape: tuple, dtype) -> tallow.Tensor:
        from tallow import cuda

        cap = 1 << max(0, int(shape[0]) - 1).bit_length()  # rows rounded up to a power of two
        key = (cap, tuple(shape[1:]), str(dtype))
        ring = self._rings.get(key)
        if ring is None:
            ring = self._rings[key] = [[cuda.empty_pinned((cap, *shape[1:]), dtype) for _ in range(self.slots)], 0]
        bufs, i = ring
        ring[1] = (i + 1) % self.slots
        return bufs[i].narrow(0, 0, int(shape[0]))


class LaunchedSample:
    """A step's sampling queued on the device. On a GPU the ids (and log-probs) are copied into
    page-locked host memory without waiting; results() waits for that copy only."""

    def __init__(self, reqs: list, ids: tallow.Tensor, lp, pinned: _PinnedRing):
        self.reqs, self.ids = reqs, ids
        self._dev = [ids] + (list(lp) if lp is not None else [])
        self._host = self._dev
        self._event = None
        if ids.device.type != "cpu":
            from tallow import cuda

            self._host = [pinned.take(tuple(t.shape), t.dtype) for t in self._dev]
            for h, d in zip(self._host, self._dev):
                cuda.copy_to_host_async(h, d)
            self._event = cuda.Event()
            self._event.record()

    def results(self) -> list[SampleResult]:
        if self._event is not None:
            wait_event(self._event)
        arrays = [t.numpy() for t in self._host]
        tokens = arrays[0]
        if len(arrays) == 1:
            return [SampleResult(int(t)) for t in tokens]
        vals, ids, ranks = arrays[1:]
        results = []
        for i, req in enumerate(self.reqs):
            res = SampleResult(int(tokens[i]))
            k = req.params.logprobs
            if k is not None:
                res.logprob = float(vals[i, 0])
                res.rank = int(ranks[i])
                if k > 0:
                    res.top_logprobs = [(int(ids[i, 1 + j]), float(vals[i, 1 + j])) for j in range(k)]
            results.append(res)
        return results

    def read(self) -> tuple[list[int], Optional[list]]:
        """Plain data: (sampled ids, per row None or (logprob, rank, [(token, logprob)] of the top
        params.logprobs)); waits for the copy only. The logprob rows are None when no row asked."""
        if self._event is not None:
            wait_event(self._event)
        arrays = [t.numpy() for t in self._host]
        tokens = arrays[0].tolist()
        if len(arrays) == 1:
            return tokens, None
        vals, ids, ranks = arrays[1:]
        rows: list = []
        for i, req in enumerate(self.reqs):
            k = req.params.logprobs
            if k is None:
                rows.append(None)
                continue
            rows.append((float(vals[i, 0]), int(ranks[i]),
                         [(int(ids[i, 1 + j]), float(vals[i, 1 + j])) for j in range(k)] if k > 0 else None))
        return tokens, rows
