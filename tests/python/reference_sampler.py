"""The reference sampler for the tests: penalties, temperature, top-k / top-p / min-p, seeded
sampling, logprobs, in numpy over a [batch, vocab] float32 array. The engine samples with
tallow.worker.sampler.Sampler (the device ops, on every device); tests hold it to this reference
(the same semantics; its seeded draws differ, a counter-based Gumbel-max instead of numpy generators).

Semantics (vLLM's / Hugging Face's):
- repetition_penalty over prompt + output tokens: a positive logit is divided by it, a negative one
  multiplied; frequency_penalty * count + presence_penalty is subtracted for each token of the
  output so far. Penalties apply before temperature, and greedy decoding sees them too.
- logit_bias (token id -> value) is added first, before the penalties (vLLM's order), in whole steps
  of 2^-16 (LOGIT_BIAS_STEP: the device samplers add it through the penalty op's integer counts).
- while a request has fewer than min_tokens output tokens, its stop token ids and (unless
  ignore_eos) the EOS ids are masked out.
- temperature < 1e-5 is greedy (argmax). Otherwise logits / temperature, then top-k (ties with the
  k-th value are kept), then min-p (tokens with prob < min_p * max prob dropped), then top-p over
  what is left (the most probable tokens whose mass first reaches top_p of it; tokens tied with the
  last one kept are kept too), renormalised, and one uniform draw from the request's own generator
  picks the token by inverse CDF. A request with a seed gets the same tokens whatever else is in
  the batch, because every row is processed on its own and draws only from its own generator.
- logprobs are log_softmax of the raw logits (before penalties and temperature, as vLLM's default);
  rank is 1 + the number of tokens with a strictly larger logit.

The batch is processed with whole-array numpy operations (penalties as one scatter over all rows,
temperature, top-k / min-p / top-p masks, softmax and block sums over [batch, vocab]); Python loops
over the batch only do small work per row (a draw from the request's generator, a search in one
256-token block, and top-p's full sort for rows whose nucleus is not within its 256 largest)."""
from __future__ import annotations

from typing import Optional

import numpy as np

from tallow.engine.request import Request
from tallow.engine.sampling_params import GREEDY_EPS, LOGIT_BIAS_STEP
from tallow.worker.sampler import SampleResult

_TOP_P_CANDIDATES = 256  # top-p first looks at this many most probable tokens, then sorts the row
_BLOCK = 256  # block size of the two-level CDF search


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x, axis=-1, keepdims=True)
    z = x - m
    return z - np.log(np.sum(np.exp(z), axis=-1, keepdims=True))


class _PenaltyState:
    """Tokens a request has seen, kept up to date incrementally (no per-step pass over the prompt)."""

    __slots__ = ("seen", "seen_arr", "counts", "count_arrs", "num_out")

    def __init__(self, prompt_ids: list[int]):
        self.seen: set[int] = set(prompt_ids)
        self.seen_arr: Optional[np.ndarray] = None
        self.counts: dict[int, int] = {}
        self.count_arrs: Optional[tuple[np.ndarray, np.ndarray]] = None
        self.num_out = 0

    def update(self, output_ids: list[int]) -> None:
        if self.num_out == len(output_ids):
            return
        for t in output_ids[self.num_out:]:
            self.counts[t] = self.counts.get(t, 0) + 1
            if t not in self.seen:
                self.seen.add(t)
                self.seen_arr = None
        self.count_arrs = None
        self.num_out = len(output_ids)

    def seen_ids(self) -> np.ndarray:
        if self.seen_arr is None:
            self.seen_arr = np.fromiter(self.seen, dtype=np.int64, count=len(self.seen))
        return self.seen_arr

    def output_counts(self) -> tuple[np.ndarray, np.ndarray]:
        if self.count_arrs is None:
            n = len(self.counts)
            self.count_arrs = (np.fromiter(self.counts.keys(), dtype=np.int64, count=n),
                               np.fromiter(self.counts.values(), dtype=np.float32, count=n))
        return self.count_arrs


class Sampler:
    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._rngs: dict[str, np.random.Generator] = {}
        self._penalty: dict[str, _PenaltyState] = {}
        self._bias: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def forget(self, request_id: str) -> None:
        """Drop a finished or aborted request's generator, penalty and logit-bias state."""
        self._rngs.pop(request_id, None)
        self._penalty.pop(request_id, None)
        self._bias.pop(request_id, None)

    def _logit_bias(self, req: Request) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """(token ids, float32 values) of the request's logit_bias in whole steps, None without one."""
        if not req.params.logit_bias:
            return None
        b = self._bias.get(req.request_id)
        if b is None:
            ids, steps = req.params.logit_bias_steps()
            b = self._bias[req.request_id] = (np.asarray(ids, dtype=np.int64),
                                              (np.asarray(steps, dtype=np.float64) * LOGIT_BIAS_STEP).astype(np.float32))
        return b

    def _rng(self, req: Request) -> np.random.Generator:
        rng = self._rngs.get(req.request_id)
        if rng is None:
            rng = np.random.default_rng(req.params.seed)  # None: fresh entropy
            self._rngs[req.request_id] = rng
        return rng

    def _penalty_state(self, req: Request) -> _PenaltyState:
        st = self._penalty.get(req.request_id)
        if st is None:
            st = self._penalty[req.request_id] = _PenaltyState(req.prompt_token_ids)
        st.update(req.output_token_ids)
        return st

    # -- logits processing -----------------------------------------------------------------------
    def apply_penalties(self, logits: np.ndarray, reqs: list[Request], eos_ids: set[int]) -> np.ndarray:
        """logit_bias, repetition / frequency / presence penalties and min_tokens masks on [batch, vocab]
        logits. Returns `logits` itself when nothing applies, else a modified copy."""
        V = logits.shape[-1]
        rep_r, rep_t, rep_v = [], [], []
        fp_r, fp_t, fp_v = [], [], []
        ban_r, ban_t = [], []
        bias_r, bias_t, bias_v = [], [], []
        for i, req in enumerate(reqs):
            p = req.params
            b = self._logit_bias(req)
            if b is not None:
                bias_r.append(np.full(len(b[0]), i, dtype=np.int64))
                bias_t.append(b[0])
                bias_v.append(b[1])
            if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
                st = self._penalty_state(req)
                if p.repetition_penalty != 1.0:
                    ids = st.seen_ids()
                    rep_r.append(np.full(len(ids), i, dtype=np.int64))
                    rep_t.append(ids)
                    rep_v.append(np.full(len(ids), p.repetition_penalty, dtype=np.float32))
                if (p.frequency_penalty or p.presence_penalty) and st.counts:
                    ids, counts = st.output_counts()
                    fp_r.append(np.full(len(ids), i, dtype=np.int64))
                    fp_t.append(ids)
                    fp_v.append(np.float32(p.frequency_penalty) * counts + np.float32(p.presence_penalty))
            if req.num_output_tokens < p.min_tokens:
                banned = set(p.stop_token_ids)
                if not p.ignore_eos:
                    banned |= eos_ids
                banned = [t for t in banned if 0 <= t < V]
                ban_r.extend([i] * len(banned))
                ban_t.extend(banned)
        if not (rep_r or fp_r or ban_r or bias_r):
            return logits
        out = np.array(logits, dtype=np.float32, copy=True)
        if bias_r:
            r, t, v = np.concatenate(bias_r), np.concatenate(bias_t), np.concatenate(bias_v)
            ok = (t >= 0) & (t < V)
            out[r[ok], t[ok]] += v[ok]  # (row, token) pairs are unique
        if rep_r:
            r, t, pen = np.concatenate(rep_r), np.concatenate(rep_t), np.concatenate(rep_v)
            ok = (t >= 0) & (t < V)
            r, t, pen = r[ok], t[ok], pen[ok]
            v = out[r, t]
            out[r, t] = np.where(v > 0, v / pen, v * pen)
        if fp_r:
            r, t, sub = np.concatenate(fp_r), np.concatenate(fp_t), np.concatenate(fp_v)
            ok = (t >= 0) & (t < V)
            out[r[ok], t[ok]] -= sub[ok]  # (row, token) pairs are unique
        if ban_r:
            out[np.asarray(ban_r), np.asarray(ban_t)] = -np.inf
        return out

    @staticmethod
    def _top_k(z: np.ndarray, ks: np.ndarray) -> None:
        """In place: keep each row's k largest values (and ties with the k-th); k <= 0 or >= vocab: off."""
        n, V = z.shape
        kth = np.full(n, -np.inf, dtype=z.dtype)
        for k in np.unique(ks[(ks > 0) & (ks < V)]):
            rows = np.flatnonzero(ks == k)
            sub = z if rows.size == n else z[rows]
            kth[rows] = np.partition(sub, V - k, axis=-1)[:, V - k]
        np.copyto(z, -np.inf, where=z < kth[:, None])

    @staticmethod
    def _top_p(e: np.ndarray, top_p: np.ndarray) -> np.ndarray:
        """Threshold per row (e >= threshold is kept): the value of the last token of the most
        probable prefix whose mass first reaches top_p of the row's total. e: unnormalised probs.
        Rows whose prefix lies within their _TOP_P_CANDIDATES largest values (peaked distributions,
        the common case) need only a partition; the others a full sort and a two-level search."""
        R, V = e.shape
        target = top_p.astype(np.float64) * e.sum(axis=-1, dtype=np.float64)
        thresh = np.empty(R, dtype=e.dtype)
        m = min(V, _TOP_P_CANDIDATES)
        cand = e if m == V else np.partition(e, V - m, axis=-1)[:, V - m:]
        cand = -np.sort(-cand, axis=-1)  # the m largest, descending
        cum = np.cumsum(cand, axis=-1, dtype=np.float64)
        done = (cum[:, -1] >= target) if m < V else np.ones(R, dtype=bool)
        cut = np.minimum(np.count_nonzero(cum[done] < target[done, None], axis=-1), m - 1)
        thresh[done] = cand[done][np.arange(cut.size), cut]
        rest = np.flatnonzero(~done)
        if rest.size:
            # sorted ascending after zero padding to whole blocks; mass is summed from the top
            pad = -V % _BLOCK
            srt = np.zeros((rest.size, V + pad), dtype=e.dtype)
            srt[:, pad:] = np.sort(e[rest], axis=-1)
            nb = (V + pad) // _BLOCK
            top_mass = np.cumsum(srt.reshape(rest.size, nb, _BLOCK).sum(axis=-1, dtype=np.float64)[:, ::-1], axis=-1)
            for j, r in enumerate(rest):
                q = int(np.searchsorted(top_mass[j], target[r], side="left"))  # blocks from the top
                if q >= nb:  # rounding: the whole row
                    thresh[r] = srt[j][srt[j] > 0].min()
                    continue
                lo = (nb - 1 - q) * _BLOCK
                vals = srt[j, lo:lo + _BLOCK][::-1]  # this block, descending
                local = np.cumsum(vals, dtype=np.float64)
                if q:
                    local += top_mass[j, q - 1]
                i = min(int(np.searchsorted(local, target[r], side="left")), _BLOCK - 1)
                thresh[r] = vals[i]
        return thresh

    # -- sampling --------------------------------------------------------------------------------
    def sample(self, logits: np.ndarray, reqs: list[Request], eos_ids: set[int]) -> list[SampleResult]:
        B = len(reqs)
        if B == 0:
            return []
        raw = np.asarray(logits, dtype=np.float32)
        if raw.ndim != 2 or raw.shape[0] != B:
            raise ValueError(f"logits of shape {raw.shape} for {B} requests")
        params = [r.params for r in reqs]
        x = self.apply_penalties(raw, reqs, eos_ids)

        greedy = np.fromiter((p.temperature < GREEDY_EPS for p in params), dtype=bool, count=B)
        if greedy.all():
            tokens = np.argmax(x, axis=-1)
        else:
            tokens = np.empty(B, dtype=np.int64)
            g = np.flatnonzero(greedy)
            if g.size:
                tokens[g] = np.argmax(x[g], axis=-1)
            s = np.flatnonzero(~greedy)
            tokens[s] = self._sample_rows(x[s] if g.size else x, [reqs[i] for i in s])

        results = [SampleResult(int(t)) for t in tokens]
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if lp_rows:
            self._logprobs(raw, tokens, lp_rows, params, results)
        return results

    def _sample_rows(self, x: np.ndarray, reqs: list[Request]) -> np.ndarray:
        """Draw one token per row of x (penalised logits) for non-greedy requests."""
        n, V = x.shape
        params = [r.params for r in reqs]
        temp = np.fromiter((p.temperature for p in params), dtype=np.float32, count=n)
        z = np.divide(x, temp[:, None])  # a fresh array: x is never modified
        ks = np.fromiter((p.top_k for p in params), dtype=np.int64, count=n)
        if np.any((ks > 0) & (ks < V)):
            self._top_k(z, ks)
        m = z.max(axis=-1, keepdims=True)
        m[~np.isfinite(m)] = 0.0  # a row with every token masked: handled below
        e = np.exp(np.subtract(z, m, out=z), out=z)  # the largest kept value becomes exactly 1
        min_p = np.fromiter((p.min_p for p in params), dtype=np.float32, count=n)
        if np.any(min_p > 0):  # prob < min_p * max prob  <=>  e < min_p, since max e == 1
            np.copyto(e, 0.0, where=e < min_p[:, None])
        top_p = np.fromiter((p.top_p for p in params), dtype=np.float64, count=n)
        rows = np.flatnonzero(top_p < 1.0)
        if rows.size:
            thresh = np.zeros(n, dtype=e.dtype)
            thresh[rows] = self._top_p(e if rows.size == n else e[rows], top_p[rows])
            np.copyto(e, 0.0, where=e < thresh[:, None])
        return self._draw(e, x, reqs)

    def _draw(self, e: np.ndarray, x: np.ndarray, reqs: list[Request]) -> np.ndarray:
        """Inverse-CDF draw per row of unnormalised probs e, one uniform from each request's own
        generator. The CDF is found in two levels (sums of blocks, then within one block), so no
        [batch, vocab] float64 cumsum is needed."""
        n, V = e.shape
        nb = V // _BLOCK
        sums = [e[:, :nb * _BLOCK].reshape(n, nb, _BLOCK).sum(axis=-1)] if nb else []
        if V % _BLOCK:
            sums.append(e[:, nb * _BLOCK:].sum(axis=-1, keepdims=True))
        cb = np.cumsum(np.concatenate(sums, axis=-1), axis=-1, dtype=np.float64)
        out = np.empty(n, dtype=np.int64)
        for i, req in enumerate(reqs):
            c = cb[i]
            total = c[-1]
            u = self._rng(req).random()  # one draw per token from the request's own generator
            if not total > 0.0:  # nothing left to sample from (cannot happen with sane params)
                out[i] = int(np.argmax(x[i]))
                continue
            target = u * total
            j = min(int(np.searchsorted(c, target, side="right")), len(c) - 1)
            while j > 0 and c[j] == c[j - 1]:  # rounding at the top end: the last block with mass
                j -= 1
            lo, hi = j * _BLOCK, min(j * _BLOCK + _BLOCK, V)
            block = e[i, lo:hi]
            local = np.cumsum(block, dtype=np.float64)
            local += c[j - 1] if j else 0.0
            t = int(np.searchsorted(local, target, side="right"))
            if t >= hi - lo or block[t] == 0.0:  # rounding between the two levels
                t = int(np.flatnonzero(block)[-1])
            out[i] = lo + t
        return out

    @staticmethod
    def _logprobs(raw: np.ndarray, tokens: np.ndarray, rows: list[int], params, results: list[SampleResult]) -> None:
        sub = raw if len(rows) == raw.shape[0] else raw[rows]
        n, V = sub.shape
        m = sub.max(axis=-1)
        tmp = np.subtract(sub, m[:, None])
        lse = m.astype(np.float64) + np.log(np.exp(tmp, out=tmp).sum(axis=-1, dtype=np.float64))
        tok = tokens[rows]
        tok_logit = sub[np.arange(n), tok]
        ranks = np.count_nonzero(sub > tok_logit[:, None], axis=-1) + 1
        kmax = min(max(params[i].logprobs for i in rows), V)
        if kmax > 0:
            top = np.argpartition(sub, V - kmax, axis=-1)[:, V - kmax:]
            vals = np.take_along_axis(sub, top, -1)
            order = np.lexsort((top, -vals), axis=-1)  # by logit descending, then token id
            top = np.take_along_axis(top, order, -1)
        for j, i in enumerate(rows):
            res = results[i]
            res.logprob = float(np.float64(tok_logit[j]) - lse[j])
            res.rank = int(ranks[j])
            k = params[i].logprobs
            if k > 0:
                res.top_logprobs = [(int(t), float(np.float64(sub[j, t]) - lse[j])) for t in top[j, :k]]

    def sample_one(self, raw_logits: np.ndarray, req: Request, eos_ids: set[int]) -> SampleResult:
        """One request's next token (the same as its row in a batched sample())."""
        return self.sample(np.asarray(raw_logits, dtype=np.float32)[None, :], [req], eos_ids)[0]
