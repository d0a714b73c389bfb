"""Sampling: unit tests on the Sampler with crafted logits, then the engine on a tiny random Llama.

Statistical checks draw N seeded samples and compare the empirical distribution p̂ with the exact
renormalised truncated softmax p (computed here independently, in float64, by sorting):
- tokens outside the kept set must never appear (exact);
- total variation: E[TV(p̂, p)] <= 1/2 * sum_i sqrt(p_i (1 - p_i) / N) <= 1/2 sqrt(K / N) (Cauchy-Schwarz,
  K = kept tokens), and TV moves by at most 1/N when one draw changes, so by McDiarmid
  P(TV > E[TV] + t) <= exp(-2 N t^2). With t = sqrt(ln(1/delta) / (2N)), delta = 1e-6, the bound
  fails for a correct sampler with probability <= 1e-6 whatever the logits;
- Pearson chi-square over the kept tokens (those with expected count < 5 pooled) against the
  1 - 1e-6 quantile of chi2(df) (Wilson-Hilferty approximation, accurate to a few percent there).
The draws use fixed seeds, so a run is deterministic; the logits come from the `rng` fixture
(TALLOW_TEST_SEED repeats a run), and the bounds hold for any of them.
"""
import copy
import itertools
import json
import math
import shutil
import time

import numpy as np
import pytest

from tallow import SamplingParams
from tallow.engine.request import Request
from reference_sampler import Sampler

Z_1E6 = 4.753424  # standard normal quantile at 1 - 1e-6
DELTA = 1e-6
_ids = itertools.count()


def mk(prompt=(2, 3), out=(), rid=None, **kw) -> Request:
    kw.setdefault("max_tokens", 100000)
    r = Request(rid or f"r{next(_ids)}", list(prompt), SamplingParams(**kw), 1 << 20)
    r.output_token_ids = list(out)
    return r


def softmax64(x):
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def log_softmax64(x):
    x = np.asarray(x, dtype=np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def ref_probs(logits, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0):
    """The target distribution, written independently of the sampler: temperature, then top-k,
    min-p and top-p (over what is left), renormalised."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    V = len(z)
    p = softmax64(z)
    keep = np.ones(V, dtype=bool)
    if 0 < top_k < V:
        keep &= z >= np.sort(z)[-top_k]
    if min_p > 0:
        keep &= p >= min_p * p[keep].max()
    if top_p < 1:
        q = np.where(keep, p, 0.0)
        q /= q.sum()
        order = np.argsort(-q, kind="stable")
        n_keep = int(np.searchsorted(np.cumsum(q[order]), top_p)) + 1
        prefix = np.zeros(V, dtype=bool)
        prefix[order[:n_keep]] = True
        keep &= prefix
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def chi2_quantile(df: int, z: float = Z_1E6) -> float:
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def tv_bound(k: int, n: int) -> float:
    return 0.5 * math.sqrt(k / n) + math.sqrt(math.log(1 / DELTA) / (2 * n))


def assert_matches(tokens, probs):
    tokens = np.asarray(tokens)
    n, V = len(tokens), len(probs)
    counts = np.bincount(tokens, minlength=V).astype(np.float64)
    support = probs > 0
    assert counts[~support].sum() == 0, f"drew tokens outside the kept set: {np.flatnonzero(counts * ~support)}"
    tv = 0.5 * np.abs(counts / n - probs).sum()
    bound = tv_bound(int(support.sum()), n)
    assert tv <= bound, f"total variation {tv:.4f} > {bound:.4f}"
    exp = probs[support] * n
    obs = counts[support]
    big = exp >= 5
    e = np.append(exp[big], exp[~big].sum()) if (~big).any() else exp
    o = np.append(obs[big], obs[~big].sum()) if (~big).any() else obs
    df = len(e) - 1
    if df > 0:
        chi2 = float(((o - e) ** 2 / e).sum())
        assert chi2 <= chi2_quantile(df), f"chi-square {chi2:.1f} > {chi2_quantile(df):.1f} (df={df})"
    return tv


def draw(logits, n=20000, seed0=0, **params):
    """n tokens from one row of logits: n seeded requests in one batch (one draw each)."""
    V = len(logits)
    proto = mk(seed=seed0, **params)
    reqs = []
    for i in range(n):
        r = copy.copy(proto)
        r.request_id, r.params = f"d{i}", copy.copy(proto.params)
        r.params.seed = seed0 + i
        reqs.append(r)
    batch = np.broadcast_to(np.asarray(logits, dtype=np.float32), (n, V))
    return [r.token_id for r in Sampler(V).sample(batch, reqs, set())]


def draw_sequential(logits, n=5000, seed=0, **params):
    """n tokens from one seeded request (n successive draws of its own generator)."""
    s = Sampler(len(logits))
    r = mk(seed=seed, **params)
    row = np.asarray(logits, dtype=np.float32)[None, :]
    return [s.sample(row, [r], set())[0].token_id for _ in range(n)]


def spread_logits(rng, V=12, scale=1.0):
    """Random logits whose sorted gaps are not tiny (so truncation boundaries are unambiguous)."""
    while True:
        x = rng.normal(0.0, scale, V)
        if np.min(np.diff(np.sort(x))) > 1e-3:
            return x.astype(np.float32)


# -- greedy and temperature -----------------------------------------------------------------------
def test_greedy_is_argmax_for_every_row(rng):
    logits = rng.normal(size=(9, 50)).astype(np.float32)
    reqs = [mk(temperature=0.0) for _ in range(9)]
    got = [r.token_id for r in Sampler(50).sample(logits, reqs, set())]
    assert got == np.argmax(logits, axis=-1).tolist()
    # mixed batch: greedy rows (and temperature below 1e-5) are argmax whatever the others do
    reqs = [mk(temperature=0.0 if i % 3 == 0 else (1e-7 if i % 3 == 1 else 1.5), seed=i) for i in range(9)]
    got = [r.token_id for r in Sampler(50).sample(logits, reqs, set())]
    for i in range(0, 9, 3):
        assert got[i] == int(np.argmax(logits[i])) and got[i + 1] == int(np.argmax(logits[i + 1]))


def test_greedy_ties_pick_the_lowest_id():
    logits = np.array([[0.0, 2.0, 1.0, 2.0]], dtype=np.float32)
    assert Sampler(4).sample(logits, [mk(temperature=0)], set())[0].token_id == 1


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_distribution(rng, temperature):
    logits = spread_logits(rng, V=10, scale=1.0)
    assert_matches(draw(logits, temperature=temperature), ref_probs(logits, temperature=temperature))


def test_sequential_draws_of_one_request_follow_the_distribution(rng):
    logits = spread_logits(rng, V=8)
    toks = draw_sequential(logits, n=6000, seed=11, temperature=0.9)
    assert_matches(toks, ref_probs(logits, temperature=0.9))


# -- truncation -----------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 3, 7])
def test_top_k(rng, k):
    logits = spread_logits(rng, V=12)
    probs = ref_probs(logits, temperature=0.8, top_k=k)
    assert (probs > 0).sum() == k
    assert_matches(draw(logits, temperature=0.8, top_k=k), probs)


def test_top_k_keeps_ties_and_off_values():
    logits = np.array([3.0, 2.0, 2.0, 1.0, 0.0], dtype=np.float32)
    toks = set(draw(logits, n=3000, top_k=2, temperature=5.0))
    assert toks == {0, 1, 2}  # ties with the k-th value are kept
    for off in (-1, 0, 5, 99):
        assert len(set(draw(logits, n=3000, top_k=off, temperature=5.0))) == 5


@pytest.mark.parametrize("top_p", [0.3, 0.6, 0.9])
def test_top_p(rng, top_p):
    logits = spread_logits(rng, V=12, scale=1.2)
    probs = ref_probs(logits, top_p=top_p)
    # the kept set is the smallest most-probable prefix with mass >= top_p
    p = softmax64(logits)
    kept = np.sort(p[probs > 0])[::-1]
    assert kept.sum() >= top_p - 1e-12 and kept[:-1].sum() < top_p
    assert_matches(draw(logits, top_p=top_p), probs)


def test_top_p_tiny_is_argmax_and_one_keeps_all(rng):
    logits = spread_logits(rng, V=12)
    assert set(draw(logits, n=500, top_p=1e-9)) == {int(np.argmax(logits))}
    assert_matches(draw(logits, top_p=1.0), ref_probs(logits))


@pytest.mark.parametrize("V", [5000, 1000, 300, 64])
def test_top_p_threshold_peaked_and_flat(rng, V):
    """The threshold equals a full-sort reference on peaked rows (prefix within the first
    candidates) and flat ones (prefix longer than that: the full-sort path), with masked tokens."""
    rows = [rng.normal(0, 0.05, V), rng.normal(0, 3, V), rng.normal(0, 1, V), rng.normal(0, 8, V)]
    logits = np.stack(rows * 3).astype(np.float32)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    e[-4:, ::3] = 0.0  # tokens already removed by top-k / min-p
    top_p = rng.choice([0.05, 0.3, 0.7, 0.95, 0.999, 1e-6], len(e))
    thresh = Sampler._top_p(e, top_p)
    for row, tp, t in zip(e.astype(np.float64), top_p, thresh):
        order = np.argsort(-row, kind="stable")
        n_keep = int(np.searchsorted(np.cumsum(row[order]), tp * row.sum())) + 1
        assert np.array_equal(row >= t, row >= row[order[n_keep - 1]])


@pytest.mark.parametrize("min_p,temperature", [(0.05, 1.0), (0.2, 1.0), (0.5, 0.7), (0.1, 2.0)])
def test_min_p_matches_truncated_softmax(rng, min_p, temperature):
    logits = spread_logits(rng, V=16, scale=1.5)
    probs = ref_probs(logits, temperature=temperature, min_p=min_p)
    p = softmax64(np.asarray(logits, np.float64) / temperature)
    assert np.array_equal(probs > 0, p >= min_p * p.max())
    assert 0 < (probs > 0).sum() < 16 or min_p <= p.min() / p.max()
    assert_matches(draw(logits, temperature=temperature, min_p=min_p), probs)


@pytest.mark.parametrize("case", range(6))
def test_combined_truncations(rng, case):
    logits = spread_logits(rng, V=20, scale=1.5)
    params = dict(temperature=float(rng.uniform(0.5, 1.5)), top_k=int(rng.integers(3, 15)),
                  top_p=float(rng.uniform(0.5, 0.95)), min_p=float(rng.uniform(0.0, 0.15)))
    assert_matches(draw(logits, seed0=1000 * case, **params), ref_probs(logits, **params))


# -- penalties --------------------------------------------------------------------------------------
def penalised_ref(logits, prompt, out, rep=1.0, freq=0.0, pres=0.0):
    """vLLM / Hugging Face semantics written out token by token."""
    x = np.array(logits, dtype=np.float32)
    for t in set(prompt) | set(out):
        x[t] = x[t] / np.float32(rep) if x[t] > 0 else x[t] * np.float32(rep)
    for t in set(out):
        x[t] -= np.float32(freq) * out.count(t) + np.float32(pres)
    return x


def test_repetition_penalty_exact():
    logits = np.array([2.0, -1.5, 0.0, 3.0, -0.5, 1.0, 4.0, -2.0], dtype=np.float32)
    prompt, out = [0, 1, 1, 2], [4, 4, 5]
    r = mk(prompt, out, repetition_penalty=1.3)
    got = Sampler(8).apply_penalties(logits[None], [r], set())[0]
    expected = logits.copy()
    expected[0] = 2.0 / np.float32(1.3)  # positive: divided (prompt token)
    expected[1] = -1.5 * np.float32(1.3)  # negative: multiplied (prompt token, counted once)
    expected[4] = -0.5 * np.float32(1.3)  # output token
    expected[5] = 1.0 / np.float32(1.3)
    np.testing.assert_array_equal(got, expected)  # 0.0 stays 0, unseen tokens untouched
    np.testing.assert_array_equal(got, penalised_ref(logits, prompt, out, rep=1.3))


def test_repetition_penalty_matches_transformers(rng):
    torch = pytest.importorskip("torch")
    tr = pytest.importorskip("transformers")
    V = 64
    logits = rng.normal(0, 2, (3, V)).astype(np.float32)
    seqs = [rng.integers(0, V, n).tolist() for n in (5, 17, 40)]
    reqs = [mk(s[:3], s[3:], repetition_penalty=pen) for s, pen in zip(seqs, (1.2, 0.8, 2.0))]
    got = Sampler(V).apply_penalties(logits, reqs, set())
    for i, (s, pen) in enumerate(zip(seqs, (1.2, 0.8, 2.0))):
        proc = tr.RepetitionPenaltyLogitsProcessor(penalty=pen)
        ref = proc(torch.tensor([s]), torch.tensor(logits[i:i + 1])).numpy()[0]
        np.testing.assert_allclose(got[i], ref, rtol=1e-6, atol=1e-6)


def test_frequency_and_presence_penalties_exact_and_output_only():
    logits = np.arange(10, dtype=np.float32) - 4.0
    prompt, out = [0, 1, 2, 3], [3, 5, 5, 5, 7]
    r = mk(prompt, out, frequency_penalty=0.5, presence_penalty=0.25)
    got = Sampler(10).apply_penalties(logits[None], [r], set())[0]
    expected = logits.copy()
    expected[3] -= 0.5 * 1 + 0.25
    expected[5] -= 0.5 * 3 + 0.25
    expected[7] -= 0.5 * 1 + 0.25
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)  # prompt-only tokens 0, 1, 2 untouched
    assert got[0] == logits[0] and got[1] == logits[1] and got[2] == logits[2]
    # negative penalties reward repetition
    r = mk(prompt, out, frequency_penalty=-1.0, presence_penalty=-2.0)
    got = Sampler(10).apply_penalties(logits[None], [r], set())[0]
    assert got[5] == pytest.approx(logits[5] + 3 + 2)


def test_all_penalties_together_in_a_batch(rng):
    V = 40
    logits = rng.normal(0, 2, (5, V)).astype(np.float32)
    cfgs = [dict(), dict(repetition_penalty=1.4), dict(frequency_penalty=0.7),
            dict(repetition_penalty=0.9, frequency_penalty=-0.3, presence_penalty=1.1), dict(presence_penalty=2.0)]
    seqs = [(rng.integers(0, V, 6).tolist(), rng.integers(0, V, 12).tolist()) for _ in cfgs]
    reqs = [mk(p, o, **c) for (p, o), c in zip(seqs, cfgs)]
    got = Sampler(V).apply_penalties(logits, reqs, set())
    for i, ((p, o), c) in enumerate(zip(seqs, cfgs)):
        ref = penalised_ref(logits[i], p, o, c.get("repetition_penalty", 1.0), c.get("frequency_penalty", 0.0),
                            c.get("presence_penalty", 0.0))
        np.testing.assert_allclose(got[i], ref, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(logits, logits.copy())  # the input is not modified


def test_penalty_state_follows_a_growing_output(rng):
    V = 30
    s = Sampler(V)
    r = mk([1, 2, 3], [], rid="grow", repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.2,
           temperature=0)
    for _ in range(40):
        logits = rng.normal(0, 1, (1, V)).astype(np.float32)
        got = s.apply_penalties(logits, [r], set())[0]
        fresh = Sampler(V).apply_penalties(logits, [r], set())[0]
        np.testing.assert_array_equal(got, fresh)
        np.testing.assert_allclose(got, penalised_ref(logits[0], r.prompt_token_ids, r.output_token_ids, 1.5, 0.4,
                                                      0.2), rtol=0, atol=1e-5)
        r.output_token_ids.append(s.sample(logits, [r], set())[0].token_id)
    s.forget("grow")
    assert "grow" not in s._penalty and "grow" not in s._rngs


def test_greedy_sees_penalties():
    logits = np.array([[5.0, 4.9, 1.0]], dtype=np.float32)
    assert Sampler(3).sample(logits, [mk([7], [0], temperature=0)], set())[0].token_id == 0
    assert Sampler(3).sample(logits, [mk([7], [0], temperature=0, repetition_penalty=1.1)], set())[0].token_id == 1
    assert Sampler(3).sample(logits, [mk([0], [], temperature=0, frequency_penalty=1.0)], set())[0].token_id == 0


# -- logit_bias ----------------------------------------------------------------------------------------
def test_logit_bias_is_added_before_the_penalties():
    """Each biased logit gets its bias (in whole 2^-16 steps: 0.3 becomes 19661 / 65536), then the
    repetition penalty sees the biased value (vLLM's order); other rows and tokens are untouched."""
    logits = np.array([[2.0, -1.5, 0.5, 3.0, -0.5], [1.0, 1.0, 1.0, 1.0, 1.0]], dtype=np.float32)
    bias = {0: -3.0, 2: 0.3, 4: 100}
    r = mk([0, 1], [2], repetition_penalty=2.0, logit_bias=bias)
    got = Sampler(5).apply_penalties(logits, [r, mk()], set())
    q03 = np.float32(round(0.3 * 65536) / 65536)
    assert q03 != np.float32(0.3) and abs(q03 - 0.3) <= 2 ** -17
    expected = logits[0].copy()
    expected[0] = np.float32(2.0 - 3.0) * np.float32(2.0)  # biased to -1, then negative: multiplied
    expected[1] = np.float32(-1.5) * np.float32(2.0)  # prompt token, no bias
    expected[2] = (np.float32(0.5) + q03) / np.float32(2.0)  # output token, biased first
    expected[4] = np.float32(-0.5) + np.float32(100)
    np.testing.assert_array_equal(got[0], expected)
    np.testing.assert_array_equal(got[1], logits[1])
    np.testing.assert_array_equal(logits[0], [2.0, -1.5, 0.5, 3.0, -0.5])  # the input is not modified


def test_logit_bias_steers_greedy_and_sampled_tokens(rng):
    V = 50
    logits = rng.normal(0, 1, (3, V)).astype(np.float32)
    ban = int(np.argmax(logits[0]))
    reqs = [mk(temperature=0, logit_bias={ban: -100}), mk(temperature=0, logit_bias={7: 100}),
            mk(temperature=1.0, seed=3, logit_bias={t: -100 for t in range(V) if t not in (11, 12)})]
    s = Sampler(V)
    for _ in range(20):
        got = [x.token_id for x in s.sample(logits, reqs, set())]
        assert got[0] != ban and got[0] == int(np.argsort(-logits[0])[1])
        assert got[1] == 7 and got[2] in (11, 12)
        for r, t in zip(reqs, got):
            r.output_token_ids.append(t)
    for r in reqs:
        s.forget(r.request_id)
    assert not s._bias


# -- min_tokens, EOS, stop ids ----------------------------------------------------------------------
def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    V, eos = 8, {1}
    logits = np.array([[0.0, 9.0, 8.0, 7.0, 1.0, 0.0, 0.0, 0.0]], dtype=np.float32)
    s = Sampler(V)
    for n_out, banned in ((0, {1, 2}), (2, {1, 2}), (3, set())):
        r = mk([5], [4] * n_out, min_tokens=3, stop_token_ids=[2], temperature=0)
        x = s.apply_penalties(logits, [r], eos)[0]
        assert {i for i in range(V) if x[i] == -np.inf} == banned
        assert s.sample(logits, [r], eos)[0].token_id == (3 if banned else 1)
    r = mk([5], [], min_tokens=3, stop_token_ids=[2], ignore_eos=True, temperature=0)
    x = s.apply_penalties(logits, [r], eos)[0]
    assert x[1] == 9.0 and x[2] == -np.inf  # ignore_eos: EOS stays allowed, stop ids are still masked
    # sampling never draws a masked token
    toks = draw(logits[0], n=2000, min_tokens=1, stop_token_ids=[2, 3], temperature=3.0)
    assert not {2, 3} & set(toks)


# -- seeds and batches ------------------------------------------------------------------------------
def random_params(rng, seed=None):
    kind = int(rng.integers(0, 5))
    return dict(
        temperature=0.0 if kind == 0 else float(rng.uniform(0.3, 2.0)),
        top_k=int(rng.choice([-1, 1, 5, 50])), top_p=float(rng.choice([1.0, 0.9, 0.5])),
        min_p=float(rng.choice([0.0, 0.05, 0.2])), repetition_penalty=float(rng.choice([1.0, 1.3])),
        frequency_penalty=float(rng.choice([0.0, 0.5])), presence_penalty=float(rng.choice([0.0, -0.4])),
        seed=seed, logprobs=int(rng.choice([0, 3])) if kind == 4 else None)


def test_seeded_request_same_tokens_alone_and_in_any_batch(rng):
    V, steps = 300, 60
    logits = rng.normal(0, 2, (steps, V)).astype(np.float32)
    target = dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, repetition_penalty=1.1, seed=1234)

    def run(batch_size):
        s = Sampler(V)
        me = mk([3, 4], rid="me", **target)
        others = [mk(rng.integers(0, V, 4).tolist(), rid=f"o{i}",
                     **random_params(rng, seed=None if i % 2 else int(rng.integers(1 << 30))))
                  for i in range(batch_size - 1)]
        toks = []
        for t in range(steps):
            pos = int(rng.integers(0, batch_size))
            batch = others[:pos] + [me] + others[pos:]
            rows = rng.normal(0, 2, (batch_size, V)).astype(np.float32)
            rows[pos] = logits[t]
            res = s.sample(rows, batch, {1})
            me.output_token_ids.append(res[pos].token_id)
            for o, r in zip(others, res[:pos] + res[pos + 1:]):
                o.output_token_ids.append(r.token_id)
            toks.append(res[pos].token_id)
        return toks

    alone = run(1)
    assert alone == run(1)  # reproducible across runs
    for bs in (2, 7, 33):
        assert run(bs) == alone  # and across batch compositions
    # another seed gives another stream
    target["seed"] = 4321
    assert run(1) != alone


def test_unseeded_requests_differ():
    V = 1000
    logits = np.zeros((1, V), dtype=np.float32)
    a, b = Sampler(V), Sampler(V)
    ra, rb = mk(rid="a", temperature=1.0), mk(rid="a", temperature=1.0)
    ta = [a.sample(logits, [ra], set())[0].token_id for _ in range(20)]
    tb = [b.sample(logits, [rb], set())[0].token_id for _ in range(20)]
    assert ta != tb


def test_batch_result_equals_each_row_alone(rng):
    V, B = 500, 48
    logits = rng.normal(0, 3, (B, V)).astype(np.float32)
    cfgs = [random_params(rng, seed=i) for i in range(B)]
    outs = [rng.integers(0, V, int(rng.integers(0, 10))).tolist() for _ in range(B)]
    batch = Sampler(V).sample(logits, [mk([1, 2], o, **c) for o, c in zip(outs, cfgs)], {1})
    for i in range(B):
        alone = Sampler(V).sample_one(logits[i], mk([1, 2], outs[i], **cfgs[i]), {1})
        assert alone == batch[i]


# -- logprobs ---------------------------------------------------------------------------------------
def test_logprobs_are_raw_log_softmax_with_ranks(rng):
    V, B = 200, 6
    logits = rng.normal(0, 3, (B, V)).astype(np.float32)
    cfgs = [dict(temperature=0, logprobs=5), dict(temperature=0.7, seed=3, logprobs=0),
            dict(temperature=1.3, seed=4, top_k=10, repetition_penalty=1.5, logprobs=20),
            dict(temperature=0.5, seed=5, frequency_penalty=1.0, logprobs=1), dict(temperature=1.0, seed=6),
            dict(temperature=0, min_tokens=2, logprobs=3)]
    reqs = [mk([1, 2, 3], [4, 4, 5] if i < 5 else [], **c) for i, c in enumerate(cfgs)]
    res = Sampler(V).sample(logits, reqs, {int(np.argmax(logits[5]))})
    for row, c, r in zip(logits, cfgs, res):
        lp = log_softmax64(row)
        if c.get("logprobs") is None:
            assert r.logprob is None and r.top_logprobs is None and r.rank is None
            continue
        # the model's distribution, not the penalised / tempered / truncated one
        assert r.logprob == pytest.approx(lp[r.token_id], abs=1e-6)
        assert r.rank == 1 + int((row > row[r.token_id]).sum())
        if c["logprobs"] == 0:
            assert r.top_logprobs is None
            continue
        top = r.top_logprobs
        assert [t for t, _ in top] == np.argsort(-lp, kind="stable")[:c["logprobs"]].tolist()
        np.testing.assert_allclose([v for _, v in top], lp[[t for t, _ in top]], atol=1e-6)
    assert res[0].rank == 1 and res[0].token_id == res[0].top_logprobs[0][0]
    assert res[5].rank == 2  # min_tokens masked the argmax (the EOS): the runner-up was taken


# -- speed --------------------------------------------------------------------------------------------
def test_batched_sampling_is_fast(rng):
    """A 64-row batch over a 32k vocabulary with mixed settings, once per step: the sampler must not
    be the bottleneck (well under the model's step time). Loose bound for slow CI machines."""
    V, B = 32000, 64
    logits = rng.normal(0, 3, (B, V)).astype(np.float32)
    reqs = [mk(rng.integers(0, V, 200).tolist(), rng.integers(0, V, 50).tolist(), **random_params(rng, seed=i))
            for i in range(B)]
    s = Sampler(V)
    s.sample(logits, reqs, {1})
    t0 = time.perf_counter()
    for _ in range(3):
        s.sample(logits, reqs, {1})
    dt = (time.perf_counter() - t0) / 3
    print(f"sample(): {dt * 1e3:.1f} ms for {B} rows x {V}")
    assert dt < 1.0


# == engine level (tiny random Llama) =================================================================
torch = pytest.importorskip("torch", reason="transformers (with CPU torch) makes the test model")
pytest.importorskip("transformers", reason="transformers makes the test model")

from engine_models import hf_greedy, make_llama  # noqa: E402
from tallow import LLM  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_sampling")
    model = make_llama(path, seed=3)
    r = np.random.default_rng(99)
    prompts = [r.integers(2, 320, n).tolist() for n in (6, 19, 70)]
    return path, model, prompts


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].double().numpy()


def assert_pool_free(llm):
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert not llm.engine.scheduler.has_unfinished and not llm.engine.groups
    assert not llm.engine.sampler._seeds and not llm.engine.sampler._penalty and not llm.engine.runner.requests


def ids_of(prompt):
    return {"prompt_token_ids": prompt}


def test_engine_seeded_sampling_reproducible_across_runs_and_batches(llama):
    path, _, prompts = llama
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, min_p=0.01, seed=77, max_tokens=24, ignore_eos=True)
    llm = LLM(str(path))
    alone = llm.generate(ids_of(prompts[1]), sp)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.2, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=5, repetition_penalty=1.2, max_tokens=20, ignore_eos=True)]
    batch = llm.generate([ids_of(prompts[0]), ids_of(prompts[1]), ids_of(prompts[2]), ids_of(prompts[0])],
                         [others[0], sp, others[1], others[2]])
    assert batch[1].outputs[0].token_ids == alone
    assert_pool_free(llm)
    again = LLM(str(path), prefill_chunk_size=8, max_num_batched_tokens=16)  # another engine, chunked prefill
    assert again.generate(ids_of(prompts[1]), sp)[0].outputs[0].token_ids == alone
    assert again.generate(ids_of(prompts[1]), sp.clone(seed=78))[0].outputs[0].token_ids != alone
    assert_pool_free(again)


def test_engine_default_seed_reproducible_but_requests_differ(llama):
    path, _, prompts = llama
    sp = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)

    def run():
        llm = LLM(str(path), seed=123)
        outs = llm.generate([ids_of(prompts[0])] * 3, sp)
        return [o.outputs[0].token_ids for o in outs]

    a, b = run(), run()
    assert a == b  # the engine's seed makes the run reproducible
    assert len({tuple(t) for t in a}) == 3  # yet equal unseeded prompts are sampled independently


def test_engine_repetition_penalty_matches_transformers(llama):
    path, model, prompts = llama
    llm = LLM(str(path))
    for p in prompts[:2]:
        out = llm.generate(ids_of(p), SamplingParams(temperature=0, repetition_penalty=1.8, max_tokens=32,
                                                     ignore_eos=True))[0].outputs[0].token_ids
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                 repetition_penalty=1.8, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert out == ref
        assert out != hf_greedy(model, p, 32)  # the penalty changed something
    assert_pool_free(llm)


def penalised_greedy_ref(model, prompt, n, freq, pres):
    out = []
    for _ in range(n):
        x = hf_logits(model, prompt + out)
        for t in set(out):
            x[t] -= freq * out.count(t) + pres
        out.append(int(np.argmax(x)))
    return out


def test_engine_frequency_presence_and_server_defaults(llama):
    path, model, prompts = llama
    p = prompts[0]
    n = 24
    plain = hf_greedy(model, p, n)
    ref = penalised_greedy_ref(model, p, n, 1.5, 0.5)
    assert ref != plain
    base = dict(temperature=0, max_tokens=n, ignore_eos=True)
    llm = LLM(str(path))
    got = llm.generate(ids_of(p), SamplingParams(frequency_penalty=1.5, presence_penalty=0.5, **base))[0]
    assert got.outputs[0].token_ids == ref
    # server-wide defaults fill unset fields; a request's own value (even 0) wins
    srv = LLM(str(path), frequency_penalty=1.5, presence_penalty=0.5)
    assert srv.generate(ids_of(p), SamplingParams(**base))[0].outputs[0].token_ids == ref
    assert srv.generate(ids_of(p), SamplingParams(frequency_penalty=0.0, presence_penalty=0.0, **base)
                        )[0].outputs[0].token_ids == plain
    other = penalised_greedy_ref(model, p, n, 1.5, 2.0)
    assert srv.generate(ids_of(p), SamplingParams(presence_penalty=2.0, **base))[0].outputs[0].token_ids == other
    with pytest.raises(ValueError, match="frequency_penalty"):
        LLM(str(path), frequency_penalty=3.0)
    assert_pool_free(srv)


def test_engine_logprobs_match_transformers(llama):
    path, model, prompts = llama
    p = prompts[1]
    llm = LLM(str(path))
    sp = SamplingParams(temperature=0.8, seed=5, repetition_penalty=1.3, logprobs=3, max_tokens=12, ignore_eos=True)
    o = llm.generate(ids_of(p), sp)[0].outputs[0]
    assert len(o.logprobs) == len(o.token_ids) == 12
    total = 0.0
    for i, (tok, entry) in enumerate(zip(o.token_ids, o.logprobs)):
        x = hf_logits(model, p + o.token_ids[:i])
        lp = log_softmax64(x)
        assert list(entry)[0] == tok
        assert entry[tok].logprob == pytest.approx(lp[tok], abs=1e-4)
        assert entry[tok].rank == 1 + int((x > x[tok] + 1e-5).sum())
        top = [t for _, t in sorted((v.rank, t) for t, v in entry.items() if v.rank <= 3)]
        assert top == np.argsort(-lp)[:3].tolist()
        assert [entry[t].rank for t in top] == [1, 2, 3]
        assert all(entry[t].decoded_token == f"t{t}" for t in entry)
        total += entry[tok].logprob
    assert o.cumulative_logprob == pytest.approx(total)
    assert_pool_free(llm)


def test_engine_max_tokens(llama):
    path, model, prompts = llama
    llm = LLM(str(path))
    for n in (1, 2, 7):
        o = llm.generate(ids_of(prompts[0]), SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
        assert o.outputs[0].token_ids == hf_greedy(model, prompts[0], n)
        assert o.outputs[0].finish_reason == "length" and o.usage["completion_tokens"] == n
    assert_pool_free(llm)


def test_engine_stop_token_ids(llama):
    path, model, prompts = llama
    p = prompts[0]
    full = hf_greedy(model, p, 40)
    k = next(i for i in range(3, 40) if full[i] not in full[:i])
    llm = LLM(str(path))
    base = dict(temperature=0, max_tokens=40, ignore_eos=True)
    o = llm.generate(ids_of(p), SamplingParams(stop_token_ids=[full[k], 319], **base))[0].outputs[0]
    assert o.token_ids == full[:k + 1] and o.finish_reason == "stop" and o.stop_reason == full[k]
    tok = llm.get_tokenizer()
    assert o.text.strip() == tok.decode(full[:k])  # the stop token's text is left out
    o = llm.generate(ids_of(p), SamplingParams(stop_token_ids=[full[k]], include_stop_str_in_output=True,
                                               **base))[0].outputs[0]
    assert o.text.strip() == tok.decode(full[:k + 1])
    # min_tokens: the stop id cannot end the output before min_tokens tokens
    o = llm.generate(ids_of(p), SamplingParams(stop_token_ids=[full[0]], min_tokens=3, **base))[0].outputs[0]
    assert full[0] not in o.token_ids[:3] and len(o.token_ids) >= 3
    assert_pool_free(llm)


def stream_texts(llm, prompt, sp):
    seen, texts = "", []
    for d in llm.generate_stream(prompt, sp):
        seen += d.outputs[0].text
        texts.append(seen)
    return texts


def test_engine_stop_strings_spanning_tokens_and_streaming(llama):
    path, model, prompts = llama
    p = prompts[2]
    llm = LLM(str(path))
    base = dict(temperature=0, max_tokens=48, ignore_eos=True)
    full = llm.generate(ids_of(p), SamplingParams(**base))[0].outputs[0].text
    words = full.split()
    assert len(words) == 48
    # a stop string that starts inside token 10 and ends inside token 12 (spans three tokens)
    span = f"{words[10][1:]} {words[11]} {words[12][:2]}"
    at = full.find(span)
    assert 0 <= at <= full.find(words[10]) + len(words[10])
    for include in (False, True):
        sp = SamplingParams(stop=["never there", span], include_stop_str_in_output=include, **base)
        o = llm.generate(ids_of(p), sp)[0].outputs[0]
        want = full[:at + (len(span) if include else 0)]
        assert o.text == want and o.finish_reason == "stop" and o.stop_reason == span
        # the tokens run up to the one that completed the stop string
        assert len(o.token_ids) == 13
        texts = stream_texts(llm, ids_of(p), sp)
        assert texts[-1] == want
        assert all(want.startswith(t) for t in texts)  # a delta never runs past the cut
    # several stop strings: the one that appears first in the text wins
    first = f"{words[5][1:]} {words[6]}"
    o = llm.generate(ids_of(p), SamplingParams(stop=[span, first], **base))[0].outputs[0]
    assert o.text == full[:full.find(first)] and o.stop_reason == first
    # a stop string held back while incomplete, then released when it does not complete
    near = f"{words[20]} {words[21]} t99999"
    texts = stream_texts(llm, ids_of(p), SamplingParams(stop=[near], **base))
    assert texts[-1] == full and all(full.startswith(t) for t in texts)
    assert_pool_free(llm)


def test_engine_stop_string_before_min_tokens_is_ignored(llama):
    path, _, prompts = llama
    p = prompts[2]
    llm = LLM(str(path))
    base = dict(temperature=0, max_tokens=30, ignore_eos=True)
    full = llm.generate(ids_of(p), SamplingParams(**base))[0].outputs[0].text
    words = full.split()
    stop = f"{words[2]} {words[3]}"  # completes at token 4
    assert full.count(stop) == 1
    o = llm.generate(ids_of(p), SamplingParams(stop=[stop], **base))[0].outputs[0]
    assert o.finish_reason == "stop" and len(o.token_ids) == 4
    sp = SamplingParams(stop=[stop], min_tokens=10, **base)
    o = llm.generate(ids_of(p), sp)[0].outputs[0]
    assert o.text == full and o.finish_reason == "length"
    texts = stream_texts(llm, ids_of(p), sp)
    assert texts[-1] == full and all(full.startswith(t) for t in texts)
    assert_pool_free(llm)


@pytest.fixture(scope="module")
def eos_llama(llama, tmp_path_factory):
    """The same model with EOS set to the greedy first token of prompts[0]."""
    path, model, prompts = llama
    eos = hf_greedy(model, prompts[0], 1)[0]
    dst = tmp_path_factory.mktemp("llama_eos")
    for f in path.iterdir():
        shutil.copy(f, dst / f.name)
    for name in ("config.json", "generation_config.json"):
        f = dst / name
        if f.exists():
            cfg = json.loads(f.read_text())
            cfg["eos_token_id"] = eos
            f.write_text(json.dumps(cfg))
    tc = json.loads((dst / "tokenizer_config.json").read_text())
    tc["eos_token"] = f"t{eos}"
    (dst / "tokenizer_config.json").write_text(json.dumps(tc))
    return dst, eos


def test_engine_eos_min_tokens_ignore_eos(llama, eos_llama):
    _, model, prompts = llama
    path, eos = eos_llama
    p = prompts[0]
    llm = LLM(str(path))
    assert eos in llm.engine.eos_ids
    o = llm.generate(ids_of(p), SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    assert o.token_ids == [eos] and o.finish_reason == "stop" and o.text == "" and o.stop_reason is None
    o = llm.generate(ids_of(p), SamplingParams(temperature=0, max_tokens=10, min_tokens=4))[0].outputs[0]
    assert len(o.token_ids) >= 4 and eos not in o.token_ids[:4]
    x = hf_logits(model, p)
    x[eos] = -np.inf
    assert o.token_ids[0] == int(np.argmax(x))  # the runner-up once EOS is masked
    o = llm.generate(ids_of(p), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    assert o.token_ids == hf_greedy(model, p, 12) and o.finish_reason == "length"
    # sampling with min_tokens never draws EOS early either
    outs = llm.generate([ids_of(p)] * 8, SamplingParams(temperature=1.5, seed=1, max_tokens=6, min_tokens=6))
    assert all(eos not in r.outputs[0].token_ids and len(r.outputs[0].token_ids) == 6 for r in outs)
    assert_pool_free(llm)


def test_engine_n_completions_share_prompt_blocks(llama):
    path, _, prompts = llama
    p = prompts[2]  # 70 tokens: 4 full blocks of 16 and 6 more
    llm = LLM(str(path), prefix_cache=False, block_size=16)
    eng = llm.engine
    rid = eng.add_request(ids_of(p), SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=5, ignore_eos=True))
    seqs = [eng.scheduler.requests[s.req_id] for s in eng.groups[rid].seqs]
    outs = []
    while not all(s.num_output_tokens >= 1 for s in seqs):
        outs += eng.step()
    tables = [eng.kv.block_ids(s) for s in seqs]
    assert tables[0][:4] == tables[1][:4] == tables[2][:4]  # the prompt's full blocks, shared
    assert len({t[4] for t in tables}) == 3  # each completion has its own partial block
    assert eng.kv.pool.num_blocks - eng.kv.num_free_blocks == 4 + 3
    while eng.has_unfinished_requests():
        outs += eng.step()
    final = {}
    for d in outs:
        for c in d.outputs:
            final.setdefault(c.index, []).extend(c.token_ids)
    assert sorted(final) == [0, 1, 2] and all(len(v) == 5 for v in final.values())
    assert len({tuple(v) for v in final.values()}) > 1
    assert_pool_free(llm)
