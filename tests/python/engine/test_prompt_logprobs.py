"""SamplingParams.prompt_logprobs against transformers: per prompt token after the first, its
log-probability given the tokens before it (log_softmax of the model's logits at the previous
position), its rank (1 + the number of tokens with a larger logit) and the top-k tokens, on a
random-weight Llama in float32 (bound 2e-4: the engine's float32 kernels against torch's).

Also: prompts cut into several prefill chunks, a prompt whose blocks are in the prefix cache (it is
computed again, not served from the cache), n = 2 (one list for the request), a 1-token prompt
([None]), overlapped scheduling, and a request without prompt_logprobs in the same batch (None)."""
import numpy as np
import pytest

pytest.importorskip("torch", reason="transformers (with CPU torch) makes the test model")
pytest.importorskip("transformers", reason="transformers makes the test model")

from engine_models import assert_engine_idle, make_llama  # noqa: E402
from tallow import LLM, SamplingParams  # noqa: E402

BOUND = 2e-4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_prompt_lp")
    return path, make_llama(path, seed=11)


def hf_prompt_logprobs(hf, ids):
    import torch

    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double().numpy()
    lp = logits - logits.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    return lp[:-1], logits[:-1]  # position i predicts token i + 1


def check(out, hf, k):
    ids = out.prompt_token_ids
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
    assert out.prompt_logprobs[0] is None
    lp, logits = hf_prompt_logprobs(hf, ids)
    for i, entry in enumerate(out.prompt_logprobs[1:]):
        tok = ids[i + 1]
        assert tok in entry
        assert abs(entry[tok].logprob - lp[i, tok]) < BOUND, (i, entry[tok].logprob, lp[i, tok])
        larger = int((logits[i] > logits[i, tok]).sum())
        close = int((np.abs(logits[i] - logits[i, tok]) < 1e-4).sum()) - 1  # ties within float error
        assert larger - close <= entry[tok].rank - 1 <= larger + close, (i, entry[tok].rank, larger)
        # the top k: k entries of ranks 1..k (the prompt token among them, or one more entry)
        top = sorted((v for v in entry.values() if v.rank <= k), key=lambda v: v.rank)
        assert [v.rank for v in top] == list(range(1, k + 1)) and len(entry) == k + (entry[tok].rank > k)
        np.testing.assert_allclose([v.logprob for v in top], np.sort(lp[i])[::-1][:k], atol=BOUND)


@pytest.mark.parametrize("chunk", [8192, 7], ids=["one-chunk", "chunks-of-7"])
def test_prompt_logprobs_match_transformers(model, chunk):
    path, hf = model
    llm = LLM(str(path), prefill_chunk_size=chunk, max_num_batched_tokens=max(chunk, 16))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, 320, n).tolist() for n in (23, 5, 40)]
    params = [SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3),
              SamplingParams(temperature=0, max_tokens=2),
              SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    check(outs[0], hf, 3)
    assert outs[1].prompt_logprobs is None
    check(outs[2], hf, 0)
    assert all(len(e) == 1 for e in outs[2].prompt_logprobs[1:])  # k = 0: the prompt token only
    assert_engine_idle(llm)
    # the same prompt again: its blocks are cached, yet the prompt is computed for its log-probs
    again = llm.generate({"prompt_token_ids": prompts[0]}, params[0])[0]
    assert again.num_cached_tokens == 0
    check(again, hf, 3)
    plain = llm.generate({"prompt_token_ids": prompts[0]}, params[1])[0]
    assert plain.num_cached_tokens > 0 and plain.prompt_logprobs is None


def test_prompt_logprobs_n_one_token_and_overlap(model):
    path, hf = model
    llm = LLM(str(path), async_scheduling=True)
    rng = np.random.default_rng(4)
    ids = rng.integers(2, 320, 17).tolist()
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=3,
                                                                prompt_logprobs=2))[0]
    assert len(out.outputs) == 2
    check(out, hf, 2)
    one = llm.generate({"prompt_token_ids": [7]}, SamplingParams(max_tokens=2, prompt_logprobs=1))[0]
    assert one.prompt_logprobs == [None]
    assert_engine_idle(llm)
