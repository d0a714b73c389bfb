"""Gemma 2: embeddings * sqrt(hidden), RMSNorms with (1 + w), a norm before and after both sublayers
(input / post_attention / pre_feedforward / post_feedforward), GeGLU with tanh GELU, softmax scale
query_pre_attn_scalar ** -0.5, attention logit soft-capping, sliding-window attention on every other
layer (layer_types; keys p - W < j <= p), final logit soft-capping cap * tanh(logits / cap), tied lm_head."""
from __future__ import annotations

from tallow.layers.decoder import DecoderForCausalLM


class Gemma2ForCausalLM(DecoderForCausalLM):
    attn_norm = "input_layernorm"
    attn_post_norm = "post_attention_layernorm"
    mlp_norm = "pre_feedforward_layernorm"
    mlp_post_norm = "post_feedforward_layernorm"
    gemma_norms = True
    embed_scale = True
