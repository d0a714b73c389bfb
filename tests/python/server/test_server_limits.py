"""server/limits.py: the characters-per-token bound that lets the server refuse an over-long prompt before
tokenizing it (checked against real vocabularies and hostile texts), and tokenization of long texts in a
worker thread."""
import asyncio
import threading
import types

import pytest

from tallow.server import limits
from tallow.server.errors import APIError

HOSTILE_TEXTS = ["a" * 5000, " " * 3000, "\n" * 3000, "\t \n" * 1000, "é" * 1000, "e\u0301" * 1000, "😀" * 500,
                 "ｱﾞ" * 300, "\u1100\u1161\u11a8" * 300, "0" * 4000, "<|endoftext|>" * 50, "\x00\x01" * 500]


def _vocab_tokenizers(shared_data):
    from tallow.tokenizer.tokenizer import Tokenizer

    paths = sorted((shared_data / "vocab").glob("ggml-vocab-*.gguf"))
    if not paths:
        pytest.skip("no vocab-only GGUFs in the shared data")
    for path in paths:
        inp = path.with_name(path.name + ".inp")
        texts = inp.read_text().split("\n__ggml_vocab_test__\n") if inp.exists() else []
        yield path.name, Tokenizer.from_file(path), [t for t in texts + HOSTILE_TEXTS if t]


def test_no_token_covers_more_characters_than_the_bound(shared_data):
    checked = 0
    for name, tok, texts in _vocab_tokenizers(shared_data):
        bound = limits.max_piece_chars(tok)
        keeps, _ = limits._keeps_every_character(tok.backend_tokenizer)
        if not keeps:  # e.g. WordPiece: an unknown word of any length is one token
            assert bound == limits.FALLBACK_PIECE_CHARS, name
            continue
        assert bound < limits.FALLBACK_PIECE_CHARS * 4, name  # a real bound, not the fallback
        for text in texts:
            n = len(tok.encode(text, add_special_tokens=False))
            assert len(text) <= n * bound, (name, text[:40], len(text), n, bound)
        checked += 1
    assert checked >= 5  # the byte-level and byte-fallback vocabularies were really checked


SPECIAL = "<|a-long-special-token|>"


def _bpe(normalizer=None, pre_tokenizer="byte_level"):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    vocab = {"a": 0, "b": 1, "ab": 2, "abab": 3, "<0x20>": 4}
    tk = Tokenizer(models.BPE(vocab, [("a", "b"), ("ab", "ab")], byte_fallback=pre_tokenizer != "byte_level"))
    tk.pre_tokenizer = {"byte_level": pre_tokenizers.ByteLevel(add_prefix_space=False), "none": None,
                        "whitespace": pre_tokenizers.WhitespaceSplit()}[pre_tokenizer]
    tk.add_special_tokens([SPECIAL])
    if normalizer == "nfc":
        tk.normalizer = normalizers.NFC()
    elif normalizer == "strip":
        tk.normalizer = normalizers.Strip()
    return types.SimpleNamespace(backend_tokenizer=tk, get_vocab=lambda: tk.get_vocab(with_added_tokens=True))


@pytest.mark.parametrize("normalizer,pre,expected", [
    (None, "byte_level", len(SPECIAL)),  # the longest piece, added tokens included
    (None, "none", len(SPECIAL)),  # byte fallback covers every character too
    ("nfc", "byte_level", 4 * len(SPECIAL)),  # composed characters stand for up to 3 code points
    ("strip", "byte_level", limits.FALLBACK_PIECE_CHARS),  # a normalizer that deletes characters
    (None, "whitespace", limits.FALLBACK_PIECE_CHARS),  # a pre-tokenizer that drops whitespace
])
def test_max_piece_chars_by_tokenizer_shape(normalizer, pre, expected):
    assert limits.max_piece_chars(_bpe(normalizer, pre)) == expected


def test_max_piece_chars_falls_back_when_the_tokenizer_cannot_tell():
    assert limits.max_piece_chars(object()) == limits.FALLBACK_PIECE_CHARS


class _RecordingTokenizer:
    def __init__(self):
        self.threads = []

    def encode(self, text, add_special_tokens=True):
        self.threads.append(threading.get_ident())
        return [5] * (len(text) // 100 + 1)

    def encode_batch(self, texts, add_special_tokens=True):
        return [self.encode(t, add_special_tokens) for t in texts]


def _state(max_model_len=64, piece_chars=100):
    return types.SimpleNamespace(tokenizer=_RecordingTokenizer(), max_model_len=max_model_len,
                                 max_piece_chars=piece_chars)


def test_long_texts_are_tokenized_off_the_event_loop():
    st = _state(max_model_len=1000)

    async def run(texts):
        loop_thread = threading.get_ident()
        await limits.encode_all(st, texts, "prompt", generate=True)
        return loop_thread

    loop_thread = asyncio.run(run(["x" * 100, "y" * 200]))
    assert st.tokenizer.threads == [loop_thread] * 2  # short: a thread hop would cost more than tokenizing
    st.tokenizer.threads.clear()
    loop_thread = asyncio.run(run(["x" * 10_000, "y" * (limits.OFF_LOOP_CHARS - 5_000)]))
    assert len(st.tokenizer.threads) == 2 and loop_thread not in st.tokenizer.threads


def test_character_bound_refuses_before_tokenizing():
    st = _state(max_model_len=64, piece_chars=100)
    with pytest.raises(APIError) as e:
        asyncio.run(limits.encode_all(st, ["t" * 6_400], "prompt", generate=True))
    assert e.value.code == "context_length_exceeded" and "at least 64 tokens (6400 characters)" in e.value.message
    assert st.tokenizer.threads == []  # never tokenized
    # without room for a completion the same text is fine to count (/tokenize, embeddings) ...
    assert len(asyncio.run(limits.encode_all(st, ["t" * 6_300], "input", generate=False))[0]) == 64
    # ... and the tokens counted after tokenizing are checked too
    with pytest.raises(APIError, match="65 tokens"):
        asyncio.run(limits.encode_all(st, ["t" * 6_400], "input", generate=False))


@pytest.mark.parametrize("field", ["max_pending", "max_seqs_per_request", "max_embedding_inputs",
                                   "max_embedding_tokens"])
def test_server_config_refuses_limits_below_one(field):
    from tallow.server.app import ServerConfig

    with pytest.raises(ValueError, match=field):
        ServerConfig(model_names=["m"], **{field: 0})
    assert getattr(ServerConfig(model_names=["m"], **{field: 7}), field) == 7
