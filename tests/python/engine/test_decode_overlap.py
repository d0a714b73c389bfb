"""Overlapped decode steps (engine.py: one step loop; step n launched before the tokens of steps n-1
and n-2 are read back, the unknown input ids filled in on the device from the worker's prev_ids)
against the same loop reading every step back at once (depth 0, the CPU default). A sequence's
tokens and logprobs must not depend on the overlap.

A random-weight Llama, 24 greedy prompts with max_tokens 4..27 and top-2 logprobs, decode batches of
24 down to 1. On the CPU (float32; each row's products are computed the same way whatever the batch)
the tokens are identical and logprobs agree to 1e-4. On CUDA (bf16) the batches of the two runs may
differ at the end of sequences (a request waiting for its last token is left out), so GEMMs may pick
other kernels for their row counts: tokens may part only at a near tie (top-2 gap < 0.05) and
logprobs agree to 0.05. (The decode path that split steps into two halves on two streams was
measured slower and removed: benchmarks/results/README.md.)"""
import numpy as np
import pytest

from engine_models import assert_engine_idle, make_llama
from tallow import LLM, SamplingParams
from engine_models import DEVICES

N = 24


def _generate(path, device, depth, monkeypatch):
    dtype = "float32" if device == "cpu" else "bfloat16"
    monkeypatch.setenv("TALLOW_OVERLAP_DEPTH", str(max(depth, 1)))
    llm = LLM(str(path), device=device, dtype=dtype, max_num_seqs=N, enforce_eager=True, prefix_cache=False,
              async_scheduling=depth > 0)
    assert llm.engine._overlap_depth == depth
    rng = np.random.default_rng(5)
    prompts = [rng.integers(2, 320, int(n)).tolist() for n in rng.integers(1, 40, N)]
    params = [SamplingParams(temperature=0, max_tokens=4 + i, ignore_eos=True, logprobs=2) for i in range(N)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert_engine_idle(llm)
    assert not llm.engine._pending and not llm.engine.runner.requests
    comps = [o.outputs[0] for o in outs]
    return ([c.token_ids for c in comps], [[max(e.values(), key=lambda v: v.logprob).logprob for e in c.logprobs]
                                           for c in comps], [sorted((v.logprob for v in e.values()), reverse=True)
                                                             for c in comps for e in c.logprobs])


@pytest.mark.parametrize("device", DEVICES)
def test_overlapped_decode_matches_unoverlapped(tmp_path, device, monkeypatch):
    pytest.importorskip("torch", reason="transformers (torch) makes the random checkpoint")
    pytest.importorskip("transformers", reason="transformers makes the random checkpoint")
    make_llama(tmp_path, seed=3)
    ref, ref_lp, ref_top = _generate(tmp_path, device, 0, monkeypatch)
    got, got_lp, _ = _generate(tmp_path, device, 2, monkeypatch)
    assert [len(t) for t in got] == [4 + i for i in range(N)]
    if device == "cpu":
        assert got == ref
        np.testing.assert_allclose(np.concatenate(got_lp), np.concatenate(ref_lp), atol=1e-4)
        return
    k = 0
    for a, b, la, lb in zip(ref, got, ref_lp, got_lp):
        at = next((j for j in range(len(a)) if a[j] != b[j]), len(a))
        for j in range(at):
            assert abs(la[j] - lb[j]) < 0.05
        if at < len(a):
            gaps = ref_top[k + at]
            assert gaps[0] - gaps[1] < 0.05, (a, b, at)
        k += len(a)
