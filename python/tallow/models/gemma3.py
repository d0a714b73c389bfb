"""Gemma 3 (text; the language model of Gemma3ForConditionalGeneration too): Gemma 2's layer plus
per-head (1 + w) RMSNorms on q and k, sliding-window (local) layers and global layers in a 5:1 pattern,
each kind with its own RoPE (rope_local_base_freq for local layers; the global RoPE may be linearly
scaled), optional soft-capping (off by default)."""
from __future__ import annotations

from tallow.models.gemma2 import Gemma2ForCausalLM


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    def qk_norm_kind(self):
        return "gemma_rms_norm"
