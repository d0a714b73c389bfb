"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's layer (per-head q/k RMSNorm, no qkv bias) with the
sparse MoE MLP of Qwen2-MoE minus the shared expert; norm_topk_prob renormalises the top-k weights."""
from __future__ import annotations

from tallow.models.qwen2_moe import Qwen2MoeForCausalLM


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    def qk_norm_kind(self):
        return "rms_norm"
