"""IncrementalDetokenizer: only complete UTF-8 is emitted, SentencePiece leading spaces are right
after a prompt, and the deltas add up to exactly the full decode — on random token streams
(byte tokens, special tokens, multi-byte emoji pieces) of every vocabulary type and on real text."""
import functools

import pytest

from tallow.tokenizer import IncrementalDetokenizer, Tokenizer, detokenizer_for
from tallow.tokenizer.byte_level import ByteLevelDetokenizer
from tallow.tokenizer.detokenizer import byte_fallback_ids

VOCABS = {  # name -> path under shared data
    "gpt2-bpe": "vocab/ggml-vocab-gpt-2.gguf",
    "deepseek-bpe": "vocab/ggml-vocab-deepseek-llm.gguf",
    "llama-spm": "vocab/ggml-vocab-llama-spm.gguf",
    "phi3-spm": "vocab/ggml-vocab-phi-3.gguf",
    "stories-spm": "stories260K/stories260K.gguf",
    "bert-wpm": "vocab/ggml-vocab-bert-bge.gguf",
    "llama2-model": "llama2-tokenizer/tokenizer.model",
    "llama2-metaspace": "llama2-tokenizer/tokenizer.model",
}

TEXTS = ["Hello world", " leading space", "  two spaces", "😀 emoji 🦙 llama 👨‍👩‍👧", "中文 text 日本語",
         "a\nb\n\n c", "x = [1, 2, 3]  # list", "Ünïcödé Führer ½", "trailing   "]


@functools.lru_cache(maxsize=None)
def _load(name: str, root: str) -> Tokenizer:
    import pathlib

    from tokenizers import decoders

    path = pathlib.Path(root) / VOCABS[name]
    if path.suffix == ".gguf":
        return Tokenizer.from_gguf(path)
    tok = Tokenizer.from_file(path)
    if name == "llama2-metaspace":  # the decoder newer Hugging Face conversions use
        tok.backend_tokenizer.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)])
    return tok


@pytest.fixture(params=list(VOCABS))
def tok(request, shared_data):
    p = shared_data / VOCABS[request.param]
    if not p.is_file():
        pytest.skip(f"{p} not found")
    return _load(request.param, str(shared_data))


# The general detokenizer, and the fastest exact one for the vocabulary (byte-level ones get a table).
@pytest.fixture(params=["incremental", "fastest"])
def make(request):
    return IncrementalDetokenizer if request.param == "incremental" else detokenizer_for


def stream(tok, ids, prompt=None, skip=True, make=IncrementalDetokenizer):
    d = make(tok, prompt_ids=prompt, skip_special_tokens=skip)
    deltas = [d.add(t) for t in ids]
    deltas.append(d.finish())
    assert d.text == "".join(deltas) and d.output_ids == list(ids)
    return deltas


def expected(tok, ids, prompt=None, skip=True):
    if not prompt:
        return tok.decode(ids, skip_special_tokens=skip)
    full = tok.decode(list(prompt) + list(ids), skip_special_tokens=skip)
    head = tok.decode(list(prompt), skip_special_tokens=skip)
    return full[len(head):] if full.startswith(head) else None


def random_stream(tok, rng, pieces):
    n = tok.vocab_size
    byte_ids = sorted(byte_fallback_ids(tok))
    special = tok.all_special_ids
    ids = []
    for _ in range(int(rng.integers(0, 40))):
        r = rng.random()
        if r < 0.25 and byte_ids:
            ids.append(int(rng.choice(byte_ids)))
        elif r < 0.35:
            ids.append(int(rng.choice(special)))
        elif r < 0.6:
            piece = pieces[int(rng.integers(len(pieces)))]
            ids.extend(piece[:int(rng.integers(1, len(piece) + 1))])  # whole or cut multi-byte pieces
        else:
            ids.append(int(rng.integers(n)))
    return ids


def test_random_streams(tok, rng, make):
    pieces = [tok.encode(t, add_special_tokens=False) or [0] for t in ["😀", "🦙🚀", "你好", "½", " é", "👨‍👩‍👧", "Ω x"]]
    checked = 0
    for _ in range(150):
        ids = random_stream(tok, rng, pieces)
        prompt = [int(x) for x in rng.integers(tok.vocab_size, size=int(rng.integers(0, 8)))] if rng.random() < 0.5 else None
        for skip in (True, False):
            want = expected(tok, ids, prompt, skip)
            if want is None:
                continue  # the prompt's own text changes when output bytes complete it
            deltas = stream(tok, ids, prompt, skip, make)
            assert "".join(deltas) == want, (ids, prompt, skip)
            if "\ufffd" not in want:
                assert not any("\ufffd" in d for d in deltas)
            checked += 1
    assert checked > 200


def test_real_text(tok, make):
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        for prompt in (None, tok.encode("Question: what?", add_special_tokens=True)):
            deltas = stream(tok, ids, prompt, make=make)
            assert "".join(deltas) == expected(tok, ids, prompt)
            assert not any("\ufffd" in d for d in deltas)
        # one token at a time, from BOS: the text builds up to the full decode
        full = tok.encode(text)
        d = make(tok)
        acc = ""
        for i, t in enumerate(full):
            acc += d.add(t)
            assert tok.decode(full[:i + 1]).startswith(acc)
        assert acc + d.finish() == tok.decode(full)


def test_spm_leading_space_after_prompt(shared_data):
    tok = _load("llama-spm", str(shared_data))
    world = tok.piece_to_id("\u2581world")
    prompt = tok.encode("Hello")  # [BOS, ▁Hello]
    d = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert d.add(world) == " world"  # continues the prompt's text
    d = IncrementalDetokenizer(tok)
    assert d.add(world) == "world"  # the start of a text drops it, as decode() does
    d = IncrementalDetokenizer(tok, prompt_ids=[tok.bos_token_id])  # a prompt of only BOS: still the start
    assert d.add(world) == "world"
    d = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert [d.add(t) for t in [tok.eos_token_id, world]] == ["", " world"]  # a skipped token in between


def test_byte_fallback_emoji(shared_data):
    tok = _load("llama-spm", str(shared_data))
    ids = tok.encode("😀!", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == ["▁", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "!"]
    d = IncrementalDetokenizer(tok)
    out = [d.add(t) for t in ids]
    assert out == ["", "", "", "", "", "😀!"]  # a byte run is held until it ends, then emitted whole
    assert d.finish() == ""
    d = IncrementalDetokenizer(tok)
    assert [d.add(t) for t in ids[:5]] == [""] * 5 and d.finish() == "😀"
    d = IncrementalDetokenizer(tok)
    assert [d.add(t) for t in ids[:3]] == [""] * 3
    assert d.finish() == tok.decode(ids[:3]) == "\ufffd\ufffd"  # truly invalid at the end
    with pytest.raises(RuntimeError):
        d.add(1)


def test_byte_level_emoji(shared_data):
    tok = _load("gpt2-bpe", str(shared_data))
    ids = tok.encode("😀 ok", add_special_tokens=False)
    pieces = tok.convert_ids_to_tokens(ids)
    assert len(pieces) > 2  # the emoji is cut across byte-level tokens
    d = IncrementalDetokenizer(tok)
    out = [d.add(t) for t in ids]
    assert "".join(out) == "😀 ok" and "😀" in out and not any("\ufffd" in o for o in out)
    d = IncrementalDetokenizer(tok)
    d.add(ids[0])
    assert d.finish() == tok.decode(ids[:1]) == "\ufffd"


def test_fastest_is_the_table_for_byte_level_vocabularies(tok):
    d = detokenizer_for(tok)
    is_byte_level = type(tok.backend_tokenizer.decoder).__name__ == "ByteLevel"
    assert isinstance(d, ByteLevelDetokenizer) == is_byte_level
    if not is_byte_level:
        assert isinstance(d, IncrementalDetokenizer)


def _synthetic_byte_level_tokenizer(rng) -> Tokenizer:
    """A byte-level BPE vocabulary made here (no shared data): the 256 byte symbols, random merged
    pieces of them (cut UTF-8 sequences included), pieces with characters outside the byte map
    (which decode as their own UTF-8), special tokens, and a non-special added token that the
    decoder would garble ("ü" read as a byte symbol is one invalid byte), as DeepSeek's vocabulary has."""
    from tokenizers import AddedToken, decoders, models
    from tokenizers import Tokenizer as HFTokenizer

    from tallow.tokenizer.byte_level import byte_symbols

    symbols = byte_symbols()
    vocab = {c: i for i, c in enumerate(symbols)}
    texts = ["😀", "中文", " hello", "é", "\n\n", "½ x"]
    while len(vocab) < 500:  # of ~10^4 possible pieces
        if rng.random() < 0.5:
            raw = rng.choice(texts).encode()
            cut = raw[int(rng.integers(0, len(raw))):][:int(rng.integers(1, 5))]
            piece = "".join(symbols[b] for b in cut)
        else:
            piece = "".join(rng.choice(["中", "a", "Ġ", "ü", "🦙", "Ã", "b", "Ċ", "¤", "z"], size=int(rng.integers(1, 5))))
        vocab.setdefault(piece, len(vocab))
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken("<|im_end|>", special=True), AddedToken("<s>", special=True)])
    hf.add_tokens([AddedToken("ü", special=False, normalized=False)])
    return Tokenizer(hf, eos_token_id=hf.token_to_id("<|im_end|>"))


def test_byte_level_table_equals_decode_without_shared_data(rng):
    tok = _synthetic_byte_level_tokenizer(rng)
    assert tok.raw_added_tokens  # the garbled added token is decoded as its own text
    n = tok.vocab_size
    checked = 0
    for _ in range(300):
        ids = [int(i) for i in rng.integers(n, size=int(rng.integers(0, 30)))]
        prompt = [int(i) for i in rng.integers(n, size=int(rng.integers(0, 6)))] if rng.random() < 0.5 else None
        for skip in (True, False):
            want = expected(tok, ids, prompt, skip)
            if want is None:
                continue
            d = detokenizer_for(tok, prompt_ids=prompt, skip_special_tokens=skip)
            assert isinstance(d, ByteLevelDetokenizer)
            deltas = [d.add(t) for t in ids] + [d.finish()]
            assert "".join(deltas) == want == d.text, (ids, prompt, skip)
            assert d.output_ids == ids
            assert not any(x.endswith("\ufffd") for x in deltas[:-1] if x) or "\ufffd" in want
            checked += 1
    assert checked > 400
    d = detokenizer_for(tok)
    with pytest.raises(ValueError, match="out of range"):
        d.add(n)
    d.finish()
    with pytest.raises(RuntimeError):
        d.add(1)


def test_byte_level_completes_a_character_the_prompt_began(shared_data):
    tok = _load("gpt2-bpe", str(shared_data))
    ids = tok.encode("😀", add_special_tokens=False)
    assert len(ids) > 1
    d = detokenizer_for(tok, prompt_ids=ids[:1])
    assert [d.add(t) for t in ids[1:]][-1] == "😀"  # as IncrementalDetokenizer emits it
    g = IncrementalDetokenizer(tok, prompt_ids=ids[:1])
    assert [g.add(t) for t in ids[1:]][-1] == "😀"
