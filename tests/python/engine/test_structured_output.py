"""Structured output (engine/structured_output.py): llguidance matchers over the model's token bytes,
masks applied in the sampler, matchers advanced by each token, the request ending on EOS once the
grammar is complete.

On the demo model (SmolLM2-135M-Instruct, a real tokenizer), sampled at temperature 1 with fresh
seeds: 200 JSON-schema outputs over 8 schemas all parse and validate (jsonschema); regex outputs match
in full; choice outputs are one of the choices; constrained and unconstrained requests share batches
without changing the unconstrained ones; nothing is left behind (matchers, KV blocks)."""
import json
import re
import secrets

import numpy as np
import pytest

from tallow import LLM, SamplingParams
from tallow.engine.structured_output import StructuredOutputsParams as SO
from tallow.engine.structured_output import token_bytes

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from engine_models import DEMO_MODEL_MISSING, demo_gguf  # noqa: E402

GGUF = demo_gguf()
needs_demo = pytest.mark.skipif(GGUF is None, reason=DEMO_MODEL_MISSING)

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
     "required": ["color", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -999, "maximum": 999},
                                                                                 "y": {"type": "integer", "minimum": -999, "maximum": 999}},
                                                "required": ["x", "y"], "additionalProperties": False}},
     "required": ["point"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"},
                                      "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
     "required": ["city", "population"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9999}, {"type": "null"}]},
                                      "reason": {"type": "string", "maxLength": 30}},
     "required": ["answer", "reason"], "additionalProperties": False},
    {"type": "string", "maxLength": 16},
]
PROMPTS = ["Describe a person as JSON.", "Give me some data in JSON.", "Answer with JSON only:", "JSON:"]


@pytest.fixture(scope="module")
def llm():
    if GGUF is None:
        pytest.skip(DEMO_MODEL_MISSING)
    return LLM(GGUF, max_num_seqs=64)


def assert_clean(llm):
    eng = llm.engine
    assert not eng.grammars.matchers and not eng._compiling
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks
    assert not eng.scheduler.has_unfinished


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        SO()
    with pytest.raises(ValueError, match="exactly one"):
        SO(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="choice"):
        SO(choice=[])
    with pytest.raises(ValueError, match="invalid sampling parameter"):
        SamplingParams(structured_outputs={"regex": "a", "json": {}})
    # the engine-core message form comes back as the same constraint
    so = SO(json={"type": "object"})
    assert SamplingParams(structured_outputs=so.to_dict()).structured_outputs == so


@needs_demo
def test_token_bytes_concatenate_to_the_text():
    from tallow.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(GGUF)
    pieces, special = token_bytes(tok, 49152 + 5)  # padded rows past the vocabulary are empty
    assert len(pieces) == 49157 and pieces[-5:] == [b""] * 5
    for text in ['{"name": "Zoë", "n": 3}', "line one\n\ttwo  spaces", "日本語 ✓"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(pieces[i] for i in ids) == text.encode("utf-8")
    assert tok.eos_token_id in special


def test_token_bytes_of_a_sentencepiece_vocabulary(shared_data):
    from tallow.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(shared_data / "stories260K" / "stories260K.gguf")
    pieces, _ = token_bytes(tok, len(tok))
    text = "Once upon a time, a little girl\nsaw 3 birds."
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(pieces[i] for i in ids).lstrip(b" ") == text.encode()


def test_compiled_grammars_are_cached_copies(shared_data, monkeypatch):
    """The same constraint twice compiles once and gives independent matchers; an invalid one is the same
    ValueError each time; past the cache's size the least recently used is compiled again."""
    from tallow.engine import structured_output as so_mod
    from tallow.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(shared_data / "stories260K" / "stories260K.gguf")
    cache = so_mod.CompiledGrammars(tok, len(tok), [tok.eos_token_id])
    compiles = []
    real = cache._compile
    monkeypatch.setattr(cache, "_compile", lambda g, k: compiles.append(g) or real(g, k))
    pieces, _ = token_bytes(tok, len(tok))

    def ids(text: str) -> list[int]:  # one token a character (the byte pieces)
        return [pieces.index(bytes([c])) for c in text.encode()]
    a = cache.matcher(SO(regex=r"ab+c")).result()
    b = cache.matcher(SO(regex=r"ab+c")).result()
    assert len(compiles) == 1 and a is not b
    assert a.consume_tokens(ids("abbb"))
    assert b.validate_tokens(ids("ac")) == 1 and b.validate_tokens(ids("abc")) == 3  # b is where it began
    assert a.validate_tokens(ids("c")) == 1 and a.validate_tokens(ids("a")) == 0  # a moved on alone
    for _ in range(2):
        with pytest.raises(ValueError, match="invalid regex constraint"):
            cache.matcher(SO(regex=r"a(b")).result()
    assert len(compiles) == 2
    monkeypatch.setattr(so_mod, "GRAMMAR_CACHE_SIZE", 2)
    cache.matcher(SO(regex=r"x+")).result()  # evicts ab+c, the least recently used
    cache.matcher(SO(regex=r"ab+c")).result()
    assert compiles[-1] == SO(regex=r"ab+c").llguidance_grammar() and len(compiles) == 4
    cache.shutdown()


# Enough tokens for any output of these schemas: strings and numbers are bounded, and so is the whitespace
# between JSON tokens (JSON_WHITESPACE, <= 24 characters a gap, ~12 gaps): at temperature 1 the demo model
# sometimes fills gaps with blanks, and a 200-token budget then cut 1 of 200 outputs short.
JSON_BUDGET = 1000


@needs_demo
def test_200_json_schema_outputs_validate(llm):
    prompts, params, schemas = [], [], []
    for k in range(200):
        schema = SCHEMAS[k % len(SCHEMAS)]
        prompts.append(PROMPTS[k % len(PROMPTS)])
        params.append(SamplingParams(temperature=1.0, max_tokens=JSON_BUDGET, seed=secrets.randbits(32),
                                     structured_outputs=SO(json=schema)))
        schemas.append(schema)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, schema in zip(outs, schemas):
        o = out.outputs[0]
        assert o.finish_reason == "stop", (o.text, o.finish_reason)
        jsonschema.validate(json.loads(o.text), schema)
    assert_clean(llm)


@needs_demo
def test_regex_choice_grammar_and_json_object(llm):
    reqs = [
        ("Phone:", SO(regex=r"\d{3}-\d{4}"), lambda t: re.fullmatch(r"\d{3}-\d{4}", t)),
        ("The sky is", SO(choice=["blue", "green", "a deep red"]), lambda t: t in ("blue", "green", "a deep red")),
        ("Yes or no?", SO(grammar='start: ("yes" | "no") "!"'), lambda t: t in ("yes!", "no!")),
        ("Count:", SO(grammar='root ::= [0-9] [0-9]? " items"'), lambda t: re.fullmatch(r"[0-9]{1,2} items", t)),  # GBNF
    ]
    for _ in range(3):
        outs = llm.generate([p for p, _, _ in reqs],
                            [SamplingParams(temperature=1.0, max_tokens=60, seed=secrets.randbits(32),
                                            structured_outputs=so) for _, so, _ in reqs], use_tqdm=False)
        for out, (_, _, ok) in zip(outs, reqs):
            assert ok(out.outputs[0].text), out.outputs[0].text
            assert out.outputs[0].finish_reason == "stop"
    assert_clean(llm)


@needs_demo
def test_json_object_is_an_object(llm):
    """Any JSON object: unbounded, so an output may be cut by max_tokens; every finished one parses."""
    outs = llm.generate(["Some JSON:"] * 6, [SamplingParams(temperature=0.7, max_tokens=120, seed=secrets.randbits(32),
                                                            structured_outputs=SO(json_object=True))
                                             for _ in range(6)], use_tqdm=False)
    for out in outs:
        o = out.outputs[0]
        assert o.text.startswith("{")
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)
        else:
            assert o.finish_reason == "length"
    assert_clean(llm)


@needs_demo
def test_unconstrained_requests_in_the_same_batch_are_unchanged(llm):
    """The same schedule twice, rows 1 and 3 constrained or not: rows 0 and 2 get the same tokens. (Rows
    1 and 3 go first and are running before 0 and 2 arrive, so a grammar's compile time does not change
    the batches.)"""
    eng = llm.engine
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=3)

    def run(second):
        tokens: dict[str, list[int]] = {}
        for rid, prompt in (("r1", "Digits:"), ("r3", "More digits:")):
            eng.add_request(prompt, second, rid)
        while not all(eng.has_request_id(r) for r in ("r1", "r3")):
            for out in eng.step():
                tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        for out in eng.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        for rid, prompt in (("r0", "Tell me about the sea."), ("r2", "List three fruits.")):
            eng.add_request(prompt, plain, rid)
        while eng.has_unfinished_requests():
            for out in eng.step():
                tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        return tokens

    free = run(other)
    mixed = run(other.clone(structured_outputs=SO(regex=r"\d{40}")))
    assert free["r0"] == mixed["r0"] and free["r2"] == mixed["r2"]
    assert len(mixed["r0"]) == 24
    for rid in ("r1", "r3"):
        assert len(mixed[rid]) == 20 and re.fullmatch(r"\d+", llm.get_tokenizer().decode(mixed[rid]))
    assert_clean(llm)


@needs_demo
def test_n_completions_each_follow_the_grammar(llm):
    out = llm.generate(["Pick:"], SamplingParams(n=4, temperature=1.0, max_tokens=10, seed=7,
                                                 structured_outputs=SO(choice=["alpha", "beta", "gamma"])),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 4 and all(o.text in ("alpha", "beta", "gamma") for o in out.outputs)
    assert_clean(llm)


@needs_demo
def test_max_tokens_cuts_a_constrained_output_and_cleans_up(llm):
    out = llm.generate(["JSON:"], SamplingParams(temperature=1.0, max_tokens=3, seed=1,
                                                 structured_outputs=SO(json=SCHEMAS[0])), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 3
    assert_clean(llm)


@needs_demo
def test_abort_while_compiling_or_running_frees_everything(llm):
    eng = llm.engine
    params = SamplingParams(temperature=1.0, max_tokens=50, structured_outputs=SO(json=SCHEMAS[2]))
    eng.add_request("JSON:", params, "a")
    eng.abort_request("a")  # still compiling: never scheduled
    eng.add_request("JSON:", params, "b")
    for _ in range(4):
        eng.step()
    eng.abort_request("b")
    while eng.has_unfinished_requests():
        eng.step()
    assert_clean(llm)


@needs_demo
def test_masks_are_applied_on_the_sampled_rows(llm):
    """The sampler sees the grammar's mask: with a logit_bias that would force another token, the
    grammar still wins."""
    banned = llm.get_tokenizer().encode("7", add_special_tokens=False)[0]
    out = llm.generate(["Digits:"], SamplingParams(temperature=0, max_tokens=8, logit_bias={banned: 100.0},
                                                   structured_outputs=SO(regex=r"[0-6]{4}")), use_tqdm=False)[0]
    assert re.fullmatch(r"[0-6]{4}", out.outputs[0].text)
    assert np.all([t != banned for t in out.outputs[0].token_ids])


def test_constraints_cross_to_the_engine_core_process_as_plain_data():
    """The API process sends SamplingParams as a msgpack dict (core_client._params_dict); the core rebuilds the
    same constraint from it (core_process._params)."""
    import msgspec

    from tallow.engine.core_client import _params_dict
    from tallow.engine.core_process import _params

    for so in (SO(json={"type": "object", "properties": {"a": {"type": "integer"}}}), SO(json_object=True),
               SO(regex=r"\d+"), SO(choice=["x", "y"]), SO(grammar='start: "a"'), SO(lark='start: %json {}')):
        p = SamplingParams(temperature=0.5, max_tokens=7, structured_outputs=so, logit_bias={3: 1.5})
        back = _params(msgspec.msgpack.decode(msgspec.msgpack.encode(_params_dict(p))))
        assert back.structured_outputs == so and back.logit_bias == {3: 1.5} and back.max_tokens == 7


from engine_models import DEVICES  # noqa: E402


@pytest.mark.parametrize("device", DEVICES)
def test_stories260k_sentencepiece_vocabulary_on_every_device(shared_data, device):
    """A real trained model with a 512-piece SentencePiece vocabulary (byte fallback), on the CPU and, where
    there is one, the GPU (overlapped steps: the masks are computed while the forward pass runs)."""
    llm = LLM(str(shared_data / "stories260K" / "stories260K.gguf"), device=device, max_num_seqs=16)
    schema = {**SCHEMAS[1], "x-guidance": {"whitespace_flexible": False}}  # a 260K model loves blanks
    prompts = ["Once upon a time"] * 12
    params = [SamplingParams(temperature=1.0, max_tokens=120, seed=secrets.randbits(32),
                             structured_outputs=SO(json=schema) if k % 3 == 0 else
                             SO(regex=r"[a-z]{3,8}( [a-z]{3,8}){2}\.") if k % 3 == 1 else
                             SO(choice=["Lily", "Tom", "the little dog"])) for k in range(12)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for k, out in enumerate(outs):
        o = out.outputs[0]
        assert o.finish_reason == "stop", (o.text, o.finish_reason)
        if k % 3 == 0:
            jsonschema.validate(json.loads(o.text), schema)
        elif k % 3 == 1:
            assert re.fullmatch(r"[a-z]{3,8}( [a-z]{3,8}){2}\.", o.text), o.text
        else:
            assert o.text in ("Lily", "Tom", "the little dog")
    assert_clean(llm)
