"""The engine on a CUDA device in bf16 / f16 against transformers on the same device and dtype.

Random-weight checkpoints saved in bfloat16 (the exact weights both sides run), made by
engine_models.make_checkpoint with initializer_range 0.04:
  llama-d64   hidden 256, 4 layers, 8 query / 2 KV heads of 64 (GQA 4; q width 512 != hidden)
  llama-d128  hidden 256, 4 layers, 8 query / 1 KV head of 128 (MQA)
  qwen3-d128  hidden 256, 4 layers, 4 query / 2 KV heads of 128, q/k RMSNorm, tied embeddings
(Llama's q/k projections x1.5, Qwen3's x1 through its q/k norms: attention sharp enough that a
query position off by one moves the last logits by >= 0.067 rel-L2 in f32, yet not so sharp that
bf16 rounding is amplified chaotically — with the default 0.08 init two bf16 implementations differ
by 4% and greedy runs part within a few tokens.) Six prompts of 1 to 300 tokens, 24 greedy tokens
each, with CUDA graphs and with enforce_eager, bf16 for all three and f16 for llama-d64. The
reference is transformers on torch's CUDA device when torch has one, else on the CPU (same dtype;
the failure message says which).

Bounds. Measured on a CPU proxy (tallow's CPU bf16 against transformers' CPU bf16, 36 seeds x 6
prompts of these shapes): first-step logits rel-L2 <= 0.016, max |Δ| <= 0.020 * max |logit|
(logits span about ±3); first greedy divergences at transformers top-2 gaps of 0, 0.008, 0.016 and
0.023 (bf16 logits are multiples of 2^-7..2^-6 there, so gaps come in those steps).
- first-step logits: rel-L2 <= LOGITS_REL_L2 = 0.03 and max |Δ| <= LOGITS_MAX_FRAC = 0.05 of max
  |ref| (about 2x the proxy), on the full rows the runner returns; and the public top-20 logprobs
  within LOGITS_MAX_FRAC * max |ref| of transformers' log-softmax, at the first step and, for half
  the prompts, at every decode step while the two greedy sequences still agree;
- greedy: at least 5 of 6 prompts agree on their first 16 tokens, each compared up to the first step
  where transformers' top-2 logits are within TIE = 0.02 (a near-tie: one bf16 ulp of the top logits
  at |logit| in [2, 4) is 0.016; a different argmax there is rounding, and after it the sequences
  part). With TIE 0.01 (divergences at a 1-ulp gap count) the proxy had 6 of 36 runs at 5 of 6.
Skips without a CUDA build and device, or without torch + transformers."""
import numpy as np
import pytest

import tallow
from engine_models import (FirstStepLogits, assert_engine_idle, assert_graph_mode, comparable_steps,
                           engine_test_device, hf_greedy_trace, load_hf, make_checkpoint, rel_l2)
from tallow import LLM, SamplingParams

DEVICE, SKIP = engine_test_device()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

N_NEW = 24
N_CMP = 16  # greedy tokens compared per prompt
MIN_AGREE = 5  # of 6 prompts
TIE = 2e-2
LOGITS_REL_L2 = 3e-2
LOGITS_MAX_FRAC = 0.05
LENS = (1, 7, 33, 90, 181, 300)
CASES = {
    "llama-d64": ("llama", dict(qk_scale=1.5)),
    "llama-d128": ("llama", dict(qk_scale=1.5, num_attention_heads=8, num_key_value_heads=1, head_dim=128)),
    "qwen3-d128": ("qwen3", dict()),
}
RUNS = [("llama-d64", "bfloat16"), ("llama-d128", "bfloat16"), ("qwen3-d128", "bfloat16"), ("llama-d64", "float16")]


def _torch():
    torch = pytest.importorskip("torch", reason="transformers (torch) is the reference model")
    pytest.importorskip("transformers", reason="transformers is the reference model")
    return torch


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (path, prompts); made once per module."""
    _torch()
    made = {}
    for i, (case, (arch, overrides)) in enumerate(CASES.items()):
        path = tmp_path_factory.mktemp(case)
        model = make_checkpoint(path, arch, seed=10 + i, dtype="bfloat16", initializer_range=0.04, **overrides)
        rng = np.random.default_rng(100 + i)
        made[case] = (path, [rng.integers(2, model.config.vocab_size, n).tolist() for n in LENS])
    return made


@pytest.fixture(scope="module")
def references(checkpoints):
    """(case, dtype) -> (path, prompts, [(tokens, gaps, logits per step)] per prompt, reference device)."""
    torch = _torch()
    dev = DEVICE if DEVICE.startswith("cuda") and torch.cuda.is_available() else "cpu"
    cache = {}

    def get(case, dtype):
        if (case, dtype) not in cache:
            path, prompts = checkpoints[case]
            model = load_hf(path, dtype, dev)
            cache[(case, dtype)] = (path, prompts, [hf_greedy_trace(model, p, N_NEW) for p in prompts], dev)
            del model
            if dev == "cuda":
                torch.cuda.empty_cache()
        return cache[(case, dtype)]

    return get


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("case,dtype", RUNS, ids=[f"{c}-{d}" for c, d in RUNS])
def test_matches_transformers_on_device(references, case, dtype, eager):
    path, prompts, refs, ref_dev = references(case, dtype)
    where = f"{case} {dtype} {'eager' if eager else 'graphs'} on {DEVICE} vs transformers on {ref_dev}"
    llm = LLM(str(path), device=DEVICE, dtype=dtype, mem=256, max_num_seqs=16, prefix_cache=False,
              enforce_eager=eager)
    assert llm.engine.device == DEVICE and llm.engine.dtype == tallow._core.dtype(dtype)
    reqs = [{"prompt_token_ids": p} for p in prompts]

    # first step: the full logits rows and the public top-20 logprobs
    with FirstStepLogits(llm) as cap:
        first = llm.generate(reqs, SamplingParams(temperature=0, max_tokens=1, logprobs=20))
    for p, o, (toks, gaps, steps) in zip(prompts, first, refs):
        ref, scale = steps[0], np.abs(steps[0]).max()
        if o.request_id in cap.rows:
            row = cap.rows[o.request_id]
            err = np.abs(row - ref)
            assert rel_l2(row, ref) <= LOGITS_REL_L2 and err.max() <= LOGITS_MAX_FRAC * scale, (
                f"{where}, prompt of {len(p)}: first-step logits rel-L2 {rel_l2(row, ref):.3g} (bound "
                f"{LOGITS_REL_L2}), max |Δ| {err.max():.3g} at token {err.argmax()} "
                f"(bound {LOGITS_MAX_FRAC * scale:.3g})")
        check_logprobs(where, p, 0, o.outputs[0].logprobs[0], steps[0])
        if gaps[0] >= TIE:
            assert o.outputs[0].token_ids[0] == toks[0], f"{where}, prompt of {len(p)}: first token"
    assert len(cap.rows) == len(prompts), f"{where}: the runner returned no logits rows to compare"

    # greedy generation; every other prompt also returns top-20 logprobs, checked at each decode step
    # until its tokens part from transformers' (the sampling path without logprobs runs beside it)
    params = [SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=20 if i % 2 else None)
              for i in range(len(prompts))]
    outs = llm.generate(reqs, params)
    report, agree = [], 0
    for p, o, (toks, gaps, steps) in zip(prompts, outs, refs):
        got = o.outputs[0].token_ids
        assert len(got) == N_NEW and o.outputs[0].finish_reason == "length"
        n = comparable_steps(gaps, TIE, N_CMP)
        ok = got[:n] == toks[:n]
        agree += ok
        at = next((i for i in range(N_NEW) if got[i] != toks[i]), None)
        report.append(f"  prompt of {len(p)}: compared {n}, {'ok' if ok else 'DIFFERS'}; " +
                      (f"first difference at step {at} (transformers' top-2 gap there {gaps[at]:.3g})"
                       if at is not None else f"all {N_NEW} tokens equal"))
        if o.outputs[0].logprobs is not None:
            for step in range(N_NEW if at is None else at + 1):  # same context up to and including `at`
                check_logprobs(where, p, step, o.outputs[0].logprobs[step], steps[step])
    assert agree >= MIN_AGREE, f"{where}: only {agree} of {len(prompts)} prompts agree:\n" + "\n".join(report)
    assert_graph_mode(llm, eager, max_bs=16)
    assert_engine_idle(llm)


def check_logprobs(where, prompt, step, entry, ref_logits):
    """tallow's top-20 logprobs at one step within LOGITS_MAX_FRAC * max |logit| of transformers'."""
    scale = np.abs(ref_logits).max()
    lse = ref_logits.max() + np.log(np.exp(ref_logits - ref_logits.max()).sum())
    ids = list(entry)
    d = np.abs(np.array([entry[t].logprob for t in ids]) - (ref_logits[ids] - lse))
    assert d.max() <= LOGITS_MAX_FRAC * scale, (
        f"{where}, prompt of {len(prompt)}, step {step}: top-20 logprob off by {d.max():.3g} at token "
        f"{ids[d.argmax()]} (bound {LOGITS_MAX_FRAC * scale:.3g})")
