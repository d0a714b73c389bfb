"""GGUF-embedded vocabularies turned into ``tokenizers.Tokenizer`` objects.

A GGUF file carries its tokenizer as metadata (llama.cpp's ``tokenizer.ggml.*`` keys):

- ``tokenizer.ggml.model``: ``gpt2`` (byte-level BPE with merges), ``llama`` (SentencePiece-style
  BPE driven by piece scores, with ``<0xXX>`` byte-fallback pieces) or ``bert`` (WordPiece).
- ``tokenizer.ggml.pre``: for ``gpt2``, which pre-tokenizer (regex split) the model was trained
  with. The regexes are the ones llama.cpp uses (src/llama-vocab.cpp) or, where llama.cpp adapted
  them for its own regex engine, the originals from the models' tokenizer.json.
- ``tokenizer.ggml.tokens`` / ``scores`` / ``token_type`` (1 normal, 2 unknown, 3 control,
  4 user-defined, 5 unused, 6 byte) / ``merges``; special token ids and add_bos/add_eos flags.

Control and unknown tokens become special added tokens (parsed in text, skipped by
``decode(skip_special_tokens=True)``); user-defined tokens become non-special added tokens (always
parsed, as llama.cpp and Hugging Face tokenizers both do).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from tallow.tokenizer.sentencepiece_model import bpe_merges_from_scores

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


class GGUFVocabError(ValueError):
    """A GGUF vocabulary that cannot be turned into a tokenizer (the message says why)."""


# -- pre-tokenizer regexes, by tokenizer.ggml.pre ---------------------------------------------------
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK_LLM = [
    r"[\r\n]",
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",  # cased letters (escaped: NFC would fold some of them)
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    r"[一-龥ࠀ-一가-퟿]+",
    r"\p{N}+",
]
_DEEPSEEK_CODER = [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"]
_DEEPSEEK_V3 = [
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
]
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"
_SEED_CODER = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_BAILING = (r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]|\s+(?!\S)|\s+")


@dataclasses.dataclass(frozen=True)
class _Pre:
    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool | None = None  # llama.cpp's default when the GGUF has no add_bos_token key
    nfc: bool = False  # the original tokenizer.json normalises to NFC (llama.cpp does not)
    falcon: bool = False  # Hugging Face's falcon pre-tokenizer sequence (see _falcon_pre)


_DEFAULT = _Pre((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_PRE: dict[str, _Pre] = {"default": _DEFAULT}


def _register(names: str, pre: _Pre) -> None:
    for n in names.split():
        _PRE[n] = pre


_register("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2",
          _Pre((_LLAMA3,), ignore_merges=True, add_bos=True))
_register("dbrx smaug-bpe", _Pre((_LLAMA3,)))
_register("glm4 chatglm-bpe", _Pre((_LLAMA3,)))
_register("deepseek-llm", _Pre(tuple(_DEEPSEEK_LLM)))
_register("deepseek-coder", _Pre(tuple(_DEEPSEEK_CODER)))
_register("deepseek-v3", _Pre(tuple(_DEEPSEEK_V3)))
_register("falcon", _Pre((), falcon=True))
_register("mpt", _Pre((_GPT2,), nfc=True))
_register("gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de jina-v1-en jina-v2-code roberta-bpe "
          "olmo jais trillion granite-docling a.x-4.0 mellum modern-bert exaone4", _Pre((_GPT2,)))
_register("starcoder refact command-r smollm codeshell exaone minerva-7b", _Pre((r"\p{N}", _GPT2)))
_register("qwen2 deepseek-r1-qwen megrez hunyuan stablelm2 kormo", _Pre((_QWEN2,), nfc=True))
_register("poro-chat bloom gpt3-finnish", _Pre((_BLOOM,)))
_register("viking", _Pre((_BLOOM, r"\p{N}")))
_register("tekken", _Pre((_TEKKEN,), ignore_merges=True, add_bos=True))
_register("gpt-4o llama4", _Pre((_GPT4O,)))
_register("seed-coder", _Pre((_SEED_CODER,)))
_register("bailingmoe bailingmoe2 llada-moe", _Pre((_BAILING,)))
_register("grok-2", _Pre((_QWEN2,)))
_register("chameleon", _Pre((r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )",
                              r"\p{N}", r"[\p{P}!-/:-@\[-`{-~]", _GPT2), add_bos=True))

SUPPORTED_PRE = tuple(sorted(_PRE))

# tokens that end generation, found by their text (as llama.cpp does for GGUFs without eot/eom keys)
_EOG_TEXTS = frozenset([
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>",
    "<|end_of_text|>", "<end_of_utterance>", "<｜end▁of▁sentence｜>",
])


@dataclasses.dataclass
class GGUFVocab:
    """A GGUF vocabulary as a ``tokenizers.Tokenizer`` plus what a runtime needs besides."""
    tokenizer: Any  # tokenizers.Tokenizer
    model: str  # tokenizer.ggml.model
    pre: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos: bool
    add_eos: bool
    eog_token_ids: set[int]
    chat_template: str | None
    chat_templates: dict[str, str]
    token_types: np.ndarray


def _meta(g) -> dict:
    return g.metadata if hasattr(g, "metadata") else g


def _name(g) -> str:
    return getattr(g, "path", "GGUF file")


def _byte_level_pre(pre: _Pre):
    from tokenizers import Regex, pre_tokenizers

    if pre.falcon:
        return _falcon_pre()
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
    return pre_tokenizers.Sequence(splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _falcon_pre():
    # tiiuae/falcon-7b's tokenizer.json; llama.cpp approximates it with three regexes
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([
        pre_tokenizers.Punctuation(behavior="contiguous"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        pre_tokenizers.Digits(individual_digits=False),
        pre_tokenizers.Split(Regex(r"[0-9][0-9][0-9]"), behavior="isolated"),
    ])


def _added_tokens(tokens: list[str], types: np.ndarray, *, rstrip_specials: bool = False):
    """Control/unknown tokens as special added tokens, user-defined ones as plain added tokens."""
    from tokenizers import AddedToken

    special, user = [], []
    no_rstrip = {"<unk>", "<s>", "<|endoftext|>"}
    for i in np.nonzero((types == CONTROL) | (types == UNKNOWN) | (types == USER_DEFINED))[0]:
        t = tokens[i]
        # Phi-3 (llama.cpp sets the same attribute by model name): added tokens eat the whitespace after them
        rstrip = rstrip_specials and t not in no_rstrip
        if types[i] == USER_DEFINED:
            user.append(AddedToken(t, special=False, normalized=False, rstrip=rstrip))
        else:
            special.append(AddedToken(t, special=True, normalized=False, rstrip=rstrip))
    return special, user


def _vocab_dict(tokens: list[str], path: str) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if not t:
            t = f"[EMPTY_{i}]"  # as llama.cpp does
            tokens[i] = t
        if t in vocab:
            raise GGUFVocabError(f"{path}: duplicate token {t!r} in vocabulary (ids {vocab[t]} and {i})")
        vocab[t] = i
    return vocab


def _build_bpe(tokens, types, md, path):
    from tokenizers import Tokenizer, decoders, models, normalizers

    pre_name = md.get("tokenizer.ggml.pre") or "default"
    pre = _PRE.get(pre_name)
    if pre is None:
        raise GGUFVocabError(f"{path}: unknown pre-tokenizer type tokenizer.ggml.pre={pre_name!r} "
                             f"(supported: {', '.join(SUPPORTED_PRE)})")
    merges_raw = md.get("tokenizer.ggml.merges")
    if merges_raw is None:
        raise GGUFVocabError(f"{path}: gpt2-style vocabulary without tokenizer.ggml.merges")
    vocab = _vocab_dict(tokens, path)
    merges = []
    for m in merges_raw:
        k = m.find(" ", 1)
        if k < 0:
            raise GGUFVocabError(f"{path}: malformed merge {m!r}")
        merges.append((m[:k], m[k + 1:]))
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges, fuse_unk=False))
    if pre.nfc:
        tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = _byte_level_pre(pre)
    tk.decoder = decoders.ByteLevel()
    return tk, pre_name, pre


def _build_spm(tokens, types, scores, md, path):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers

    vocab = _vocab_dict(tokens, path)
    if scores is None:
        scores = np.zeros(len(tokens), np.float32)
    mergeable = (types == NORMAL) | (types == USER_DEFINED)
    merges = bpe_merges_from_scores(tokens, scores, mergeable)
    unk_id = md.get("tokenizer.ggml.unknown_token_id", 0)
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    byte_fallback = bool(np.any(types == BYTE))
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=byte_fallback))
    add_space_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
    norm = []
    if md.get("tokenizer.ggml.remove_extra_whitespaces", False):
        norm += [normalizers.Replace(Regex(" {2,}"), " "), normalizers.Replace(Regex(r"\A | \z"), "")]
    if add_space_prefix:
        norm.append(normalizers.Prepend("\u2581"))
    norm.append(normalizers.Replace(" ", "\u2581"))
    tk.normalizer = normalizers.Sequence(norm)
    dec = [decoders.Replace("\u2581", " ")]
    if byte_fallback:
        dec.append(decoders.ByteFallback())
    dec.append(decoders.Fuse())
    if add_space_prefix:
        dec.append(decoders.Strip(content=" ", left=1, right=0))
    tk.decoder = decoders.Sequence(dec)
    return tk


def _build_wpm(tokens, types, md, path):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    # llama.cpp's converter stores "##piece" as "piece" and word-initial "piece" as "\u2581piece";
    # bracketed tokens ([CLS], [unused0]) are kept as they are
    orig = []
    for t in tokens:
        if t.startswith("\u2581"):
            orig.append(t[1:])
        elif t.startswith("[") and t.endswith("]"):
            orig.append(t)
        else:
            orig.append("##" + t)
    vocab = _vocab_dict(orig, path)
    unk_id = md.get("tokenizer.ggml.unknown_token_id", 100)
    unk = orig[unk_id] if unk_id is not None and 0 <= unk_id < len(orig) else "[UNK]"
    tk = Tokenizer(models.WordPiece(vocab=vocab, unk_token=unk, max_input_chars_per_word=100))
    lowercase = bool(md.get("tokenizer.ggml.normalizer.lowercase", True))
    strip_accents = bool(md.get("tokenizer.ggml.normalizer.strip_accents", lowercase))
    tk.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                               strip_accents=strip_accents, lowercase=lowercase)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return tk, orig


def _chat_templates(md) -> tuple[str | None, dict[str, str]]:
    default = md.get("tokenizer.chat_template")
    named = {}
    for n in md.get("tokenizer.chat_templates", None) or []:
        t = md.get(f"tokenizer.chat_template.{n}")
        if isinstance(t, str):
            named[n] = t
    if default is None and "default" in named:
        default = named["default"]
    return default, named


def _opt_id(md, key, default, n):
    v = md.get(key, default)
    if v is None:
        return None
    v = int(v)
    return v if 0 <= v < n else default if default is not None and 0 <= default < n else None


def vocab_from_gguf(g) -> GGUFVocab:
    """Build the tokenizer of a GGUF file (a GGUFFile or its metadata dict)."""
    from tokenizers import processors

    md, path = _meta(g), _name(g)
    model = md.get("tokenizer.ggml.model")
    if model is None:
        raise GGUFVocabError(f"{path}: no tokenizer in this GGUF (tokenizer.ggml.model is missing)")
    tokens = md.get("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFVocabError(f"{path}: no tokenizer.ggml.tokens")
    tokens = list(tokens)
    n = len(tokens)
    types = md.get("tokenizer.ggml.token_type")
    types = np.full(n, NORMAL, np.int32) if types is None else np.asarray(types, np.int32)
    if len(types) < n:
        raise GGUFVocabError(f"{path}: {len(types)} token types for {n} tokens")
    types = types[:n]
    scores = md.get("tokenizer.ggml.scores")
    if scores is not None:
        scores = np.asarray(scores, np.float32)
        if len(scores) < n:
            raise GGUFVocabError(f"{path}: {len(scores)} token scores for {n} tokens")
    pre_name = None
    name = str(md.get("general.name", "")).lower()
    rstrip = model == "llama" and ("phi-3" in name or "phi3" in name)

    if model == "gpt2":
        tk, pre_name, pre = _build_bpe(tokens, types, md, path)
        defaults = dict(bos=None, eos=None, unk=None, pad=None, add_bos=bool(pre.add_bos), add_eos=False)
        piece_tokens = tokens
    elif model == "llama":
        tk = _build_spm(tokens, types, scores, md, path)
        defaults = dict(bos=1, eos=2, unk=0, pad=None, add_bos=True, add_eos=False)
        piece_tokens = tokens
    elif model == "bert":
        tk, piece_tokens = _build_wpm(tokens, types, md, path)
        defaults = dict(bos=101, eos=None, unk=100, pad=0, add_bos=True, add_eos=False)
    else:
        raise GGUFVocabError(f"{path}: tokenizer model {model!r} is not supported (gpt2, llama and bert are)")

    special, user = _added_tokens(piece_tokens, types, rstrip_specials=rstrip)
    if special:
        tk.add_special_tokens(special)
    if user:
        tk.add_tokens(user)

    bos = _opt_id(md, "tokenizer.ggml.bos_token_id", defaults["bos"], n)
    eos = _opt_id(md, "tokenizer.ggml.eos_token_id", defaults["eos"], n)
    unk = _opt_id(md, "tokenizer.ggml.unknown_token_id", defaults["unk"], n)
    pad = _opt_id(md, "tokenizer.ggml.padding_token_id", defaults["pad"], n)
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", defaults["add_bos"]))
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", defaults["add_eos"]))
    if add_bos and bos is None:
        add_bos = False
    if add_eos and eos is None:
        add_eos = False

    if model == "bert":
        sep = _opt_id(md, "tokenizer.ggml.seperator_token_id", 102, n)
        cls = _opt_id(md, "tokenizer.ggml.cls_token_id", bos, n)
        if cls is not None and sep is not None:
            c, s = piece_tokens[cls], piece_tokens[sep]
            tk.post_processor = processors.TemplateProcessing(
                single=f"{c} $A {s}", pair=f"{c} $A {s} $B:1 {s}:1", special_tokens=[(c, cls), (s, sep)])
        add_eos = False
    else:
        tk.post_processor = template_processor(tk, bos if add_bos else None, eos if add_eos else None)

    eog = set()
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = _opt_id(md, key, None, n)
        if v is not None:
            eog.add(v)
    if eos is not None:
        eog.add(eos)
    for i, t in enumerate(piece_tokens):
        if t in _EOG_TEXTS and types[i] in (CONTROL, USER_DEFINED, UNKNOWN):
            eog.add(i)
    tpl, named = _chat_templates(md)
    return GGUFVocab(tokenizer=tk, model=model, pre=pre_name, bos_token_id=bos, eos_token_id=eos, unk_token_id=unk,
                     pad_token_id=pad, add_bos=add_bos, add_eos=add_eos, eog_token_ids=eog, chat_template=tpl,
                     chat_templates=named, token_types=types)


def template_processor(tk, bos_id: int | None, eos_id: int | None):
    """A post-processor adding BOS and/or EOS (None when neither is added)."""
    from tokenizers import processors

    if bos_id is None and eos_id is None:
        return None
    b = tk.id_to_token(bos_id) if bos_id is not None else None
    e = tk.id_to_token(eos_id) if eos_id is not None else None
    # the template names the tokens by aliases: token texts may contain spaces or ":"
    single = (["BOS:0"] if b else []) + ["$A:0"] + (["EOS:0"] if e else [])
    pair = single + (["BOS:1"] if b else []) + ["$B:1"] + (["EOS:1"] if e else [])
    specials = []
    if b:
        specials.append({"id": "BOS", "ids": [bos_id], "tokens": [b]})
    if e:
        specials.append({"id": "EOS", "ids": [eos_id], "tokens": [e]})
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
