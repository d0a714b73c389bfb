"""Reasoning models: ``<think>...</think>`` split from the reply, whole or while streaming.

The model's text (or the prompt, when the chat template already opened ``<think>`` as DeepSeek-R1's
does) starts a reasoning part; everything up to ``</think>`` is ``reasoning_content`` and the rest
is ``content`` (its leading blank lines dropped). Without a ``<think>`` at the start the reply is
all content. A reply cut off inside the reasoning (e.g. by max_tokens) is all reasoning.
"""
from __future__ import annotations

from typing import Optional

START, END = "<think>", "</think>"


def uses_reasoning(chat_template: Optional[str]) -> bool:
    """Does a chat template speak of <think> blocks (Qwen3, DeepSeek-R1 and their distills)?"""
    return bool(chat_template) and END in chat_template


def prompt_opens_reasoning(prompt: str) -> bool:
    """The rendered prompt ends inside an opened <think> block (DeepSeek-R1's templates)."""
    tail = prompt.rstrip()
    return tail.endswith(START)


class ReasoningStream:
    """feed(delta, final) -> (reasoning delta, content delta)."""

    def __init__(self, in_reasoning: bool = False):
        self.state = "reasoning" if in_reasoning else "start"
        self.buf = ""  # text not yet assigned to either part
        self.reasoning: Optional[str] = "" if in_reasoning else None
        self.content = ""
        self._content_started = False

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.buf += delta
        r_out, c_out = "", ""
        while True:
            if self.state == "start":
                lead = self.buf.lstrip()
                if lead.startswith(START):
                    self.buf = lead[len(START):]
                    self.state = "reasoning"
                    self.reasoning = ""
                    continue
                if not final and START.startswith(lead):
                    break  # may still become <think> (or only whitespace so far)
                self.state = "content"
                continue
            if self.state == "reasoning":
                at = self.buf.find(END)
                if at >= 0:
                    r_out += self.buf[:at]
                    self.buf = self.buf[at + len(END):]
                    self.state = "content"
                    continue
                keep = 0 if final else _partial_suffix(self.buf, END)
                r_out += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                break
            # content
            text = self.buf
            if not self._content_started and self.reasoning is not None:
                text = text.lstrip("\r\n")
                if not text and not final:
                    self.buf = ""
                    break
            if text:
                self._content_started = True
            c_out += text
            self.buf = ""
            break
        if self.reasoning is not None:
            self.reasoning += r_out
        self.content += c_out
        return r_out, c_out


def _partial_suffix(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def split_reasoning(text: str, in_reasoning: bool = False) -> tuple[Optional[str], str]:
    """Whole-text split: (reasoning_content or None, content)."""
    s = ReasoningStream(in_reasoning)
    s.feed(text, final=True)
    return s.reasoning, s.content
