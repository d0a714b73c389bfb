"""A SentencePiece ``tokenizer.model`` reader and its conversion to a ``tokenizers.Tokenizer``.

The model file is a serialized ``sentencepiece.ModelProto`` (sentencepiece_model.proto). Only the
protobuf wire format is needed to read it, so this module parses it directly: no ``sentencepiece``
or ``protobuf`` package at run time.

Fields read (field numbers from sentencepiece_model.proto):

- ModelProto: 1 pieces (repeated SentencePiece), 2 trainer_spec, 3 normalizer_spec
- SentencePiece: 1 piece, 2 score (float), 3 type (1 normal, 2 unknown, 3 control,
  4 user-defined, 5 unused, 6 byte)
- TrainerSpec: 3 model_type (1 unigram, 2 BPE, 3 word, 4 char), 24 treat_whitespace_as_suffix,
  35 byte_fallback, 40-43 unk/bos/eos/pad ids
- NormalizerSpec: 1 name, 2 precompiled_charsmap, 3 add_dummy_prefix, 4 remove_extra_whitespaces,
  5 escape_whitespaces
"""
from __future__ import annotations

import dataclasses
import os
import struct

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
UNIGRAM, BPE, WORD, CHAR = 1, 2, 3, 4


class SentencePieceModelError(ValueError):
    """A tokenizer.model file that cannot be read; the message names the file and the problem."""


@dataclasses.dataclass
class SentencePieceModel:
    pieces: list[str]
    scores: list[float]
    types: list[int]
    model_type: int = UNIGRAM
    byte_fallback: bool = False
    unk_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    pad_id: int = -1
    treat_whitespace_as_suffix: bool = False
    normalizer_name: str = ""
    precompiled_charsmap: bytes = b""
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True
    escape_whitespaces: bool = True

    def __len__(self) -> int:
        return len(self.pieces)


# -- protobuf wire format -------------------------------------------------------------------------
def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 70:
            raise ValueError("varint too long")


def _fields(buf: bytes):
    """Yield (field_number, wire_type, value) for each field of one message. Length-delimited
    values are bytes, varints ints, fixed32/fixed64 raw bytes."""
    pos, n = 0, len(buf)
    while pos < n:
        key, pos = _varint(buf, pos)
        field, wt = key >> 3, key & 7
        if wt == 0:
            v, pos = _varint(buf, pos)
        elif wt == 1:
            v = buf[pos:pos + 8]
            pos += 8
        elif wt == 2:
            ln, pos = _varint(buf, pos)
            v = buf[pos:pos + ln]
            pos += ln
        elif wt == 5:
            v = buf[pos:pos + 4]
            pos += 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wt}")
        if pos > n:
            raise ValueError("message truncated")
        yield field, wt, v


def _int32(v: int) -> int:
    v &= 0xFFFFFFFFFFFFFFFF
    return v - (1 << 64) if v >= 1 << 63 else v


def parse_model_proto(data: bytes, name: str = "tokenizer.model") -> SentencePieceModel:
    try:
        return _parse(data)
    except (ValueError, IndexError, struct.error, UnicodeDecodeError) as e:
        raise SentencePieceModelError(f"{name}: not a valid SentencePiece model ({e})") from None


def _parse(data: bytes) -> SentencePieceModel:
    pieces: list[str] = []
    scores: list[float] = []
    types: list[int] = []
    m = SentencePieceModel(pieces, scores, types)
    for field, wt, v in _fields(data):
        if field == 1 and wt == 2:
            piece, score, typ = "", 0.0, NORMAL
            for f, w, x in _fields(v):
                if f == 1 and w == 2:
                    piece = x.decode("utf-8")
                elif f == 2 and w == 5:
                    score = struct.unpack("<f", x)[0]
                elif f == 3 and w == 0:
                    typ = x
            pieces.append(piece)
            scores.append(score)
            types.append(typ)
        elif field == 2 and wt == 2:  # TrainerSpec
            for f, w, x in _fields(v):
                if w != 0:
                    continue
                if f == 3:
                    m.model_type = x
                elif f == 24:
                    m.treat_whitespace_as_suffix = bool(x)
                elif f == 35:
                    m.byte_fallback = bool(x)
                elif f == 40:
                    m.unk_id = _int32(x)
                elif f == 41:
                    m.bos_id = _int32(x)
                elif f == 42:
                    m.eos_id = _int32(x)
                elif f == 43:
                    m.pad_id = _int32(x)
        elif field == 3 and wt == 2:  # NormalizerSpec
            for f, w, x in _fields(v):
                if f == 1 and w == 2:
                    m.normalizer_name = x.decode("utf-8")
                elif f == 2 and w == 2:
                    m.precompiled_charsmap = bytes(x)
                elif f == 3 and w == 0:
                    m.add_dummy_prefix = bool(x)
                elif f == 4 and w == 0:
                    m.remove_extra_whitespaces = bool(x)
                elif f == 5 and w == 0:
                    m.escape_whitespaces = bool(x)
    if not pieces:
        raise ValueError("no pieces")
    return m


def load_model(path: str | os.PathLike) -> SentencePieceModel:
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise SentencePieceModelError(f"{path}: cannot read ({e.strerror or e})") from None
    return parse_model_proto(data, path)


# -- conversion -----------------------------------------------------------------------------------
def bpe_merges_from_scores(pieces: list[str], scores, mergeable) -> list[tuple[str, str]]:
    """Merges that make a tokenizers BPE model behave like SentencePiece's score-driven BPE:
    SentencePiece repeatedly joins the adjacent pair whose joined piece has the highest score, so
    every split of a mergeable piece into two vocabulary pieces becomes a merge ranked by the
    joined piece's score (ties: lower piece id first, then shorter left part)."""
    vocab = {p: i for i, p in enumerate(pieces)}
    ranked = []
    for i, p in enumerate(pieces):
        if not mergeable[i] or len(p) < 2:
            continue
        for k in range(1, len(p)):
            left, right = p[:k], p[k:]
            li, ri = vocab.get(left), vocab.get(right)
            if li is not None and ri is not None and mergeable[li] and mergeable[ri]:
                ranked.append((-float(scores[i]), i, k, left, right))
    ranked.sort(key=lambda t: (t[0], t[1], t[2]))
    return [(left, right) for _, _, _, left, right in ranked]


def to_tokenizers(m: SentencePieceModel):
    """Build a ``tokenizers.Tokenizer`` equivalent to the SentencePiece model (the way Hugging
    Face's slow-to-fast converters do for Llama-style models), with unknown/control pieces
    registered as special tokens and user-defined pieces as added (non-special) tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    pieces, types = m.pieces, m.types
    unk = pieces[m.unk_id] if 0 <= m.unk_id < len(pieces) else None
    if m.model_type == BPE:
        mergeable = [t in (NORMAL, USER_DEFINED) for t in types]
        merges = bpe_merges_from_scores(pieces, m.scores, mergeable)
        model = models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=merges, unk_token=unk,
                           fuse_unk=True, byte_fallback=m.byte_fallback)
    elif m.model_type == UNIGRAM:
        model = models.Unigram([(p, float(s)) for p, s in zip(pieces, m.scores)],
                               unk_id=m.unk_id if unk is not None else None, byte_fallback=m.byte_fallback)
    else:
        raise SentencePieceModelError(f"SentencePiece model type {m.model_type} (word/char) is not supported")
    tok = Tokenizer(model)

    space = "\u2581" if m.escape_whitespaces else " "
    norm = []
    if m.precompiled_charsmap:
        pc = normalizers.Precompiled(m.precompiled_charsmap)
        # tokenizers maps whole grapheme clusters; "\r\n" is one, and would lose its "\n" where
        # SentencePiece maps the two characters one by one
        crlf = pc.normalize_str("\r") + pc.normalize_str("\n")
        if pc.normalize_str("\r\n") != crlf:
            norm.append(normalizers.Replace("\r\n", crlf))
        norm.append(pc)
    if m.remove_extra_whitespaces:
        # SentencePiece collapses runs of spaces and drops leading/trailing ones (spaces only)
        norm += [normalizers.Replace(Regex(" {2,}"), " "), normalizers.Replace(Regex(r"\A | \z"), "")]
    if m.add_dummy_prefix and not m.treat_whitespace_as_suffix:
        norm.append(normalizers.Prepend(space))
    if m.escape_whitespaces:
        norm.append(normalizers.Replace(" ", "\u2581"))
    if norm:
        tok.normalizer = normalizers.Sequence(norm)
    if m.model_type == UNIGRAM:
        # Unigram works on whitespace-delimited words (SentencePiece's split_by_whitespace)
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never", split=True)
    dec = []
    if m.escape_whitespaces:
        dec.append(decoders.Replace("\u2581", " "))
    if m.byte_fallback:
        dec.append(decoders.ByteFallback())
    dec.append(decoders.Fuse())
    if m.add_dummy_prefix and not m.treat_whitespace_as_suffix:
        dec.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(dec)

    special = [AddedToken(p, special=True, normalized=False) for p, t in zip(pieces, types) if t in (UNKNOWN, CONTROL)]
    user = [AddedToken(p, special=False, normalized=False) for p, t in zip(pieces, types) if t == USER_DEFINED]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    return tok
