"""Decode steps split into two halves (engine/runner.py: ModelRunner._forward_halves): each half runs
through the whole model on its own stream on CUDA (one after the other on the CPU), then one lm_head
over both. A sequence's tokens and logprobs must not depend on the split.

Here the eager decode steps are split (split_eager_decode, threshold 16): a random-weight Llama,
24 greedy prompts with max_tokens 4..27, so decode batches of 24 down to 1 run, those of >= 16
split (halves 16 + 8 ... 16 + 1). Against the same engine unsplit: identical tokens, logprobs within
1e-4 on the CPU (float32; each row's products are computed the same way whatever the batch). On
CUDA (bf16) the halves' GEMMs may pick other kernels for their row counts, so tokens may part only
at a near tie (top-2 gap < 0.05) and logprobs agree to 0.05. The captured-graph form is checked in
test_engine_cuda_graphs.py::test_graphs_split_over_two_streams."""
import numpy as np
import pytest

from engine_models import assert_engine_idle, make_llama
from tallow import LLM, SamplingParams
from tallow.engine import runner as runner_mod
from test_gpu_sampler import DEVICES

N = 24


def _generate(path, device, split, monkeypatch):
    dtype = "float32" if device == "cpu" else "bfloat16"
    llm = LLM(str(path), device=device, dtype=dtype, max_num_seqs=N, enforce_eager=True, prefix_cache=False)
    r = llm.engine.runner
    monkeypatch.setattr(runner_mod, "_OVERLAP_MIN_SEQS", 16)
    r.split_decode = r.split_eager_decode = split
    calls = []
    orig = r._forward_halves
    r._forward_halves = lambda bs: calls.append(bs) or orig(bs)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(2, 320, int(n)).tolist() for n in rng.integers(1, 40, N)]
    params = [SamplingParams(temperature=0, max_tokens=4 + i, ignore_eos=True, logprobs=2) for i in range(N)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert_engine_idle(llm)
    comps = [o.outputs[0] for o in outs]
    return ([c.token_ids for c in comps], [[max(e.values(), key=lambda v: v.logprob).logprob for e in c.logprobs]
                                           for c in comps], [sorted((v.logprob for v in e.values()), reverse=True)
                                                             for c in comps for e in c.logprobs], calls)


@pytest.mark.parametrize("device", DEVICES)
def test_split_decode_steps_match_unsplit(tmp_path, device, monkeypatch):
    pytest.importorskip("torch", reason="transformers (torch) makes the random checkpoint")
    pytest.importorskip("transformers", reason="transformers makes the random checkpoint")
    make_llama(tmp_path, seed=3)
    ref, ref_lp, ref_top, none = _generate(tmp_path, device, False, monkeypatch)
    got, got_lp, _, calls = _generate(tmp_path, device, True, monkeypatch)
    assert not none
    assert calls and min(calls) >= 16 and max(calls) == N, calls  # the steps of >= 16 sequences were split
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
