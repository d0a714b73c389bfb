"""GLM-4-0414 (Glm4ForCausalLM): partial rotary (half of head_dim) with interleaved pairs (2i, 2i+1),
qkv bias, RMSNorms after both sublayers as well as before (post_self_attn_layernorm,
post_mlp_layernorm), fused gate_up_proj in the checkpoint."""
from __future__ import annotations

from tallow.layers.decoder import DecoderForCausalLM


class Glm4ForCausalLM(DecoderForCausalLM):
    attn_norm = "input_layernorm"
    attn_post_norm = "post_self_attn_layernorm"
    mlp_norm = "post_attention_layernorm"
    mlp_post_norm = "post_mlp_layernorm"
