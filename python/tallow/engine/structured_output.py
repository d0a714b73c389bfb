"""Structured output (guided decoding) with llguidance: a request's JSON schema, regex, choice list or
grammar becomes an LLMatcher over the model's token bytes; before each step that samples such a
request the engine core computes the matcher's next-token bitmask ([B, ceil(V / 32)] int32, a row
of -1 for unconstrained requests), the sampler applies it on the device (ops.apply_token_bitmask_),
and the sampled token advances the matcher. When the grammar is complete only EOS is allowed, so
the request ends with finish_reason "stop".

The core computes the mask for step n+1 while the device runs step n+1's forward pass: the model
runner launches the forward, then asks the core for the mask (core.py reads the previous step's
tokens back there, advancing the matchers), then launches the sampler with it.

Grammars are compiled off the step loop (a thread; llguidance drops the GIL); a request waits for
its matcher before it is scheduled. The API process compiles each grammar once against the same
tokenizer first, so a bad schema or regex is a 400 before anything is queued."""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import logging
import re
import threading
import time
from typing import Any, Optional, Union

import numpy as np

log = logging.getLogger("tallow.engine")

# JSON whitespace between tokens: any, but at most this much in one place, so a small model cannot
# fill its whole budget with blanks inside an object (llguidance's default is unbounded).
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,24}"
COMPILE_THREADS = 2
GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped)


@dataclasses.dataclass
class StructuredOutputsParams:
    """Exactly one constraint on a request's output (vLLM's StructuredOutputsParams): a JSON schema
    (dict or string), any JSON object, a regex, one of a list of strings, a grammar (Lark, or GBNF as
    llama.cpp writes it) or a Lark grammar in llguidance's dialect (%json{...} embeds a schema)."""

    json: Optional[Union[dict, str]] = None
    json_object: bool = False
    regex: Optional[str] = None
    choice: Optional[list] = None
    grammar: Optional[str] = None
    lark: Optional[str] = None

    def __post_init__(self) -> None:
        kinds = self.kinds()
        if len(kinds) != 1:
            raise ValueError("structured output needs exactly one of json, json_object, regex, choice, grammar; got "
                             + (", ".join(kinds) if kinds else "none"))
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured output json must be a JSON schema (object or string), got "
                             f"{type(self.json).__name__}")
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured output choice must be a non-empty list of strings")
        for name in ("regex", "grammar", "lark"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured output {name} must be a non-empty string")

    def kinds(self) -> list[str]:
        return [k for k in ("json", "regex", "choice", "grammar", "lark") if getattr(self, k) is not None] + (
            ["json_object"] if self.json_object else [])

    def to_dict(self) -> dict:
        """Plain data for the engine-core message."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v not in (None, False)}

    def llguidance_grammar(self) -> str:
        """The grammar in llguidance's serialized form (no tokenizer needed); ValueError when a JSON
        schema is not JSON."""
        import llguidance as llg

        if self.json is not None or self.json_object:
            schema = self.json if self.json is not None else {"type": "object"}
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
            return llg.LLMatcher.grammar_from_json_schema(with_whitespace_bound(schema))
        if self.regex is not None:
            return llg.LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(lark_literal(c) for c in self.choice))
        if self.lark is not None:
            return llg.LLMatcher.grammar_from_lark(self.lark)
        return llg.grammar_from("grammar", self.grammar)  # Lark or GBNF


def with_whitespace_bound(schema: dict) -> dict:
    """The schema with JSON_WHITESPACE as its whitespace (unless it sets its own x-guidance)."""
    if "x-guidance" in schema:
        return schema
    return {**schema, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}


def lark_literal(text: str) -> str:
    """A Lark string literal for text."""
    return json.dumps(text, ensure_ascii=False)


def as_params(v: Any) -> Optional[StructuredOutputsParams]:
    """A StructuredOutputsParams from itself or its to_dict() form (the engine-core message)."""
    if v is None or isinstance(v, StructuredOutputsParams):
        return v
    if isinstance(v, dict):
        return StructuredOutputsParams(**v)
    raise ValueError(f"structured_outputs must be StructuredOutputsParams or a dict, got {type(v).__name__}")


# -- the model's tokens as bytes ---------------------------------------------------------------------
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def token_bytes(tokenizer, vocab_size: int) -> tuple[list[bytes], list[int]]:
    """(bytes of each token id below vocab_size, special token ids): byte-level vocabularies from the
    detokenizer's table, SentencePiece ones from their pieces (U+2581 is a space, <0xNN> a byte).
    Ids past the tokenizer's vocabulary (padded embedding rows) are empty: never allowed."""
    from tallow.tokenizer.byte_level import byte_table

    table = byte_table(tokenizer)
    if table is not None:
        pieces, special = list(table.pieces), set(table.special)
    else:
        n = len(tokenizer)
        pieces, special = [], set()
        for i in range(n):
            piece = tokenizer.id_to_piece(i) or ""
            m = _BYTE_PIECE.match(piece)
            if m:  # a byte-fallback piece (some vocabularies mark these special too)
                pieces.append(bytes([int(m.group(1), 16)]))
            elif tokenizer.is_special(i):
                special.add(i)
                pieces.append(b"")
            else:
                pieces.append(piece.replace("\u2581", " ").encode("utf-8"))
    pieces = pieces[:vocab_size] + [b""] * max(0, vocab_size - len(pieces))
    return pieces, sorted(t for t in special if t < vocab_size)


class _TokenizerView:
    """What llguidance.TokenizerWrapper reads from a tokenizer. SentencePiece vocabularies prepend a
    space to the text they encode (the dummy prefix); llguidance needs text encoded as it continues
    a sequence, so there the text is encoded after a newline (a byte piece that merges with nothing)
    and the newline's tokens are dropped."""

    def __init__(self, tokenizer, pieces: list[bytes], special: list[int], eos: int, byte_level: bool):
        self._tok = tokenizer
        self.tokens = pieces
        self.special_token_ids = special
        self.eos_token_id = eos
        self.bos_token_id = tokenizer.bos_token_id
        self._lead = 0 if byte_level else len(tokenizer.encode("\n", add_special_tokens=False))

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        if not self._lead:
            return self._tok.encode(text, add_special_tokens=False)
        return self._tok.encode("\n" + text, add_special_tokens=False)[self._lead:]


def ll_tokenizer(tokenizer, vocab_size: int, eos_ids) -> Any:
    """The llguidance LLTokenizer of this tokenizer and model width (cached on the tokenizer)."""
    import llguidance as llg

    eos = sorted(int(e) for e in eos_ids if 0 <= int(e) < vocab_size)
    key = (vocab_size, tuple(eos))
    cache = tokenizer.__dict__.setdefault("_tallow_ll_tokenizers", {})
    if key not in cache:
        pieces, special = token_bytes(tokenizer, vocab_size)
        first = eos[0] if eos else (tokenizer.eos_token_id or 0)
        from tallow.tokenizer.byte_level import byte_table

        view = _TokenizerView(tokenizer, pieces, special, first, byte_table(tokenizer) is not None)
        cache[key] = llg.LLTokenizer(llg.TokenizerWrapper(view), n_vocab=vocab_size, eos_token=eos or None)
    return cache[key]


def _first_line(msg: str) -> str:
    return (msg.strip().splitlines() or [""])[0][:500]


class CompiledGrammars:
    """Compiled grammars by their llguidance text, in threads; the least recently used are dropped past
    GRAMMAR_CACHE_SIZE. A constraint sent again (agents send the same schema with every call) costs a
    copy of a pristine matcher, not a compile; copies also start with the lexer states its first
    compile built. Invalid grammars are kept too: the same ValueError again, at once."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(set(eos_ids))
        self._templates: collections.OrderedDict[str, concurrent.futures.Future] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None

    def matcher(self, so: StructuredOutputsParams) -> concurrent.futures.Future:
        """A future of a fresh LLMatcher for so (ValueError when the grammar is invalid)."""
        key = so.llguidance_grammar()
        with self._lock:
            template = self._templates.get(key)
            if template is None:
                if self._pool is None:
                    self._pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS,
                                                                       thread_name_prefix="tallow-grammar")
                template = self._templates[key] = self._pool.submit(self._compile, key, so.kinds()[0])
                while len(self._templates) > GRAMMAR_CACHE_SIZE:
                    self._templates.popitem(last=False)
            else:
                self._templates.move_to_end(key)
        out: concurrent.futures.Future = concurrent.futures.Future()

        def copy(done: concurrent.futures.Future) -> None:
            try:
                out.set_result(done.result().deep_copy())
            except Exception as e:  # noqa: BLE001 - handed to the caller
                out.set_exception(e)
        template.add_done_callback(copy)
        return out

    def _compile(self, grammar: str, kind: str):
        import llguidance as llg

        m = llg.LLMatcher(ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_ids), grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"invalid {kind} constraint: {_first_line(m.get_error())}")
        return m

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


# -- the engine core's side ---------------------------------------------------------------------------
class GrammarSet:
    """The matchers of the core's constrained requests: compiled in threads (CompiledGrammars), masks
    filled in parallel by llguidance's executor (GIL released), advanced by each sampled token."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        self.eos_ids = set(eos_ids)
        self.words = (vocab_size + 31) // 32
        self.compiled = CompiledGrammars(tokenizer, vocab_size, eos_ids)
        self.matchers: dict[str, Any] = {}
        self.mask_s = self.consume_s = 0.0  # host seconds spent filling masks and advancing matchers
        self._executor = None

    def compile(self, so: StructuredOutputsParams) -> concurrent.futures.Future:
        return self.compiled.matcher(so)

    def add(self, req_id: str, matcher) -> None:
        self.matchers[req_id] = matcher

    def release(self, req_id: str) -> None:
        self.matchers.pop(req_id, None)

    def consume(self, req_id: str, token: int) -> Optional[str]:
        """Advance req_id's matcher by token: None (go on), "stop" (EOS after a complete grammar) or
        an error message (the token broke it: the request must end). A grammar that completes on an
        ordinary token leaves only EOS allowed, so the text of that token is kept and the request
        ends on the next step, as on any EOS."""
        m = self.matchers.get(req_id)
        if m is None:
            return None
        t0 = time.perf_counter()
        try:
            if not m.consume_token(int(token)) or m.is_error():
                return _first_line(m.get_error()) or f"token {token} does not satisfy the grammar"
            return "stop" if m.is_stopped() and int(token) in self.eos_ids else None
        finally:
            self.consume_s += time.perf_counter() - t0

    def bitmask(self, req_ids: list[str]) -> Optional[np.ndarray]:
        """[len(req_ids), words] int32: each constrained request's next-token mask, -1 rows for the
        others; None when none is constrained."""
        rows = [(m, i) for i, rid in enumerate(req_ids) if (m := self.matchers.get(rid)) is not None]
        if not rows:
            return None
        import llguidance as llg

        if self._executor is None:
            self._executor = llg.LLExecutor()
        t0 = time.perf_counter()
        mask = np.full((len(req_ids), self.words), -1, dtype=np.int32)
        self._executor.unsafe_compute_mask_ptr(rows, mask.ctypes.data, self.words * 4, len(req_ids))
        self.mask_s += time.perf_counter() - t0
        return mask

    def shutdown(self) -> None:
        self.compiled.shutdown()
