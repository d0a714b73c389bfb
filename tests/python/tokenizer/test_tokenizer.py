"""Tokenizer: Hugging Face folders (tokenizer.json or a SentencePiece tokenizer.model read without
the sentencepiece package), special tokens and BOS/EOS, EOS sets, chat-template plumbing, bad input."""
import json
import shutil
import sys
import types

import pytest

from tallow.tokenizer import NoChatTemplateError, SentencePieceModelError, Tokenizer, TokenizerError
from tallow.tokenizer import sentencepiece_model

HANDPICKED = [
    "Hello world", " Hello world", "  Hello", "   leading spaces", "trailing spaces   ", "", " ", "  ", "\n", "\n\n",
    "\t", "a\tb\nc\r\nd", "Führer", "héllo wörld", "😀", "🦙🦙🦙", "👨‍👩‍👧‍👦 family", "😶‍🌫️ (multiple emojis) ✅",
    "我想在apple工作1314151天～", "日本語のテキスト", "한국어 텍스트", "нещо на Български", "ὕαλον ϕαγεῖν δύναμαι",
    "कान्तिः", "កាន់តែពិសេសអាចខលចេញ", "العربية نص", "3", "33", "333", "3333333333", "1,234,567.89", "0x1F600",
    "def f(x):\n    return x ** 2  # square\n", "if (a && b) { return c->d[0]; }", "<html><body>hi</body></html>",
    "SELECT * FROM t WHERE id = 'x';", "' era", "y'all don't I'll we've", "I'M SHOUTING", "\u200b zero width",
    "non\u00a0breaking", "\u2581 lower one eighth block", "▁▁", "tab\there", "e\u0301 combining", "ﬁ ligature",
    "~!@#$%^&*()_+`-={}|[]\\:\";'<>?,./", "   \n   \n", "x" * 300, "Hello" * 50,
]


def random_texts(rng, n):
    alphabet = (list("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 \n\t.,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`")
                + list("éèüößñçøå中文字日本語한국어😀🦙🚀✅€£¥—–…“”‘’") + ["\u200b", "\u00a0", "\u2581", "  ", "\r\n", "def ", " the"])
    return ["".join(rng.choice(alphabet, size=int(rng.integers(0, 50)))) for _ in range(n)]


@pytest.fixture(scope="module")
def llama2_model(request):
    from conftest import data_dir

    p = data_dir() / "llama2-tokenizer" / "tokenizer.model"
    if not p.is_file():
        pytest.skip(f"Llama-2 tokenizer.model not found at {p} (set TALLOW_TEST_DATA)")
    return p


@pytest.fixture(scope="module")
def llama2(llama2_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("llama2")
    shutil.copy(llama2_model, d / "tokenizer.model")
    return Tokenizer.from_pretrained_dir(d)


def test_sentencepiece_reader(llama2_model):
    m = sentencepiece_model.load_model(llama2_model)
    assert len(m) == 32000 and m.model_type == sentencepiece_model.BPE and m.byte_fallback
    assert (m.unk_id, m.bos_id, m.eos_id, m.pad_id) == (0, 1, 2, -1)
    assert m.pieces[:3] == ["<unk>", "<s>", "</s>"] and m.pieces[3] == "<0x00>" and m.pieces[29871] == "▁"
    assert m.types[:4] == [2, 3, 3, 6]
    assert m.add_dummy_prefix and not m.remove_extra_whitespaces


def test_llama2_matches_sentencepiece(llama2_model, llama2, rng):
    spm = pytest.importorskip("sentencepiece", reason="sentencepiece (test extra) is the reference")
    ref = spm.SentencePieceProcessor(model_file=str(llama2_model))
    texts = HANDPICKED + random_texts(rng, 400)
    bad = []
    for t in texts:
        expected = ref.encode(t)
        got = llama2.encode(t, add_special_tokens=False)
        if got != expected:
            bad.append((t, expected, got))
        elif llama2.decode(got) != ref.decode(expected):
            bad.append((t, "decode", llama2.decode(got), ref.decode(expected)))
    assert not bad, f"{len(bad)}/{len(texts)} differ from sentencepiece, e.g. {bad[:3]}"
    assert llama2.encode("Hello world") == [1] + ref.encode("Hello world")


def test_llama2_roundtrip(llama2, rng):
    for t in HANDPICKED + random_texts(rng, 200):
        if "\u2581" in t:  # SentencePiece's own space symbol decodes to a space: the vocab cannot round-trip it
            assert llama2.decode(llama2.encode(t)) == t.replace("\u2581", " ")
        else:
            assert llama2.decode(llama2.encode(t)) == t


def test_llama2_special_tokens(llama2):
    assert (llama2.bos_token_id, llama2.eos_token_id, llama2.unk_token_id, llama2.pad_token_id) == (1, 2, 0, None)
    assert llama2.eos_token_ids == {2} and llama2.add_bos_token and not llama2.add_eos_token
    assert llama2.vocab_size == len(llama2) == 32000
    assert llama2.all_special_ids == [0, 1, 2]
    assert (llama2.bos_token, llama2.eos_token) == ("<s>", "</s>")
    # special-token text is parsed; a space prefix follows each special token, as in llama.cpp
    assert llama2.encode("<s>Hi</s> there", add_special_tokens=False) == [1, 6324, 2, 29871, 727]
    assert llama2.decode([1, 6324, 2]) == "Hi"
    assert llama2.decode([1, 6324, 2], skip_special_tokens=False) == "<s> Hi</s>"
    assert llama2.convert_ids_to_tokens([6324, 13]) == ["▁Hi", "<0x0A>"] and llama2.id_to_piece(29871) == "▁"
    assert llama2.convert_tokens_to_ids(["▁Hi"]) == [6324] and llama2.piece_to_id("nope-nope") is None
    assert llama2.is_special(1) and not llama2.is_special(6324)
    with pytest.raises(ValueError, match="out of range"):
        llama2.decode([32000])


def test_tokenizer_model_folder_with_configs(llama2_model, tmp_path):
    shutil.copy(llama2_model, tmp_path / "tokenizer.model")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": True, "add_eos_token": True,
        "bos_token": {"content": "<s>", "lstrip": False, "normalized": False, "rstrip": False, "special": True},
        "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<|pad|>",
        "added_tokens_decoder": {
            "32000": {"content": "<|im_start|>", "special": True, "lstrip": False, "rstrip": False, "normalized": False},
            "32001": {"content": "<|pad|>", "special": True},
            "32002": {"content": "<tool>", "special": False},
        },
        "additional_special_tokens": ["<|extra|>"],
        "chat_template": [{"name": "default", "template": "{{ messages }}"}, {"name": "tool_use", "template": "T"}],
    }))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 32000], "bos_token_id": 1}))
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    assert tok.vocab_size == 32004 and tok.pad_token_id == 32001 and tok.is_special(tok.piece_to_id("<|extra|>"))
    assert tok.eos_token_id == 2 and tok.eos_token_ids == {2, 32000}
    ids = tok.encode("<|im_start|>Hi<tool>")
    assert ids[0] == 1 and ids[1] == 32000 and ids[-2] == 32002 and ids[-1] == 2  # BOS ... EOS
    assert tok.decode(ids) == "Hi<tool>"  # <tool> is not special: kept
    assert set(tok.all_special_ids) == {0, 1, 2, 32000, 32001, 32003}
    assert tok.chat_template == "{{ messages }}" and tok.chat_templates["tool_use"] == "T"
    assert tok.get_chat_template(tools=[{"type": "function"}]) == "T"
    assert tok.get_chat_template("tool_use") == "T" and tok.get_chat_template("{{ x }}") == "{{ x }}"


def test_tokenizer_json_folder(llama2, tmp_path):
    llama2.backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    # the saved post-processor adds BOS; no tokenizer_config overrides it
    assert tok.encode("Hello") == [1, 15043] and tok.eos_token_ids == {2} and tok.chat_template is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False, "add_eos_token": True,
                                                                "chat_template": "from config"}))
    (tmp_path / "chat_template.jinja").write_text("from jinja file")
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    assert tok.encode("Hello") == [15043, 2] and not tok.add_bos_token and tok.add_eos_token
    assert tok.chat_template == "from jinja file"


def test_generation_config_eos_list_without_tokenizer_eos(llama2, tmp_path):
    llama2.backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [13, 2]}))
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    assert tok.eos_token_ids == {13, 2} and tok.eos_token_id == 13


def test_from_file_dispatch(llama2_model, shared_data, tmp_path):
    shutil.copy(llama2_model, tmp_path / "tokenizer.model")
    assert Tokenizer.from_file(tmp_path).vocab_size == 32000
    assert Tokenizer.from_file(tmp_path / "tokenizer.model").vocab_size == 32000
    assert Tokenizer.from_file(shared_data / "stories260K" / "stories260K.gguf").vocab_size == 512


def test_bad_input(tmp_path, llama2_model):
    with pytest.raises(TokenizerError, match="not a directory"):
        Tokenizer.from_pretrained_dir(tmp_path / "missing")
    with pytest.raises(TokenizerError, match="no tokenizer.json or tokenizer.model"):
        Tokenizer.from_pretrained_dir(tmp_path)
    with pytest.raises(TokenizerError, match="no such file"):
        Tokenizer.from_file(tmp_path / "missing.gguf")

    bad_json = tmp_path / "badjson"
    bad_json.mkdir()
    (bad_json / "tokenizer.json").write_text("{ not json")
    with pytest.raises(TokenizerError, match=r"badjson/tokenizer\.json: cannot load tokenizer"):
        Tokenizer.from_pretrained_dir(bad_json)

    bad_model = tmp_path / "badmodel"
    bad_model.mkdir()
    data = llama2_model.read_bytes()
    (bad_model / "tokenizer.model").write_bytes(data[:1001])  # truncated inside a piece
    with pytest.raises(SentencePieceModelError, match=r"badmodel/tokenizer\.model: not a valid SentencePiece model"):
        Tokenizer.from_pretrained_dir(bad_model)
    (bad_model / "tokenizer.model").write_bytes(b"\xff" * 64)
    with pytest.raises(SentencePieceModelError, match="not a valid SentencePiece model"):
        Tokenizer.from_pretrained_dir(bad_model)

    bad_cfg = tmp_path / "badcfg"
    bad_cfg.mkdir()
    shutil.copy(llama2_model, bad_cfg / "tokenizer.model")
    (bad_cfg / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: cannot read JSON"):
        Tokenizer.from_pretrained_dir(bad_cfg)
    (bad_cfg / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|not-in-vocab|>"}))
    with pytest.raises(TokenizerError, match="eos_token '<|not-in-vocab|>' is not in the vocabulary"):
        Tokenizer.from_pretrained_dir(bad_cfg)


def test_apply_chat_template_plumbing(llama2_model, tmp_path, monkeypatch):
    calls = []

    def render_chat_template(template, messages, **kwargs):
        calls.append((template, messages, kwargs))
        return "<s>[INST] " + messages[-1]["content"] + " [/INST]"

    fake = types.ModuleType("tallow.tokenizer.chat_template")
    fake.render_chat_template = render_chat_template
    fake.NoChatTemplateError = NoChatTemplateError
    monkeypatch.setitem(sys.modules, "tallow.tokenizer.chat_template", fake)

    shutil.copy(llama2_model, tmp_path / "tokenizer.model")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "TEMPLATE"}))
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    msgs = [{"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, enable_thinking=False)
    assert text == "<s>[INST] Hi [/INST]"
    template, messages, kwargs = calls[-1]
    assert template == "TEMPLATE" and messages == msgs
    assert kwargs == {"tools": None, "add_generation_prompt": True, "bos_token": "<s>", "eos_token": "</s>",
                      "enable_thinking": False}
    ids = tok.apply_chat_template(msgs, tokenize=True)
    assert ids[:2] == [1, 518] and ids.count(1) == 1  # the template's <s> is parsed; no second BOS

    (tmp_path / "tokenizer_config.json").unlink()
    bare = Tokenizer.from_pretrained_dir(tmp_path)
    with pytest.raises(NoChatTemplateError, match="has no chat template"):
        bare.apply_chat_template(msgs)
    assert bare.apply_chat_template(msgs, chat_template="T2") == "<s>[INST] Hi [/INST]" and calls[-1][0] == "T2"


SPM_CONFIGS = {
    "unigram-nfkc": dict(model_type="unigram", normalization_rule_name="nmt_nfkc"),
    "unigram-identity-bytes": dict(model_type="unigram", normalization_rule_name="identity", byte_fallback=True),
    "unigram-no-prefix": dict(model_type="unigram", normalization_rule_name="nmt_nfkc", remove_extra_whitespaces=False,
                              add_dummy_prefix=False),
    "unigram-user-symbols": dict(model_type="unigram", normalization_rule_name="identity", byte_fallback=True,
                                 user_defined_symbols=["<tool>", "foo"]),
    "bpe-nfkc": dict(model_type="bpe", normalization_rule_name="nmt_nfkc"),
    "bpe-identity-bytes": dict(model_type="bpe", normalization_rule_name="identity", byte_fallback=True,
                               remove_extra_whitespaces=False),
    "bpe-split-digits": dict(model_type="bpe", normalization_rule_name="identity", byte_fallback=True,
                             add_dummy_prefix=False, remove_extra_whitespaces=False, split_digits=True),
}


@pytest.mark.parametrize("config", list(SPM_CONFIGS))
def test_trained_sentencepiece_models(config, rng):
    """Small models trained here with sentencepiece (unigram and BPE; NFKC or identity normalisation;
    with or without the dummy prefix, whitespace collapsing, byte fallback, user-defined symbols):
    the converted tokenizer gives sentencepiece's ids, and its text wherever no <unk> is involved
    (sentencepiece shows <unk> as " ⁇ ", the tokenizers decode skips it as a special token)."""
    import io

    spm = pytest.importorskip("sentencepiece", reason="sentencepiece (test extra) trains the reference models")
    words = ("the quick brown fox jumps over a lazy dog hello world tokenizer sentence piece model "
             "ünïcödé 日本語 テキスト 😀 123 4567 x=1; (a, b)").split()
    lines = [" ".join(rng.choice(words, size=int(rng.integers(1, 12)))) for _ in range(1500)] + HANDPICKED
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=1000,
                                   character_coverage=0.99, hard_vocab_limit=False, minloglevel=2,
                                   num_threads=1, **SPM_CONFIGS[config])
    ref = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    m = sentencepiece_model.parse_model_proto(buf.getvalue())
    tok = sentencepiece_model.to_tokenizers(m)
    for t in HANDPICKED + random_texts(rng, 150) + lines[:20] + ["ｈｅｌｌｏ ① ﬁ", "a<tool>foo b", "x" * 100]:
        if m.remove_extra_whitespaces and "\u2581" in t:
            # sentencepiece's whitespace removal treats its own space symbol in the input
            # inconsistently ("\u2581\u2581" -> nothing, "\u2581 x" -> three of them); not emulated
            continue
        expected = ref.encode(t)
        got = tok.encode(t, add_special_tokens=False).ids
        if got != expected and m.model_type == sentencepiece_model.UNIGRAM:
            # Known difference (Hugging Face tokenizers' Unigram has it too): when two segmentations
            # score exactly the same, e.g. the same pieces in another order in a run of one
            # repeated character, the Viterbi tie is broken differently. Anything else is a bug.
            assert ref.decode(got) == ref.decode(expected), t
            assert sum(m.scores[i] for i in got) == pytest.approx(sum(m.scores[i] for i in expected), rel=1e-6), t
            continue
        assert got == expected, (t, got, expected)
        # (a literal "\u2581" decodes to a space, which sentencepiece then may strip as leading whitespace)
        if m.unk_id not in expected and "\u2581" not in t:
            assert tok.decode(got) == ref.decode(expected), t
