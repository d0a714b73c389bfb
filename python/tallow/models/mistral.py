"""Mistral family: Mistral 7B (sliding-window attention on every layer), Ministral (per-layer
`layer_types`), Mistral 3 / Ministral 3 (nested text_config, yarn RoPE, Llama-4 query scaling
q *= 1 + beta * log(1 + floor(pos / original_max_position_embeddings))). The layer is Llama's; the
differences live in the config (sliding_window_for_layer, rope, rope.llama_4_scaling_beta), which the
generic decoder reads. A sliding layer at position p attends to keys p - W < j <= p (transformers' mask)."""
from __future__ import annotations

from tallow.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
