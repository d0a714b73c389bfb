"""Qwen3: Llama's layer with a per-head RMSNorm on q and k (q_norm / k_norm over head_dim) before RoPE,
no qkv bias, explicit head_dim."""
from __future__ import annotations

from tallow.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    def qk_norm_kind(self):
        return "rms_norm"
