"""add_request(final_only=True) (what LLM.generate uses): step() returns nothing for the request until
it finishes, then one RequestOutput holding the whole result, equal to the request's deltas joined."""
import pytest

from engine_models import make_llama
from tallow import LLM, SamplingParams

VOCAB = 96
PARAMS = [
    SamplingParams(temperature=0.9, seed=7, max_tokens=12, n=2, logprobs=2, prompt_logprobs=1),
    SamplingParams(temperature=0, max_tokens=9, stop=["t13 t14"], include_stop_str_in_output=True),
    SamplingParams(temperature=0.7, top_k=5, seed=3, max_tokens=17, ignore_eos=True, detokenize=False),
]
PROMPTS = ["t5 t6 t7", "t9 t10 t11 t12 t13", "t20 t21"]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_final_only")
    make_llama(path, seed=11, vocab_size=VOCAB)
    return LLM(str(path), max_model_len=128)


def _run(eng, final_only):
    rids = [eng.add_request(p, sp, final_only=final_only) for p, sp in zip(PROMPTS, PARAMS)]
    got = {r: [] for r in rids}
    while eng.has_unfinished_requests():
        for out in eng.step():
            got[out.request_id].append(out)
    return [got[r] for r in rids]


def _joined(deltas):
    outs = {}
    for d in deltas:
        for o in d.outputs:
            j = outs.setdefault(o.index, {"text": "", "ids": [], "lps": [] if o.logprobs is not None else None})
            j["text"] += o.text
            j["ids"] += o.token_ids
            if o.logprobs is not None:
                j["lps"] += o.logprobs
            j["cum"], j["finish"], j["stop"] = o.cumulative_logprob, o.finish_reason, o.stop_reason
    last = deltas[-1]
    assert last.finished
    return outs, last.prompt_logprobs


def test_final_only_returns_the_whole_result_once(llm):
    eng = llm.engine
    streamed = _run(eng, final_only=False)
    final = _run(eng, final_only=True)
    for s, f, sp in zip(streamed, final, PARAMS):
        assert len(s) > 1  # deltas step by step
        assert len(f) == 1 and f[0].finished  # one output, at the end
        want, want_plp = _joined(s)
        got, got_plp = _joined(f)
        assert got == want
        assert len(got) == sp.n and all(len(o["ids"]) > 0 for o in got.values())
        assert got_plp == want_plp
    assert final[0][0].prompt_logprobs is not None and len(final[0][0].prompt_logprobs) == 3
    assert final[1][0].outputs[0].finish_reason in ("stop", "length")
    kv = eng.kv
    assert kv.num_free_blocks == kv.pool.num_blocks and not eng.groups


def test_generate_equals_the_stream(llm):
    outs = llm.generate(PROMPTS, PARAMS)
    for prompt, sp, out in zip(PROMPTS, PARAMS, outs):
        if sp.n != 1:
            continue
        deltas = list(llm.generate_stream(prompt, sp))
        want, _ = _joined(deltas)
        o = out.outputs[0]
        assert (o.text, o.token_ids, o.finish_reason) == (want[0]["text"], want[0]["ids"], want[0]["finish"])
