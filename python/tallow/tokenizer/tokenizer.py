"""The tokenizer the engine uses: a ``tokenizers.Tokenizer`` plus special-token ids, BOS/EOS
handling, end-of-generation ids and the chat template.

Sources:
- a Hugging Face model folder (``Tokenizer.from_pretrained_dir``): tokenizer.json, or else a
  SentencePiece tokenizer.model (converted without the sentencepiece package); tokenizer_config.json
  (add_bos_token/add_eos_token, special tokens, chat_template), special_tokens_map.json,
  generation_config.json (eos_token_id, possibly a list), chat_template.jinja;
- a GGUF file (``Tokenizer.from_gguf``): the vocabulary in its metadata (see gguf_vocab.py).
"""
from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Iterable, Sequence

from tallow.tokenizer import gguf_vocab, sentencepiece_model


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or used; the message names the file and the problem."""


def _read_json(path: pathlib.Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        with open(path, encoding="utf-8") as f:
            v = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: cannot read JSON ({e})") from None
    if not isinstance(v, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return v


def _token_content(v: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as serialized AddedTokens."""
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def _id_list(v: Any) -> list[int]:
    if v is None:
        return []
    if isinstance(v, int) and not isinstance(v, bool):
        return [v]
    if isinstance(v, (list, tuple)):
        return [int(x) for x in v if isinstance(x, int) and not isinstance(x, bool)]
    return []


class Tokenizer:
    """Text <-> token ids for one model.

    ``encode(text)`` parses special-token text (e.g. ``<|im_start|>``) into its id, as Hugging Face
    tokenizers do, and adds BOS/EOS when ``add_special_tokens`` and the model asks for them.
    ``decode(ids)`` is the ``tokenizers`` decode (byte-level and byte-fallback pieces joined into
    UTF-8, SentencePiece's leading space of the text dropped)."""

    def __init__(self, tokenizer, *, bos_token_id: int | None = None, eos_token_id: int | None = None,
                 eos_token_ids: Iterable[int] = (), pad_token_id: int | None = None, unk_token_id: int | None = None,
                 add_bos: bool | None = None, add_eos: bool | None = None, chat_template: str | None = None,
                 chat_templates: dict[str, str] | None = None, name: str | None = None):
        self._tk = tokenizer
        self.name = name
        self.gguf_vocab_type: str | None = None  # tokenizer.ggml.model / .pre, for tokenizers from GGUF
        self.gguf_pre: str | None = None
        n = tokenizer.get_vocab_size(with_added_tokens=True)

        def ok(i):
            return i if i is not None and 0 <= int(i) < n else None

        self.bos_token_id = ok(bos_token_id)
        self.eos_token_id = ok(eos_token_id)
        self.pad_token_id = ok(pad_token_id)
        self.unk_token_id = ok(unk_token_id)
        self.eos_token_ids: set[int] = {int(i) for i in eos_token_ids if ok(i) is not None}
        if self.eos_token_id is not None:
            self.eos_token_ids.add(self.eos_token_id)
        elif self.eos_token_ids:
            self.eos_token_id = min(self.eos_token_ids)
        if add_bos is not None or add_eos is not None:
            self._set_bos_eos(add_bos, add_eos)
        self.chat_templates: dict[str, str] = dict(chat_templates or {})
        if chat_template is None:
            chat_template = self.chat_templates.get("default")
        self.chat_template: str | None = chat_template
        self._refresh_special()

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as HFTokenizer

        d = pathlib.Path(path)
        if not d.is_dir():
            raise TokenizerError(f"{d}: not a directory")
        cfg = _read_json(d / "tokenizer_config.json") or {}
        stm = _read_json(d / "special_tokens_map.json") or {}
        tj, sp_path = d / "tokenizer.json", d / "tokenizer.model"
        sp = None
        if tj.is_file():
            try:
                tk = HFTokenizer.from_file(str(tj))
            except Exception as e:  # tokenizers raises plain Exception on bad JSON or unknown types
                raise TokenizerError(f"{tj}: cannot load tokenizer ({e})") from None
        elif sp_path.is_file():
            sp = sentencepiece_model.load_model(sp_path)
            tk = sentencepiece_model.to_tokenizers(sp)
            added = cfg.get("added_tokens_decoder") or {}
            try:
                order = sorted(added, key=int)
            except (TypeError, ValueError):
                raise TokenizerError(f"{d / 'tokenizer_config.json'}: added_tokens_decoder keys must be token ids") from None
            for k in order:
                a = added[k]
                content = _token_content(a)
                if not isinstance(a, dict) or content is None or tk.token_to_id(content) is not None:
                    continue
                at = AddedToken(content, single_word=bool(a.get("single_word", False)), lstrip=bool(a.get("lstrip", False)),
                                rstrip=bool(a.get("rstrip", False)), normalized=bool(a.get("normalized", False)),
                                special=bool(a.get("special", False)))
                (tk.add_special_tokens if at.special else tk.add_tokens)([at])
                if tk.token_to_id(content) != int(k):
                    raise TokenizerError(f"{d / 'tokenizer_config.json'}: added token {content!r} should have id {k} "
                                         f"but the vocabulary puts it at {tk.token_to_id(content)}")
        else:
            raise TokenizerError(f"{d}: no tokenizer.json or tokenizer.model")

        extra = cfg.get("additional_special_tokens") or stm.get("additional_special_tokens") or []
        missing = [c for c in map(_token_content, extra) if c is not None and tk.token_to_id(c) is None]
        if missing:
            tk.add_special_tokens([AddedToken(c, special=True, normalized=False) for c in missing])

        def special_id(key: str, sp_default: int | None = None) -> int | None:
            content = _token_content(cfg.get(key))
            if content is None:
                content = _token_content(stm.get(key))
            if content is not None:
                i = tk.token_to_id(content)
                if i is None and key in ("bos_token", "eos_token"):
                    raise TokenizerError(f"{d}: {key} {content!r} is not in the vocabulary")
                return i
            if sp is not None and sp_default is not None and 0 <= sp_default < len(sp):
                return sp_default
            return None

        bos = special_id("bos_token", sp.bos_id if sp else None)
        eos = special_id("eos_token", sp.eos_id if sp else None)
        pad = special_id("pad_token", sp.pad_id if sp else None)
        unk = special_id("unk_token", sp.unk_id if sp else None)

        gen = _read_json(d / "generation_config.json")
        if gen is not None and "eos_token_id" in gen:
            eos_ids = _id_list(gen.get("eos_token_id"))
        else:
            eos_ids = _id_list((_read_json(d / "config.json") or {}).get("eos_token_id"))
        if eos is None and eos_ids:
            eos = eos_ids[0]
        if bos is None and gen is not None and _id_list(gen.get("bos_token_id")):
            bos = _id_list(gen.get("bos_token_id"))[0]

        add_bos = cfg.get("add_bos_token")
        add_eos = cfg.get("add_eos_token")
        if sp is not None:
            add_bos = True if add_bos is None else add_bos  # LlamaTokenizer's defaults
            add_eos = False if add_eos is None else add_eos
        add_bos = bool(add_bos) if isinstance(add_bos, bool) else None
        add_eos = bool(add_eos) if isinstance(add_eos, bool) else None

        template, named = cls._templates_from_dir(d, cfg)
        tok = cls(tk, bos_token_id=bos, eos_token_id=eos, eos_token_ids=eos_ids, pad_token_id=pad, unk_token_id=unk,
                  chat_template=template, chat_templates=named, name=str(d))
        # follow tokenizer_config's add_bos_token/add_eos_token where tokenizer.json's post-processor disagrees
        has_bos, has_eos = tok._adds_bos_eos()
        want_bos = has_bos if add_bos is None else add_bos
        want_eos = has_eos if add_eos is None else add_eos
        if (want_bos, want_eos) != (has_bos, has_eos):
            tok._set_bos_eos(want_bos, want_eos)
        return tok

    @staticmethod
    def _templates_from_dir(d: pathlib.Path, cfg: dict) -> tuple[str | None, dict[str, str]]:
        named: dict[str, str] = {}
        default = None
        ct = cfg.get("chat_template")
        if isinstance(ct, str):
            default = ct
        elif isinstance(ct, list):
            for item in ct:
                if isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("template"), str):
                    named[item["name"]] = item["template"]
            default = named.get("default")
        if default is None:
            cj = _read_json(d / "chat_template.json")
            if cj is not None and isinstance(cj.get("chat_template"), str):
                default = cj["chat_template"]
        jinja = d / "chat_template.jinja"
        if jinja.is_file():
            default = jinja.read_text(encoding="utf-8")
        extra = d / "additional_chat_templates"
        if extra.is_dir():
            for f in sorted(extra.glob("*.jinja")):
                named.setdefault(f.stem, f.read_text(encoding="utf-8"))
        if default is not None:
            named.setdefault("default", default)
        return default, named

    @classmethod
    def from_gguf(cls, g) -> "Tokenizer":
        """From a GGUFFile (or a path to a .gguf file)."""
        if isinstance(g, (str, os.PathLike)):
            from tallow.loader.gguf_reader import GGUFFile

            g = GGUFFile(g)
        try:
            v = gguf_vocab.vocab_from_gguf(g)
        except gguf_vocab.GGUFVocabError as e:
            raise TokenizerError(str(e)) from None
        tok = cls(v.tokenizer, bos_token_id=v.bos_token_id, eos_token_id=v.eos_token_id, eos_token_ids=v.eog_token_ids,
                  pad_token_id=v.pad_token_id, unk_token_id=v.unk_token_id, chat_template=v.chat_template,
                  chat_templates=v.chat_templates, name=getattr(g, "path", None))
        tok.gguf_vocab_type, tok.gguf_pre = v.model, v.pre
        return tok

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Tokenizer":
        """A model folder, a tokenizer.json, a tokenizer.model or a .gguf file."""
        p = pathlib.Path(path)
        if p.is_dir():
            return cls.from_pretrained_dir(p)
        if not p.exists():
            raise TokenizerError(f"{p}: no such file or directory")
        if p.suffix == ".gguf":
            return cls.from_gguf(p)
        if p.name.endswith(".json") or p.suffix == ".model":
            d = p.parent
            if p.name in ("tokenizer.json", "tokenizer.model"):
                return cls.from_pretrained_dir(d)
        raise TokenizerError(f"{p}: not a tokenizer (expected a model folder, tokenizer.json, tokenizer.model or .gguf)")

    # -- BOS/EOS ------------------------------------------------------------------------------
    def _adds_bos_eos(self) -> tuple[bool, bool]:
        """Whether encode(..., add_special_tokens=True) puts BOS in front / EOS at the end."""
        w = self._tk.encode("a", add_special_tokens=True).ids
        p = self._tk.encode("a", add_special_tokens=False).ids
        extra = len(w) > len(p)
        has_bos = extra and self.bos_token_id is not None and w[0] == self.bos_token_id and w[1:1 + len(p)] == p
        has_eos = extra and self.eos_token_id is not None and w[-1] == self.eos_token_id and w[-1 - len(p):-1] == p
        return has_bos, has_eos

    def _set_bos_eos(self, add_bos: bool | None, add_eos: bool | None) -> None:
        bos = self.bos_token_id if add_bos else None
        eos = self.eos_token_id if add_eos else None
        self._tk.post_processor = gguf_vocab.template_processor(self._tk, bos, eos)

    @property
    def add_bos_token(self) -> bool:
        return self._adds_bos_eos()[0]

    @property
    def add_eos_token(self) -> bool:
        return self._adds_bos_eos()[1]

    def _refresh_special(self) -> None:
        """Recompute what depends on the added tokens (call after changing ``backend_tokenizer``)."""
        self._n = self._tk.get_vocab_size(with_added_tokens=True)  # slow in tokenizers: cached
        dec = self._tk.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, t in dec.items() if t.special)
        # Non-special added tokens that the decoder would garble: a byte-level decoder reads the
        # characters of e.g. DeepSeek's added token "ü" as GPT-2 byte symbols (one invalid byte).
        # They decode to their own text instead, as llama.cpp does for user-defined tokens.
        self._raw_added: dict[int, str] = {}
        self.__dict__.pop("_tallow_byte_table", None)  # byte_level.byte_table's cache
        decoder = self._tk.decoder
        if decoder is not None:
            for i, t in dec.items():
                if t.special or "\ufffd" in t.content:
                    continue
                try:
                    garbled = "\ufffd" in decoder.decode([t.content])
                except Exception:
                    garbled = False
                if garbled:
                    self._raw_added[i] = t.content

    # -- the API ------------------------------------------------------------------------------
    @property
    def backend_tokenizer(self):
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tk

    @property
    def raw_added_tokens(self) -> dict[int, str]:
        """Added tokens that ``decode`` gives as their own text rather than through the decoder."""
        return self._raw_added

    @property
    def vocab_size(self) -> int:
        return self._n

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, not {type(text).__name__}")
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._tk.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if ids and (min(ids) < 0 or max(ids) >= self._n):
            bad = next(i for i in ids if not 0 <= i < self._n)
            raise ValueError(f"token id {bad} is out of range for a vocabulary of {self._n}")
        if not self._raw_added or self._raw_added.keys().isdisjoint(ids):
            return self._tk.decode(ids, skip_special_tokens=skip_special_tokens)
        parts, seg = [], []
        for i in ids:
            raw = self._raw_added.get(i)
            if raw is None:
                seg.append(i)
                continue
            if seg:
                parts.append(self._tk.decode(seg, skip_special_tokens=skip_special_tokens))
                seg = []
            parts.append(raw)
        if seg:
            parts.append(self._tk.decode(seg, skip_special_tokens=skip_special_tokens))
        return "".join(parts)

    def convert_ids_to_tokens(self, ids: int | Iterable[int]):
        if isinstance(ids, int):
            return self._tk.id_to_token(ids)
        return [self._tk.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]):
        if isinstance(tokens, str):
            return self._tk.token_to_id(tokens)
        return [self._tk.token_to_id(t) for t in tokens]

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary entry of a token as stored (e.g. ``"▁Hello"``, ``"ĠHello"``, ``"<0x0A>"``)."""
        p = self._tk.id_to_token(int(token_id))
        if p is None:
            raise ValueError(f"token id {token_id} is out of range for a vocabulary of {self.vocab_size}")
        return p

    def piece_to_id(self, piece: str) -> int | None:
        return self._tk.token_to_id(piece)

    def get_vocab(self) -> dict[str, int]:
        return self._tk.get_vocab(with_added_tokens=True)

    def is_special(self, token_id: int) -> bool:
        """True for tokens that ``decode(skip_special_tokens=True)`` leaves out."""
        return token_id in self._special_ids

    @property
    def all_special_ids(self) -> list[int]:
        ids = set(self._special_ids)
        for i in (self.bos_token_id, self.eos_token_id, self.unk_token_id, self.pad_token_id):
            if i is not None:
                ids.add(i)
        return sorted(ids)

    @property
    def all_special_tokens(self) -> list[str]:
        return [self._tk.id_to_token(i) for i in self.all_special_ids]

    def _tok(self, i: int | None) -> str | None:
        return None if i is None else self._tk.id_to_token(i)

    @property
    def bos_token(self) -> str | None:
        return self._tok(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self._tok(self.eos_token_id)

    @property
    def pad_token(self) -> str | None:
        return self._tok(self.pad_token_id)

    @property
    def unk_token(self) -> str | None:
        return self._tok(self.unk_token_id)

    # -- chat ---------------------------------------------------------------------------------
    def get_chat_template(self, chat_template: str | None = None, tools=None) -> str:
        """The template to render: ``chat_template`` (a template string or the name of one of the
        model's named templates), else the model's "tool_use" template when tools are given and it
        has one, else its default template."""
        if chat_template is not None:
            return self.chat_templates.get(chat_template, chat_template)
        if tools and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if self.chat_template is None:
            from tallow.tokenizer.chat_template import NoChatTemplateError

            raise NoChatTemplateError(
                f"{self.name or 'this model'} has no chat template; pass one (e.g. --chat-template FILE) "
                "or send plain completion requests")
        return self.chat_template

    def apply_chat_template(self, messages, tools=None, add_generation_prompt: bool = False, tokenize: bool = False,
                            chat_template: str | None = None, **kwargs):
        from tallow.tokenizer.chat_template import render_chat_template

        template = self.get_chat_template(chat_template, tools)
        # a token the model lacks is passed as None: left undefined in the template, as transformers does
        text = render_chat_template(template, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                    bos_token=self.bos_token, eos_token=self.eos_token, **kwargs)
        if tokenize:
            return self.encode(text, add_special_tokens=False)
        return text

    def __repr__(self) -> str:
        return (f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
                f"eos={sorted(self.eos_token_ids)})")
