"""The engine's sampler (worker/sampler.py: the device ops, on every device) against the numpy
reference (reference_sampler.py). The ops run on CPU tensors too, so these run everywhere; on a CUDA
machine the same checks run on the device as well.

Greedy choices (with penalties and min_tokens masks) must equal the reference's; seeded draws must
not depend on the batch; logprobs must equal the reference's (1e-5)."""
import itertools

import numpy as np
import pytest

import tallow
from tallow import SamplingParams
from engine_models import DEVICES, cuda_ok as _cuda_ok  # noqa: F401
from reference_sampler import Sampler
from tallow.engine.request import Request
from tallow.worker.sampler import Sampler as GpuSampler

_ids = itertools.count()




def mk(prompt=(2, 3), out=(), rid=None, **kw) -> Request:
    kw.setdefault("max_tokens", 100000)
    r = Request(rid or f"g{next(_ids)}", list(prompt), SamplingParams(**kw), 1 << 20)
    r.output_token_ids = list(out)
    return r


def on(logits: np.ndarray, device: str, dtype="float32") -> tallow.Tensor:
    t = tallow.tensor(np.array(logits, dtype=np.float32), dtype=dtype)
    return t if device == "cpu" else t.to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_equals_sampler(device, rng):
    B, V = 6, 300
    logits = (rng.standard_normal((B, V)) * 3).astype(np.float32)
    reqs = [mk(temperature=0.0) for _ in range(B)]
    got = GpuSampler(V).sample(on(logits, device), reqs, set())
    want = Sampler(V).sample(logits, reqs, set())
    assert [r.token_id for r in got] == [r.token_id for r in want]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_penalties_and_min_tokens_equal_sampler(device, dtype, rng):
    V = 200
    B = 8
    # Six "hot" tokens per row at fixed gaps (3.0, 2.8, ... 2.0, plus noise far below a gap) above a random
    # background below 0: the penalties and masks then change rows 0, 1, 2, 4 and 6 on every seed.
    logits = (-np.abs(rng.standard_normal((B, V)))).astype(np.float32)
    top = np.stack([rng.permutation(V) for _ in range(B)])
    for i in range(B):
        logits[i, top[i, :6]] = 3.0 - 0.2 * np.arange(6) + rng.uniform(-0.03, 0.03, 6)
    reqs = []
    for i in range(B):
        hot = [int(t) for t in top[i, :6]]  # the best tokens have been seen, so penalties change the argmax
        kw = [dict(repetition_penalty=1.8), dict(frequency_penalty=1.5), dict(presence_penalty=2.0),
              dict(repetition_penalty=0.7, frequency_penalty=0.4, presence_penalty=-0.3),
              dict(min_tokens=5, stop_token_ids=[hot[0]]), dict(min_tokens=5, ignore_eos=True),
              dict(min_tokens=5, repetition_penalty=1.5, stop_token_ids=[hot[1], V + 7]), dict()][i]
        reqs.append(mk(prompt=[hot[2], hot[3], 5000], out=[hot[0], hot[0], hot[1]], temperature=0.0, **kw))
    eos = {int(top[i, 2]) for i in range(B)} | {int(top[5, 0])}
    rounded = on(logits, "cpu", dtype).to("float32").numpy()
    gs, s = GpuSampler(V), Sampler(V)
    for step in range(3):  # incremental state: outputs grow between steps
        got = [r.token_id for r in gs.sample(on(logits, device, dtype), reqs, eos)]
        want = [r.token_id for r in s.sample(rounded, reqs, eos)]
        assert got == want, f"step {step}"
        if step == 0:  # the penalties and masks do change choices
            assert sum(g != int(np.argmax(rounded[i])) for i, g in enumerate(got)) >= 5
        for r, t in zip(reqs, want):
            r.append_token(t)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logit_bias_equals_sampler(device, dtype, rng):
    """logit_bias (both signs, with and without penalties, greedy and seeded) adds what Sampler adds:
    the greedy choices are equal, and so are the penalised logits the seeded draws start from."""
    V, B = 300, 6
    logits = (rng.standard_normal((B, V)) * 2).astype(np.float32)
    top = np.argsort(-logits, axis=-1)
    biases = [{int(top[0, 0]): -100.0}, {int(top[1, 5]): 4.5, int(top[1, 0]): -0.25},
              {int(t): float(rng.uniform(-3, 3)) for t in top[2, :40]}, {}, {int(top[4, 3]): 0.37},
              {int(top[5, 1]): 7.0, 299: -7.0}]
    pen = [dict(), dict(repetition_penalty=1.3), dict(frequency_penalty=0.5), dict(), dict(presence_penalty=-1.0),
           dict()]
    reqs = [mk(prompt=[int(top[i, 1]), 4], out=[int(top[i, 0]), int(top[i, 2])], temperature=0.0, logit_bias=b, **p)
            for i, (b, p) in enumerate(zip(biases, pen))]
    rounded = on(logits, "cpu", dtype).to("float32").numpy()
    gs, s = GpuSampler(V), Sampler(V)
    got = [r.token_id for r in gs.sample(on(logits, device, dtype), reqs, set())]
    want = [r.token_id for r in s.sample(rounded, reqs, set())]
    assert got == want
    assert got[0] != int(top[0, 0]) and got[1] != int(np.argmax(rounded[1]))  # the biases did act
    # the logits after bias and penalties, bitwise: what the device sampler hands to sample_tokens
    x = on(rounded, device)
    for table in gs._bias_tables(reqs) + [gs._penalty_tables(reqs, set())]:
        tallow.ops.apply_penalties(x, *(on(a, device, a.dtype.name) if a.dtype == np.float32
                                        else _int_tensor(a, device) for a in table))
    np.testing.assert_array_equal(x.to("cpu").numpy(), s.apply_penalties(rounded, reqs, set()))


def _int_tensor(a, device):
    t = tallow.from_numpy(np.ascontiguousarray(a))
    return t if device == "cpu" else t.to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_requests_ignore_the_batch(device, rng):
    V = 500
    logits = (rng.standard_normal((5, V)) * 2).astype(np.float32)
    kw = dict(temperature=0.9, top_p=0.9, top_k=40)
    a = mk(seed=1234, out=[1, 2], **kw)
    others = [mk(**kw) for _ in range(4)]
    gs = GpuSampler(V)
    alone = gs.sample(on(logits[2:3], device), [a], set())[0].token_id
    batch = gs.sample(on(logits, device), others[:2] + [a] + others[2:], set())
    assert batch[2].token_id == alone
    b = mk(seed=1234, out=[1, 2], **kw)  # the same request again: the same token
    assert GpuSampler(V).sample(on(logits[2:3], device), [b], set())[0].token_id == alone
    # an unseeded request keeps its seed: the same step samples the same token
    c = others[0]
    first = gs.sample(on(logits[:1], device), [c], set())[0].token_id
    assert gs.sample(on(logits[:1], device), [c], set())[0].token_id == first
    gs.forget(c.request_id)
    assert c.request_id not in gs._seeds


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_stream_differs_per_step(device, rng):
    V = 50
    logits = np.zeros((1, V), np.float32) + rng.standard_normal(V).astype(np.float32) * 0.1
    r = mk(seed=7, temperature=1.0)
    gs = GpuSampler(V)
    toks = []
    for _ in range(30):
        t = gs.sample(on(logits, device), [r], set())[0].token_id
        toks.append(t)
        r.append_token(t)
    assert len(set(toks)) > 10  # near-uniform row: fresh draws each step


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("penalised", [False, True])
def test_logprobs_equal_sampler(device, penalised, rng):
    B, V = 5, 400
    logits = (rng.standard_normal((B, V)) * 3).astype(np.float32)
    pen = dict(repetition_penalty=1.3, frequency_penalty=0.5) if penalised else {}
    reqs = [mk(temperature=0.0, logprobs=3, out=[1, 2], **pen), mk(temperature=0.8, logprobs=0, **pen),
            mk(temperature=0.0), mk(temperature=1.0, top_k=20, logprobs=7, seed=3), mk(temperature=0.0, logprobs=20)]
    got = GpuSampler(V).sample(on(logits, device), reqs, set())
    tokens = np.array([r.token_id for r in got])
    want = [type(r)(int(t)) for r, t in zip(got, tokens)]
    rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
    Sampler._logprobs(logits, tokens, rows, [r.params for r in reqs], want)  # of the raw logits, as vLLM
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g.logprob is None) == (w.logprob is None), i
        if w.logprob is None:
            assert g.rank is None and g.top_logprobs is None
            continue
        assert g.rank == w.rank
        assert g.logprob == pytest.approx(w.logprob, abs=1e-5)
        if w.top_logprobs is None:
            assert g.top_logprobs is None
        else:
            assert [t for t, _ in g.top_logprobs] == [t for t, _ in w.top_logprobs]
            np.testing.assert_allclose([v for _, v in g.top_logprobs], [v for _, v in w.top_logprobs], atol=1e-5)


def test_empty_and_bad_batch():
    gs = GpuSampler(10)
    assert gs.sample(on(np.zeros((0, 10)), "cpu"), [], set()) == []
    with pytest.raises(ValueError, match="logits of shape"):
        gs.sample(on(np.zeros((2, 10)), "cpu"), [mk()], set())
