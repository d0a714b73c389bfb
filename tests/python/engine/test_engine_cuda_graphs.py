"""CUDA-graph decode against eager decode, and the FP8 KV cache against the bf16 one, on a CUDA device.

One random-weight Llama in bf16 (hidden 256, 4 layers, 8 query / 2 KV heads of 64; see
test_engine_cuda_bf16.py for why initializer_range 0.04 and q/k x1.5), 40 greedy prompts of 1 to 150
tokens with max_tokens 8..47, all in one batch: as requests finish the decode batch shrinks one by one
from 40 to 1, so decode steps run at every batch size, padded up to each bucket (1, 2, 4, 8, 16, 24,
32, 40).

- graphs vs eager: the same tokens with enforce_eager=True, with graphs for every decode batch, and
  with cuda_graph_max_bs=16 (batches of 17..40 fall back to eager steps). Graph replay runs the same
  kernels, but on a batch padded to its bucket, where a GEMM may pick another kernel (summation
  order) for the padded row count; bf16 logits then move by at most an ulp (2^-7..2^-6 at these
  logits, |logit| < 3). So: every prompt's tokens are identical, except that a prompt may part where
  the eager run's top-2 logprobs are within GRAPH_TIE = 0.05 (3 ulps), and at most 2 of 40 do.
- FP8 KV cache (kv_cache_dtype="fp8", E4M3: 3 mantissa bits) against the bf16 cache. Simulated with
  transformers (K after RoPE and V rounded to E4M3 at scale 1 in every layer, these weights' shapes,
  40 prompts): first-step logits rel-L2 <= 0.068, max |Δ| <= 0.074 * max |logit|; first 8 greedy
  tokens agree on 30-35 of 40 prompts when compared up to the bf16 run's first top-2 gap < 0.02.
  Bounds: rel-L2 <= FP8_REL_L2 = 0.12 and max |Δ| <= FP8_MAX_FRAC = 0.15 * max |logit| (~1.8x; a
  wrong scale or a misread cache moves them by > 0.3); >= FP8_MIN_AGREE = 26 of 40 prompts agree
  on their first 8 tokens (compared up to the bf16 run's first gap < FP8_TIE = 0.02). The cache
  holds about twice the blocks in the same memory.
Skips without a CUDA build and device, or without torch + transformers (which make the checkpoint)."""
import numpy as np
import pytest

import tallow
from engine_models import (FirstStepLogits, assert_engine_idle, assert_graph_mode, comparable_steps,
                           engine_test_device, make_checkpoint, rel_l2, top2_gaps)
from tallow import LLM, SamplingParams

DEVICE, SKIP = engine_test_device()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

N_PROMPTS = 40
GRAPH_TIE = 0.05
GRAPH_MAX_PARTED = 2
FP8_REL_L2 = 0.12
FP8_MAX_FRAC = 0.15
FP8_TIE = 0.02
FP8_N = 8
FP8_MIN_AGREE = 26
MEM_MB = 256


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    pytest.importorskip("torch", reason="transformers (torch) makes the random checkpoint")
    pytest.importorskip("transformers", reason="transformers makes the random checkpoint")
    path = tmp_path_factory.mktemp("llama_graphs")
    model = make_checkpoint(path, "llama", seed=21, dtype="bfloat16", initializer_range=0.04, qk_scale=1.5)
    rng = np.random.default_rng(2024)
    prompts = [rng.integers(2, model.config.vocab_size, int(n)).tolist() for n in rng.integers(1, 151, N_PROMPTS)]
    params = [SamplingParams(temperature=0, max_tokens=8 + i, ignore_eos=True, logprobs=2) for i in range(N_PROMPTS)]
    order = rng.permutation(N_PROMPTS)  # lengths and prompt sizes not correlated with the position in the batch
    return path, [prompts[i] for i in order], [params[i] for i in order]


def make(workload, **engine_args):
    return LLM(str(workload[0]), device=DEVICE, dtype="bfloat16", mem=MEM_MB, max_num_seqs=N_PROMPTS,
               **{"prefix_cache": False, **engine_args})


def generate(llm, workload, logprobs=True):
    """(tokens, top-2 gaps or None, first-step logits rows) per prompt; checks the pool is free after."""
    _, prompts, params = workload
    if not logprobs:
        params = [sp.clone(logprobs=None) for sp in params]
    with FirstStepLogits(llm) as cap:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for o, sp in zip(outs, params):
        assert len(o.outputs[0].token_ids) == sp.max_tokens and o.outputs[0].finish_reason == "length"
    assert_engine_idle(llm)
    return ([o.outputs[0].token_ids for o in outs], [top2_gaps(o.outputs[0]) for o in outs] if logprobs else None,
            [cap.rows.get(o.request_id) for o in outs], outs)


def run(workload, logprobs=True, **engine_args):
    llm = make(workload, **engine_args)
    return (llm,) + generate(llm, workload, logprobs)[:3]


@pytest.fixture(scope="module")
def eager(workload):
    llm, toks, gaps, rows = run(workload, enforce_eager=True)
    assert_graph_mode(llm, eager=True)
    return toks, gaps, rows


def assert_same_tokens(ref, ref_gaps, got, label, max_parted=GRAPH_MAX_PARTED):
    parted = []
    for i, (a, b, g) in enumerate(zip(ref, got, ref_gaps)):
        at = next((j for j in range(len(a)) if a[j] != b[j]), None)
        if at is not None:
            parted.append((i, at, g[at]))
    bad = [p for p in parted if p[2] >= GRAPH_TIE]
    assert not bad and len(parted) <= max_parted, (
        f"{label}: {len(parted)} of {len(ref)} prompts part from the eager run (prompt, step, eager top-2 gap): "
        f"{parted}; allowed: at most {max_parted}, each at a gap < {GRAPH_TIE}")


@pytest.mark.parametrize("graph_args,max_bs,logprobs", [(dict(), N_PROMPTS, True), (dict(), N_PROMPTS, False),
                                                        (dict(cuda_graph_max_bs=16), 16, True)],
                         ids=["all-batches", "all-batches-no-logprobs", "max-bs-16"])
def test_graphs_match_eager(workload, eager, graph_args, max_bs, logprobs):
    llm, toks, _, _ = run(workload, logprobs, enforce_eager=False, **graph_args)
    stats = assert_graph_mode(llm, eager=False, max_bs=max_bs)
    if stats and max_bs < N_PROMPTS and DEVICE != "cpu":
        # decode steps of 40..17 sequences (30 of them) ran eagerly, those of 16..1 (16) from graphs
        assert stats["graph_steps"] >= max_bs // 2 and stats["eager_steps"] >= N_PROMPTS - max_bs, stats
    assert_same_tokens(eager[0], eager[1], toks, f"graphs {graph_args or 'default'}, logprobs={logprobs}")


def test_graphs_repeat_and_prefix_cache(workload):
    """The same batch again through the same engine, now with every prompt's full blocks in the prefix
    cache (prefill of only the tail, attending to cached blocks; graphs replayed a second time): the
    same tokens as the cold run."""
    llm = make(workload, enforce_eager=False, prefix_cache=True)
    cold, gaps, _, _ = generate(llm, workload)
    warm, _, _, outs = generate(llm, workload)
    bs = llm.engine.kv.block_size
    for o, p in zip(outs, workload[1]):
        assert o.num_cached_tokens == (len(p) - 1) // bs * bs, (len(p), o.num_cached_tokens)
    assert_same_tokens(cold, gaps, warm, "prefix-cached run vs cold run")


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_fp8_kv_cache_close_to_bf16(workload, enforce_eager):
    if DEVICE == "cpu":
        pytest.skip("the FP8 KV cache is CUDA only")
    bf16_llm, ref, ref_gaps, ref_rows = run(workload, enforce_eager=enforce_eager)
    llm, got, _, rows = run(workload, enforce_eager=enforce_eager, kv_cache_dtype="fp8")
    assert_graph_mode(llm, eager=enforce_eager)
    caches = getattr(llm.engine.runner, "kv_caches", None)
    k0 = caches[0][0] if caches else None
    if hasattr(k0, "dtype"):
        assert k0.dtype == tallow._core.dtype("float8_e4m3"), k0.dtype
    # the same memory holds about twice the blocks (scales, if any, are small)
    n8, n16 = llm.engine.kv.pool.num_blocks, bf16_llm.engine.kv.pool.num_blocks
    assert n8 >= 1.8 * n16, f"fp8 cache: {n8} blocks in {MEM_MB} MB, bf16: {n16}"

    assert all(r is not None for r in ref_rows + rows), "the runner returned no logits rows to compare"
    for i, (a, b) in enumerate(zip(ref_rows, rows)):
        err = np.abs(b - a)
        assert rel_l2(b, a) <= FP8_REL_L2 and err.max() <= FP8_MAX_FRAC * np.abs(a).max(), (
            f"prompt {i}: fp8-cache first-step logits rel-L2 {rel_l2(b, a):.3g} (bound {FP8_REL_L2}), "
            f"max |Δ| {err.max():.3g} (bound {FP8_MAX_FRAC * np.abs(a).max():.3g})")
    agree, report = 0, []
    for i, (a, b, g) in enumerate(zip(ref, got, ref_gaps)):
        n = comparable_steps(g, FP8_TIE, FP8_N)
        agree += a[:n] == b[:n]
        at = next((j for j in range(len(a)) if a[j] != b[j]), None)
        report.append((i, n, at, None if at is None else round(g[at], 3)))
    assert agree >= FP8_MIN_AGREE, (f"only {agree} of {N_PROMPTS} prompts agree with the bf16 cache on their first "
                                    f"{FP8_N} tokens; (prompt, compared, first difference, bf16 gap there): {report}")
