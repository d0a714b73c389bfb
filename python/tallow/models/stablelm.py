"""StableLM (StableLM-2, StableLM-3B-4E1T, StableCode): LayerNorm with bias, partial rotary (NeoX pairs
over the first partial_rotary_factor * head_dim dims), optional qkv bias, optional per-head q/k
LayerNorms (qk_layernorm, one weight per head), and optionally the parallel residual
h + attn(ln(h)) + mlp(ln(h)) (use_parallel_residual: no post-attention norm)."""
from __future__ import annotations

from tallow.layers.decoder import DecoderForCausalLM


class StableLmForCausalLM(DecoderForCausalLM):
    attn_norm = "input_layernorm"
    mlp_norm = "post_attention_layernorm"

    def qk_norm_kind(self):
        return "layer_norm" if self.cfg.qk_norm else None
