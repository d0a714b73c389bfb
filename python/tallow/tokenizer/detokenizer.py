"""Streaming detokenization: token ids in, text deltas out.

``IncrementalDetokenizer`` decodes a sliding window of tokens (as vLLM's detokenize_incrementally
does with its prefix/read offsets): each step decodes ``ids[prefix:read]`` (text already emitted)
and ``ids[prefix:]`` and emits the difference. Decoding a window rather than single tokens keeps
the decoder's context, so a SentencePiece piece "▁world" becomes " world" after earlier text but
the very first piece of a text loses its leading space, exactly as a full ``decode`` does.

Guarantees:
- Only complete UTF-8 is emitted: while the decoded window ends in U+FFFD (an incomplete byte-level
  or byte-fallback sequence) nothing is emitted. A U+FFFD reaches the output only where the stream
  really is invalid, and a trailing one only from ``finish()``.
- Without a prompt, the concatenation of all deltas (``add`` ... ``finish``) equals
  ``tokenizer.decode(output_ids, skip_special_tokens)`` exactly. With ``prompt_ids`` it equals
  ``decode(prompt + output)[len(decode(prompt)):]`` (what the output adds to the prompt's text,
  so the first output token keeps its leading space), whenever ``decode(prompt)`` is a prefix of
  ``decode(prompt + output)``.

One cost of exactness: the ``tokenizers`` ByteFallback decoder turns a whole run of consecutive
``<0xXX>`` tokens into U+FFFDs if any part of the run is invalid UTF-8, so a later byte token can
change how earlier, complete characters of the same run decode. Text from a run of byte-fallback
tokens is therefore held until the run ends (the next kept non-byte token, or ``finish()``;
special tokens that decode skips do not end a run).
"""
from __future__ import annotations

from typing import Iterable

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 6  # prompt tokens decoded along with the output, for context


def byte_fallback_ids(tokenizer) -> frozenset[int]:
    """Ids of ``<0xXX>`` pieces that the tokenizer's decoder turns into raw bytes (empty when its
    decoder has no byte fallback). Cached on the tokenizer."""
    cached = getattr(tokenizer, "_tallow_byte_fallback_ids", None)
    if cached is not None:
        return cached
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    ids: frozenset[int] = frozenset()
    probe = backend.token_to_id("<0x41>")
    if probe is not None and backend.decode([probe], skip_special_tokens=False) == "A":
        found = (backend.token_to_id(f"<0x{b:02X}>") for b in range(256))
        ids = frozenset(i for i in found if i is not None)
    try:
        tokenizer._tallow_byte_fallback_ids = ids
    except AttributeError:
        pass
    return ids


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class IncrementalDetokenizer:
    """``add(token_id)`` returns the new text (possibly ""), ``finish()`` the rest."""

    def __init__(self, tokenizer, prompt_ids: Iterable[int] | None = None, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = [int(i) for i in (prompt_ids or ())]
        self.num_prompt_ids = len(self.ids)
        self.text = ""  # everything emitted so far
        self._bytes = byte_fallback_ids(tokenizer)
        is_special = getattr(tokenizer, "is_special", None)
        if is_special is None:  # a bare tokenizers.Tokenizer
            specials = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
            is_special = specials.__contains__
        self._is_special = is_special
        n = len(self.ids)
        self._read = n
        self._prefix = self._anchor(max(0, n - _PROMPT_CONTEXT), n)
        self._finished = False
        self._in_run = False  # the last kept token is a byte-fallback piece
        for t in reversed(self.ids):
            if not self._skipped(t):
                self._in_run = t in self._bytes
                break

    @property
    def output_ids(self) -> list[int]:
        return self.ids[self.num_prompt_ids:]

    def _skipped(self, token_id: int) -> bool:
        return self.skip_special_tokens and self._is_special(token_id)

    def _anchor(self, start: int, end: int) -> int:
        """A window start at or before ``start`` whose first token that decode keeps lies in
        ``ids[:end]`` and is not a byte-fallback piece. Decoders treat the first kept token of a
        text specially (a SentencePiece leading space is dropped), so it must be the same token in
        both decodes of a step; and a byte-fallback run must not be cut by the window start, since
        the run decodes as a whole (skipped special tokens between byte pieces do not end a run)."""
        p = start
        while p < end and self._skipped(self.ids[p]):
            p += 1
        if p < end and self.ids[p] not in self._bytes:
            return start
        p = start
        while p > 0:
            p -= 1
            t = self.ids[p]
            if not self._skipped(t) and t not in self._bytes:
                return p
        return 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _step(self, final: bool) -> str:
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        new_text = self._decode(self.ids[self._prefix:])
        if not final and new_text.endswith(_REPLACEMENT):
            return ""  # an incomplete UTF-8 sequence: wait for the rest
        if new_text.startswith(prefix_text):
            delta = new_text[len(prefix_text):]
        else:  # only when the window starts inside a byte sequence the output completes
            delta = new_text[_common_prefix_len(prefix_text, new_text):]
        end = len(self.ids)
        self._prefix = self._anchor(self._read, end)
        self._read = end
        self.text += delta
        return delta

    def add(self, token_id: int) -> str:
        """Append one generated token; returns the text it completes (often "")."""
        if self._finished:
            raise RuntimeError("IncrementalDetokenizer.add() after finish()")
        token_id = int(token_id)
        self.ids.append(token_id)
        if token_id in self._bytes:
            self._in_run = True
            return ""  # a byte-fallback run is decoded as a whole: wait for its end
        if self._in_run and self._skipped(token_id):
            return ""  # skipped tokens do not end a run (decode drops them before joining bytes)
        self._in_run = False
        return self._step(final=False)

    def add_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.add(t) for t in token_ids)

    def finish(self) -> str:
        """Flush what is held back (an unfinished byte sequence decodes to U+FFFD)."""
        if self._finished:
            return ""
        self._finished = True
        if self._read == len(self.ids):
            return ""
        return self._step(final=True)


def detokenizer_for(tokenizer, prompt_ids: Iterable[int] | None = None, skip_special_tokens: bool = True):
    """The fastest detokenizer that is exact for this tokenizer: a ``ByteLevelDetokenizer`` (a table
    lookup a token) for byte-level BPE vocabularies, else an ``IncrementalDetokenizer``."""
    from tallow.tokenizer.byte_level import ByteLevelDetokenizer, byte_table

    table = byte_table(tokenizer)
    if table is not None:
        return ByteLevelDetokenizer(tokenizer, table, prompt_ids, skip_special_tokens)
    return IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
