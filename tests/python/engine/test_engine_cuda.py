"""The engine on a CUDA device: the same greedy tokens as transformers (f32), as llama2.c's stories260K
sample and as tallow's own CPU run of stories260K and the SmolLM2 demo; 256 concurrent requests (mixed
sampling, n=2, aborts, preemption) that all end with every KV block back in the pool; seeded sampling
that does not depend on the rest of the batch. Skips without a CUDA build and device (see
engine_models.engine_test_device; TALLOW_TEST_DEVICE=cpu dry-runs the checks on the CPU).

Bounds against the CPU (tallow's f32 CPU run is the reference):
- f32 on the device: the same tokens and text. Only summation order differs (logits agree to ~1e-4),
  so a different argmax is possible only at a near-tie: a prompt may part from the CPU run only at a
  step whose CPU top-2 logprob gap is below F32_TIE = 2e-3 (SmolLM2's fixture prompts have no gap
  below 0.0073, so in practice every token is compared).
- bf16 on the device: the first 16 tokens of each prompt, compared up to the CPU f32 run's first
  top-2 gap below a tie threshold, on all prompts but one. Thresholds from tallow's CPU bf16 run as a
  proxy: stories260K's bf16 run equals its f32 run for 48 tokens on 7 prompts (smallest gap 0.04):
  STORIES_BF16_TIE = 0.1. SmolLM2's residual stream has outlier channels, so bf16 moves its logits by
  tenths: over the 9 fixture prompts its first divergences came at gaps 0.082 (step 0), 0.12 (step
  4), then 0.02-0.06 after step 20: SMOLLM2_BF16_TIE = 0.2."""
import json
import os
import pathlib

import numpy as np
import pytest

from engine_models import assert_engine_idle, assert_graph_mode, comparable_steps, engine_test_device, top2_gaps
from tallow import LLM, SamplingParams

DEVICE, SKIP = engine_test_device()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

N_NEW = 48
GREEDY = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)
F32_TIE = 2e-3
FIXTURE = pathlib.Path(__file__).resolve().parents[2] / "fixtures" / "smollm2_llamacpp.json"


# -- random Llama against transformers (f32), the original checks -----------------------------------

@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    pytest.importorskip("torch", reason="transformers (with CPU torch) is the reference model")
    pytest.importorskip("transformers", reason="transformers is the reference model")
    from engine_models import hf_greedy, make_llama

    path = tmp_path_factory.mktemp("llama_cuda")
    model = make_llama(path)
    rng = np.random.default_rng(99)
    prompts = [rng.integers(2, 320, n).tolist() for n in (3, 20, 41, 90)]
    return path, prompts, [hf_greedy(model, p, N_NEW) for p in prompts]


@pytest.mark.parametrize("engine_args", [dict(), dict(prefill_chunk_size=16, max_num_batched_tokens=32),
                                         dict(enforce_eager=True)], ids=["default", "chunked", "eager"])
def test_cuda_greedy_f32_matches_transformers(llama_dir, engine_args):
    path, prompts, expected = llama_dir
    llm = LLM(str(path), device=DEVICE, dtype="float32", mem=64, **engine_args)
    assert llm.engine.device == DEVICE
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_graph_mode(llm, engine_args.get("enforce_eager", False))
    assert_engine_idle(llm)


def test_cuda_bf16_close_to_cpu_f32(llama_dir):
    path, prompts, expected = llama_dir
    llm = LLM(str(path), device=DEVICE, dtype="bfloat16", mem=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8,
                                                                                  ignore_eos=True))
    # bf16 rounding may flip a near-tie late; the first tokens must agree
    agree = sum(o.outputs[0].token_ids[:4] == e[:4] for o, e in zip(outs, expected))
    assert agree >= len(prompts) - 1
    assert_engine_idle(llm)


# -- real models: the device reproduces the CPU --------------------------------------------------------

def cpu_reference(model: str, prompts: list[list[int]], n_new: int):
    """tallow's CPU f32 greedy run: (token ids, text, top-2 logprob gaps) per prompt."""
    llm = LLM(model, dtype="float32")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True, logprobs=2))
    return [(o.outputs[0].token_ids, o.outputs[0].text, top2_gaps(o.outputs[0])) for o in outs]


def check_f32_equal(label, prompts, ref, outs):
    """f32: every token equal, except a prompt may part at a near-tie (CPU gap < F32_TIE)."""
    for p, (toks, text, gaps), o in zip(prompts, ref, outs):
        got = o.outputs[0].token_ids
        n = comparable_steps(gaps, F32_TIE, len(toks))
        assert got[:n] == toks[:n], (
            f"{label}, prompt of {len(p)}: f32 token {next(i for i in range(n) if got[i] != toks[i])} differs from "
            f"the CPU run (comparing {n} of {len(toks)}; CPU gaps {[round(g, 4) for g in gaps[:n]]})")
        if n == len(toks):
            assert o.outputs[0].text == text, f"{label}, prompt of {len(p)}: same tokens, different text"


def check_bf16_prefix(label, prompts, ref, outs, tie, n_cmp=16, min_agree=None):
    """bf16: the first n_cmp tokens, compared up to the CPU run's first gap < tie, on all prompts but one."""
    agree, report = 0, []
    for p, (toks, _, gaps), o in zip(prompts, ref, outs):
        got = o.outputs[0].token_ids
        n = comparable_steps(gaps, tie, n_cmp)
        agree += got[:n] == toks[:n]
        at = next((i for i in range(min(len(got), len(toks))) if got[i] != toks[i]), None)
        report.append(f"  prompt of {len(p)}: compared {n}, first difference at {at}"
                      + (f" (CPU gap there {gaps[at]:.3g})" if at is not None else ""))
    need = len(prompts) - 1 if min_agree is None else min_agree
    assert agree >= need, f"{label}: {agree} of {len(prompts)} prompts agree (need {need}):\n" + "\n".join(report)


STORIES_PROMPTS = ["Once upon a time, there was a little girl named Lily.",
                   "Tom and his dog went to the park. They saw a big",
                   "The sun was hot. Ben wanted to"]
STORIES_BF16_TIE = 0.1


@pytest.fixture(scope="module")
def stories():
    # conftest's shared_data, at module scope
    data = pathlib.Path(os.environ.get("TALLOW_TEST_DATA", pathlib.Path(__file__).resolve().parents[4] / "shared/data"))
    path = data / "stories260K" / "stories260K.gguf"
    if not path.is_file():
        pytest.skip(f"real test data not found at {path.parent} (set TALLOW_TEST_DATA)")
    tok = LLM(str(path), dtype="float32", mem=8).get_tokenizer()
    prompts = [[1]] + [tok.encode(t) for t in STORIES_PROMPTS]
    return path, prompts, cpu_reference(str(path), prompts, 128)


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_cuda_stories260k(stories, eager):
    """f32: llama2.c's 256-token sample from BOS exactly, and tallow's CPU text for three prompts."""
    path, prompts, ref = stories
    llm = LLM(str(path), device=DEVICE, dtype="float32", mem=64, enforce_eager=eager)
    want = (path.parent / "greedy.txt").read_text()
    out = llm.generate({"prompt_token_ids": [1]}, SamplingParams(temperature=0, max_tokens=256))[0].outputs[0]
    assert out.text == want.rstrip("\n")  # llama2.c's file ends with a newline the model never produced
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=128,
                                                                                  ignore_eos=True))
    check_f32_equal("stories260K f32", prompts, ref, outs)
    assert_graph_mode(llm, eager)
    assert_engine_idle(llm)


def test_cuda_stories260k_bf16(stories):
    """bf16: the CPU f32 run's first 16 tokens, up to its first top-2 gap < STORIES_BF16_TIE."""
    path, prompts, ref = stories
    llm = LLM(str(path), device=DEVICE, dtype="bfloat16", mem=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=16,
                                                                                  ignore_eos=True))
    check_bf16_prefix("stories260K bf16", prompts, ref, outs, STORIES_BF16_TIE)
    assert_engine_idle(llm)


from engine_models import DEMO_MODEL_MISSING, demo_gguf as _demo_gguf  # noqa: E402


SMOLLM2_BF16_TIE = 0.2


@pytest.fixture(scope="module")
def smollm2():
    gguf = _demo_gguf()
    if gguf is None:
        pytest.skip(DEMO_MODEL_MISSING)
    prompts = [p["prompt_token_ids"] for p in json.loads(FIXTURE.read_text())["prompts"]]
    return gguf, prompts, cpu_reference(gguf, prompts, N_NEW)


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_cuda_smollm2_f32_matches_cpu(smollm2, eager):
    gguf, prompts, ref = smollm2
    llm = LLM(gguf, device=DEVICE, dtype="float32", mem=512, enforce_eager=eager)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    check_f32_equal("SmolLM2 f32", prompts, ref, outs)
    assert_graph_mode(llm, eager)
    assert_engine_idle(llm)


def test_cuda_smollm2_bf16_close_to_cpu(smollm2):
    gguf, prompts, ref = smollm2
    llm = LLM(gguf, device=DEVICE, dtype="bfloat16", mem=512)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=16,
                                                                                  ignore_eos=True))
    check_bf16_prefix("SmolLM2 bf16", prompts, ref, outs, SMOLLM2_BF16_TIE)
    assert_engine_idle(llm)


# -- many requests, and seeded sampling (random "dummy" weights: no torch needed) ----------------------

SMALL_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 320, "hidden_size": 128,
               "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
               "head_dim": 64, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
               "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": 1, "torch_dtype": "bfloat16"}


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory):
    """A config.json only: the engine makes random weights of its shapes (load_format="dummy")."""
    path = tmp_path_factory.mktemp("small_llama")
    (path / "config.json").write_text(json.dumps(SMALL_LLAMA))
    return path


def _mixed_params(i: int, max_tokens: int) -> SamplingParams:
    kind = i % 5
    if kind == 0:
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    if kind == 1:
        return SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=max_tokens, ignore_eos=True)
    if kind == 2:
        return SamplingParams(n=2, temperature=1.0, top_k=20, seed=i, max_tokens=max_tokens, ignore_eos=True)
    if kind == 3:
        return SamplingParams(temperature=0.7, min_p=0.05, seed=i, repetition_penalty=1.2, max_tokens=max_tokens,
                              ignore_eos=True)
    return SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, logprobs=2)  # may stop at EOS


@pytest.mark.parametrize("num_kv_blocks", [None, 160], ids=["roomy", "preempting"])
def test_256_concurrent_requests_end_and_free_the_pool(small_llama, num_kv_blocks):
    """256 requests (prompts of 5..200 tokens, max_tokens 5..60, greedy / seeded top-p / n=2 top-k /
    min-p with repetition penalty / plain sampling that may stop at EOS), 24 of them aborted after 3,
    12 and 40 steps (each time 4 that have produced tokens, an n=2 one among them, and 4 still
    waiting): every request ends, no output comes after an abort, and every KV block is back in the
    pool. With 160 blocks (2,560 tokens for up to 256 sequences of up to 260) the scheduler must
    preempt."""
    llm = LLM(str(small_llama), device=DEVICE, dtype="bfloat16", load_format="dummy", mem=64,
              num_kv_blocks=num_kv_blocks, max_num_seqs=256)
    eng = llm.engine
    preempted = []
    if num_kv_blocks is not None and hasattr(eng.scheduler, "_preempt"):
        orig = eng.scheduler._preempt

        def spy(victim, *a, **kw):
            preempted.append(victim.request_id)
            return orig(victim, *a, **kw)

        eng.scheduler._preempt = spy
    rng = np.random.default_rng(256)
    params = {}
    for i in range(256):
        prompt = rng.integers(2, SMALL_LLAMA["vocab_size"], int(rng.integers(5, 201))).tolist()
        sp = _mixed_params(i, int(rng.integers(5, 61)))
        params[eng.add_request({"prompt_token_ids": prompt}, sp)] = sp
    ids = list(params)
    tokens = {rid: [[] for _ in range(sp.n)] for rid, sp in params.items()}
    finished, aborted, steps = {}, set(), 0

    def abort_some():
        """4 requests that have produced tokens (an n=2 one first) and 4 that have not."""
        live = [r for r in ids if r not in finished and r not in aborted]
        running = sorted((r for r in live if any(tokens[r])), key=lambda r: params[r].n != 2)
        waiting = [r for r in live if not any(tokens[r])]
        rest = running[1:]
        picked = running[:1] + [rest[int(j)] for j in rng.permutation(len(rest))[:3]]
        picked += [waiting[int(j)] for j in rng.permutation(len(waiting))[:4]]
        for rid in picked:
            eng.abort_request(rid)
            aborted.add(rid)

    while eng.has_unfinished_requests():
        for out in eng.step():
            assert out.request_id not in aborted, f"output for {out.request_id} after it was aborted"
            assert out.request_id not in finished, f"output for {out.request_id} after it finished"
            for c in out.outputs:
                tokens[out.request_id][c.index] += c.token_ids
            if out.finished:
                finished[out.request_id] = [(c.finish_reason, c.stop_reason) for c in out.outputs]
        steps += 1
        if steps in (3, 12, 40):
            abort_some()
        assert steps < 50_000, "the engine does not finish"
    assert eng.step() == []  # nothing left in flight
    assert set(finished) | aborted == set(ids) and not set(finished) & aborted
    assert sum(any(any(t) for t in tokens[r]) for r in aborted) >= 4, "too few aborts of running requests"
    assert any(params[r].n == 2 for r in aborted) and any(not any(tokens[r]) for r in aborted)
    for rid, reasons in finished.items():
        sp = params[rid]
        for (reason, _), toks in zip(reasons, tokens[rid]):
            assert all(0 <= t < SMALL_LLAMA["vocab_size"] for t in toks)
            if sp.ignore_eos:
                assert reason == "length" and len(toks) == sp.max_tokens, (rid, reason, len(toks), sp)
            else:
                assert (reason == "length" and len(toks) == sp.max_tokens) or \
                    (reason == "stop" and 0 < len(toks) <= sp.max_tokens and toks[-1] == 1), (rid, reason, toks)
    if num_kv_blocks is not None and hasattr(eng.scheduler, "_preempt"):
        assert preempted, "160 blocks for 256 requests should force preemption"
    assert_engine_idle(llm)


def test_seeded_sampling_independent_of_the_batch(small_llama):
    """A seeded request samples the same tokens alone, again alone, inside a batch of 16 other requests
    (greedy, other seeds, unseeded, penalties, n=2) and as completion 0 of an n=2 request (whose
    completion i uses seed + i). f32, so that the logits themselves do not depend on the batch
    (bf16 logits move by an ulp with the batch's GEMM shapes, and a draw near a CDF boundary may flip)."""
    llm = LLM(str(small_llama), device=DEVICE, dtype="float32", load_format="dummy", mem=64, max_num_seqs=32)
    rng = np.random.default_rng(5)
    vocab = SMALL_LLAMA["vocab_size"]
    prompt = rng.integers(2, vocab, 37).tolist()
    target = SamplingParams(temperature=0.9, top_p=0.95, top_k=100, seed=1234, max_tokens=32, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": prompt}, target)[0].outputs[0].token_ids
    assert llm.generate({"prompt_token_ids": prompt}, target)[0].outputs[0].token_ids == alone
    greedy = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=32,
                                                                        ignore_eos=True))[0].outputs[0].token_ids
    other_seed = llm.generate({"prompt_token_ids": prompt}, target.clone(seed=4321))[0].outputs[0].token_ids
    assert alone != greedy and alone != other_seed, "sampling should depend on the seed"

    others = [rng.integers(2, vocab, int(rng.integers(1, 120))).tolist() for _ in range(16)]
    other_params = [_mixed_params(i, int(rng.integers(8, 48))) for i in range(16)]
    other_params[5] = SamplingParams(temperature=0.9, max_tokens=20, ignore_eos=True)  # unseeded
    batch = others[:8] + [prompt] + others[8:] + [prompt]
    batch_params = other_params[:8] + [target] + other_params[8:] + [target.clone(n=2)]
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], batch_params)
    assert outs[8].outputs[0].token_ids == alone, "the seeded request sampled differently inside a batch"
    assert outs[-1].outputs[0].token_ids == alone, "completion 0 of n=2 (seed + 0) differs from the request alone"
    assert outs[-1].outputs[1].token_ids != alone
    assert_engine_idle(llm)
