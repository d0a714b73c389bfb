"""Bad input to the engine and the LLM API: a ValueError with a clear message, raised before anything
is scheduled, and nothing left behind (the KV pool entirely free, no request in the scheduler)."""
import math

import numpy as np
import pytest

from tallow import SamplingParams

pytest.importorskip("torch", reason="transformers (with CPU torch) makes the test model")
pytest.importorskip("transformers", reason="transformers makes the test model")

from engine_models import make_llama  # noqa: E402
from tallow import LLM  # noqa: E402

VOCAB = 320
MAX_LEN = 64


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_inputs")
    make_llama(path, seed=5, vocab_size=VOCAB)
    return LLM(str(path), max_model_len=MAX_LEN)


def assert_clean(llm):
    eng = llm.engine
    kv = eng.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert not eng.scheduler.has_unfinished and not eng.scheduler.requests
    assert not eng.groups and not eng.output_processor.seq_of
    assert not eng.runner.requests and not eng.sampler._seeds and not eng.sampler._penalty


OK = SamplingParams(temperature=0, max_tokens=3)


def still_works(llm):
    out = llm.generate("t5 t6 t7", OK)[0]
    assert len(out.outputs[0].token_ids) == 3
    assert_clean(llm)


# -- sampling parameters -------------------------------------------------------------------------
BAD_PARAMS = [
    (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(max_tokens=-5), "max_tokens must be an integer >= 1"),
    (dict(max_tokens=2.5), "max_tokens must be an integer >= 1"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.01), r"top_p must be in \(0, 1\]"),
    (dict(top_p=-0.5), r"top_p must be in \(0, 1\]"),
    (dict(top_p=math.nan), "top_p must be a finite number"),
    (dict(stop=5), "stop must be a string or a list of strings, got int 5"),
    (dict(stop=[1]), r"stop must be a non-empty string .* got int 1 \(token ids go in stop_token_ids\)"),
    (dict(stop=["ok", None]), "stop must be a non-empty string"),
    (dict(stop=[""]), "stop must be a non-empty string"),
    (dict(stop={"a"}), "stop must be a string or a list of strings"),
    (dict(stop_token_ids=5), "stop_token_ids must be a list of token ids"),
    (dict(stop_token_ids=[-1]), "stop_token_ids must be non-negative integers"),
    (dict(stop_token_ids=["t5"]), "stop_token_ids must be non-negative integers"),
    (dict(n=0), "n must be an integer >= 1"),
    (dict(n=-2), "n must be an integer >= 1"),
    (dict(n=1.5), "n must be an integer"),
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(temperature="hot"), "temperature must be a finite number"),
    (dict(temperature=math.inf), "temperature must be a finite number"),
    (dict(top_k=-2), "top_k must be -1"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(frequency_penalty=2.5), r"frequency_penalty must be in \[-2, 2\]"),
    (dict(presence_penalty=-3), r"presence_penalty must be in \[-2, 2\]"),
    (dict(logprobs=21), r"logprobs must be an integer in \[0, 20\]"),
    (dict(prompt_logprobs=21), r"prompt_logprobs must be an integer in \[0, 20\]"),
    (dict(logit_bias=[5]), "logit_bias must be a dict of token id -> bias, got list"),
    (dict(logit_bias={-1: 2.0}), r"logit_bias keys must be token ids \(integers >= 0\), got -1"),
    (dict(logit_bias={"5": 2.0}), r"logit_bias keys must be token ids \(integers >= 0\), got '5'"),
    (dict(logit_bias={5: 100.5}), r"logit_bias values must be numbers in \[-100, 100\], got 100.5 for token 5"),
    (dict(logit_bias={5: math.nan}), r"logit_bias values must be numbers in \[-100, 100\], got nan for token 5"),
    (dict(min_tokens=5, max_tokens=2), r"min_tokens \(5\) must not exceed max_tokens \(2\)"),
    (dict(min_tokens=-1), "min_tokens must be an integer >= 0"),
    (dict(seed="x"), "seed must be an integer"),
]


@pytest.mark.parametrize("kwargs,msg", BAD_PARAMS, ids=[str(k) for k, _ in BAD_PARAMS])
def test_bad_sampling_params(llm, kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kwargs)
    # the engine checks again (a SamplingParams changed after it was made)
    sp = SamplingParams(max_tokens=8)
    for k, v in kwargs.items():
        setattr(sp, k, v)
    with pytest.raises(ValueError, match=msg):
        llm.generate("t5 t6", sp)
    assert_clean(llm)


def test_logit_bias(llm):
    """A token out of the vocabulary is refused; +100 on one token makes greedy decoding emit only it,
    -100 on the greedy choice moves it off that token; the engine forgets the bias when done."""
    with pytest.raises(ValueError, match=f"logit_bias token id {VOCAB} is out of range: this model's vocabulary "
                                         f"has ids 0..{VOCAB - 1}"):
        llm.generate("t5", SamplingParams(logit_bias={VOCAB: 1.0}))
    assert_clean(llm)
    forced = llm.generate("t5 t6 t7", SamplingParams(temperature=0, max_tokens=6, logit_bias={42: 100}))[0]
    assert forced.outputs[0].token_ids == [42] * 6
    plain = llm.generate("t5 t6 t7", SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].token_ids[0]
    banned = llm.generate("t5 t6 t7", SamplingParams(temperature=0, max_tokens=4, logit_bias={plain: -100}))[0]
    assert plain not in banned.outputs[0].token_ids
    assert_clean(llm)
    assert not llm.engine.sampler._bias


def test_params_must_be_sampling_params(llm):
    with pytest.raises(ValueError, match="sampling params must be a SamplingParams or a list of them, got dict"):
        llm.generate("t5", {"temperature": 0})
    with pytest.raises(ValueError, match="sampling params must be a SamplingParams, got dict"):
        llm.generate(["t5"], [{"temperature": 0}])
    with pytest.raises(ValueError, match="sampling params must be a SamplingParams, got int"):
        llm.engine.add_request("t5", 3)
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        llm.generate(["t5", "t6"], [OK])
    assert_clean(llm)


# -- prompts -------------------------------------------------------------------------------------------
BAD_PROMPTS = [
    ("", "the prompt is empty"),
    ({"prompt": ""}, "the prompt is empty"),
    ({"prompt_token_ids": []}, "the prompt is empty"),
    ({"prompt_token_ids": [3, -1]}, r"prompt token id -1 is out of range: this model's vocabulary has ids 0\.\.319"),
    ({"prompt_token_ids": [5, VOCAB]}, "prompt token id 320 is out of range"),
    ([2, 3, 10**9], "prompt token id 1000000000 is out of range"),
    ({"prompt_token_ids": [1.5, 2]}, "'prompt_token_ids' must be a list of integer token ids"),
    ({"prompt_token_ids": "t5 t6"}, "'prompt_token_ids' must be a list of integer token ids"),
    ({"prompt_token_ids": [True, 2]}, "'prompt_token_ids' must be a list of integer token ids"),
    ({"text": "t5"}, "a prompt dict needs 'prompt' or 'prompt_token_ids'"),
    ({"prompt": 5}, "'prompt' must be a string, got int"),
    (5, "unsupported prompt type int"),
    (3.5, "unsupported prompt type float"),
    (None, "unsupported prompt type NoneType"),
    (b"t5 t6", "unsupported prompt type bytes"),
    (object(), "unsupported prompt type object"),
    ({"prompt_token_ids": list(range(2, 2 + MAX_LEN))}, r"the prompt has 64 tokens; this model's context "
                                                        r"\(max_model_len\) is 64"),
    (" ".join(f"t{i}" for i in range(2, 2 + 100)), "the prompt has 100 tokens"),
]


@pytest.mark.parametrize("prompt,msg", BAD_PROMPTS, ids=[repr(p)[:30] for p, _ in BAD_PROMPTS])
def test_bad_prompts(llm, prompt, msg):
    with pytest.raises(ValueError, match=msg):
        llm.generate(prompt, OK)
    with pytest.raises(ValueError, match=msg):
        llm.engine.add_request(prompt, OK)
    assert_clean(llm)


def test_bad_prompt_in_a_stream_or_chat(llm):
    with pytest.raises(ValueError, match="the prompt is empty"):
        next(iter(llm.generate_stream("", OK)))
    with pytest.raises(ValueError, match="unsupported prompt type list"):
        llm.engine.add_request(["t5", 3], OK)
    assert_clean(llm)


def test_longest_prompt_that_fits(llm):
    ids = list(range(2, 2 + MAX_LEN - 1))  # one token of room
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    out = llm.generate({"prompt_token_ids": np.arange(2, 12)}, OK)[0]  # numpy token ids are fine
    assert len(out.outputs[0].token_ids) == 3
    assert_clean(llm)


def test_a_bad_prompt_in_a_batch_leaves_nothing_behind(llm):
    prompts = ["t5 t6", {"prompt_token_ids": [7, 8, 9]}, "", "t9"]
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.generate(prompts, SamplingParams(n=3, max_tokens=4))
    assert_clean(llm)
    params = [OK, OK, OK, SamplingParams(max_tokens=4)]
    params[3].top_p = 2.0
    with pytest.raises(ValueError, match="top_p"):
        llm.generate(["t5", "t6", "t7", "t8"], params)
    assert_clean(llm)
    still_works(llm)


def test_request_id_in_use(llm):
    eng = llm.engine
    eng.add_request("t5 t6", SamplingParams(n=2, max_tokens=2), request_id="x")
    with pytest.raises(ValueError, match="request id 'x' is already in use"):
        eng.add_request("t5", OK, request_id="x")
    with pytest.raises(ValueError, match="request id 'x#1' is already in use"):
        eng.add_request("t5", OK, request_id="x#1")
    eng.abort_request("x")
    assert_clean(llm)
    still_works(llm)


def test_bad_engine_defaults(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_inputs_args")
    make_llama(path, seed=5, vocab_size=VOCAB)
    with pytest.raises(ValueError, match=r"invalid engine argument: sampling default: frequency_penalty"):
        LLM(str(path), frequency_penalty=4.0)
    with pytest.raises(ValueError, match=r"max_gen_tokens must be an integer >= 1"):
        LLM(str(path), max_gen_tokens=0)
