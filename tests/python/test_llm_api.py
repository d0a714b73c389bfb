"""vLLM's offline API where scripts copied from vLLM touch it: RequestOutput / CompletionOutput exported
from tallow, LLM.generate and LLM.chat with use_tqdm (True: a tqdm bar on stderr; a callable: the bar it
makes), LLM.chat(chat_template_kwargs=...), and LLM.embed returning EmbeddingRequestOutputs whose
outputs.embedding is the model's final hidden state (checked against transformers)."""
import math

import numpy as np
import pytest

import tallow
from server_harness import write_tiny_llama
from tallow import LLM, SamplingParams

# the harness's template plus one variable a script passes through chat_template_kwargs
TEMPLATE = ("{% if enable_thinking is defined and not enable_thinking %}t9 {% endif %}"
            "{% for m in messages %}t2 {{ m['content'] }} t3 {% endfor %}{% if add_generation_prompt %}t4{% endif %}")
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("llm_api") / "m", seed=21, chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), num_kv_blocks=64)


class RecordingBar:
    """What a use_tqdm callable returns: records how it was made and updated."""
    made: list = []

    def __init__(self, **kwargs):
        self.kwargs, self.updates, self.postfix, self.closed = kwargs, [], None, False
        RecordingBar.made.append(self)

    def update(self, n=1):
        self.updates.append(n)

    def set_postfix_str(self, s, refresh=True):
        self.postfix = s

    def close(self):
        self.closed = True


def test_output_types_are_exported(llm):
    assert {"RequestOutput", "CompletionOutput", "EmbeddingRequestOutput", "EmbeddingOutput"} <= set(tallow.__all__)
    out = llm.generate("t5 t6", PARAMS, use_tqdm=False)[0]
    assert isinstance(out, tallow.RequestOutput) and isinstance(out.outputs[0], tallow.CompletionOutput)
    assert len(out.outputs[0].token_ids) == 4 and out.finished


def test_generate_shows_a_progress_bar_by_default(llm, capfd):
    capfd.readouterr()
    outs = llm.generate(["t5", "t6 t7", "t8"], PARAMS)
    err = capfd.readouterr().err
    assert len(outs) == 3
    assert "Processed prompts" in err and "3/3" in err and "toks/s" in err
    llm.generate(["t5", "t6"], PARAMS, use_tqdm=False)
    assert capfd.readouterr().err == ""


def test_use_tqdm_takes_a_bar_factory(llm):
    RecordingBar.made.clear()
    outs = llm.generate(["t5", "t6 t7", "t8", "t9"], PARAMS, use_tqdm=RecordingBar)
    (bar,) = RecordingBar.made
    assert bar.kwargs["total"] == 4 and bar.kwargs["desc"] == "Processed prompts"
    assert sum(bar.updates) == 4 and bar.closed
    # the rates count every prompt and generated token (3 + ... input tokens, 4 x 4 output tokens)
    assert "est. speed input" in bar.postfix and "output" in bar.postfix
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4, 4, 4]


def test_a_failed_generate_closes_its_bar(llm):
    RecordingBar.made.clear()
    with pytest.raises(ValueError):
        llm.generate(["t5", {"prompt_token_ids": [10**6]}], PARAMS, use_tqdm=RecordingBar)
    assert all(b.closed for b in RecordingBar.made)  # refused before any ran: no bar or a closed one


def test_chat_takes_chat_template_kwargs_and_use_tqdm(llm):
    tok = llm.get_tokenizer()
    msgs = [{"role": "user", "content": "t5"}]
    RecordingBar.made.clear()
    plain = llm.chat(msgs, PARAMS, use_tqdm=RecordingBar)[0]
    assert len(RecordingBar.made) == 1 and RecordingBar.made[0].kwargs["total"] == 1
    no_think = llm.chat(msgs, PARAMS, chat_template_kwargs={"enable_thinking": False}, use_tqdm=False)[0]
    assert plain.prompt_token_ids == tok.encode("t2 t5 t3 t4", add_special_tokens=False)
    assert no_think.prompt_token_ids == tok.encode("t9 t2 t5 t3 t4", add_special_tokens=False)
    # keyword arguments still reach the template (the older spelling), the explicit dict too
    assert llm.chat(msgs, PARAMS, enable_thinking=False, use_tqdm=False)[0].prompt_token_ids == \
        no_think.prompt_token_ids
    two = llm.chat([msgs, msgs], PARAMS, chat_template_kwargs={"enable_thinking": True}, use_tqdm=False)
    assert [o.prompt_token_ids for o in two] == [plain.prompt_token_ids] * 2
    with pytest.raises(ValueError, match="chat_template_kwargs must be a dict"):
        llm.chat(msgs, PARAMS, chat_template_kwargs=["enable_thinking"])


def test_embed_has_vllms_shape(llm):
    RecordingBar.made.clear()
    outs = llm.embed(["t5 t6 t7", {"prompt_token_ids": [8, 9]}, [10, 11, 12, 13]], use_tqdm=RecordingBar)
    assert [type(o) for o in outs] == [tallow.EmbeddingRequestOutput] * 3
    assert [o.prompt_token_ids for o in outs] == [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    for o in outs:
        assert isinstance(o.outputs, tallow.EmbeddingOutput) and o.finished
        e = o.outputs.embedding
        assert isinstance(e, list) and len(e) == 64 and all(isinstance(x, float) for x in e)
        assert math.isclose(math.fsum(x * x for x in e), 1.0, rel_tol=1e-5)
    assert len({o.request_id for o in outs}) == 3
    (bar,) = RecordingBar.made
    assert bar.kwargs["total"] == 3 and sum(bar.updates) == 3 and bar.closed
    # one prompt alone gives the same vector as in a batch; pooling and normalize change it
    (alone,) = llm.embed([10, 11, 12, 13], use_tqdm=False)
    np.testing.assert_allclose(alone.outputs.embedding, outs[2].outputs.embedding, rtol=1e-6, atol=1e-7)
    mean = llm.embed([10, 11, 12, 13], pooling="mean", use_tqdm=False)[0].outputs.embedding
    raw = llm.embed([10, 11, 12, 13], normalize=False, use_tqdm=False)[0].outputs.embedding
    assert not np.allclose(mean, alone.outputs.embedding)
    np.testing.assert_allclose(np.asarray(raw) / np.linalg.norm(raw), alone.outputs.embedding, rtol=1e-5, atol=1e-6)


def test_embed_validates_every_prompt_before_any_runs(llm):
    RecordingBar.made.clear()
    with pytest.raises(ValueError, match="out of range"):
        llm.embed(["t5", [10**6]], use_tqdm=RecordingBar)
    assert RecordingBar.made == []  # nothing started
    with pytest.raises(ValueError, match="pooling"):
        llm.embed("t5", pooling="cls")
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_blocks  # every block back


def test_embed_is_the_final_hidden_state_of_transformers(llm, model_dir):
    torch = pytest.importorskip("torch", reason="torch is the test-only reference for the hidden states")
    transformers = pytest.importorskip("transformers", reason="transformers is the test-only reference")
    ref = transformers.AutoModel.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    ids = [5, 6, 7, 8, 9, 10]
    with torch.no_grad():
        hidden = ref(torch.tensor([ids])).last_hidden_state[0].numpy()  # after the final norm
    last = llm.embed([ids], use_tqdm=False)[0].outputs.embedding
    mean = llm.embed([ids], pooling="mean", use_tqdm=False)[0].outputs.embedding
    np.testing.assert_allclose(last, hidden[-1] / np.linalg.norm(hidden[-1]), atol=2e-4)
    m = hidden.mean(0)
    np.testing.assert_allclose(mean, m / np.linalg.norm(m), atol=2e-4)
