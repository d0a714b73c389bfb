"""Mistral family: Mistral 7B (sliding-window attention on every layer), Ministral (per-layer
`layer_types`), Mistral 3 / Ministral 3 (nested text_config, yarn RoPE, Llama-4 query scaling
q *= 1 + beta * log(1 + floor(pos / original_max_position_embeddings))). The layer is Llama's; the
differences live in the config (sliding_window_for_layer, rope, rope.llama_4_scaling_beta), which the
generic decoder reads. A sliding layer at position p attends to keys p - W < j <= p (transformers' mask).
GGUF: convert_hf_to_gguf writes Mistral checkpoints as `llama` (models/llama.py serves them)."""
from __future__ import annotations

from tallow.layers.decoder import DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    family = "mistral"
    hf_architectures = ("MistralForCausalLM", "MinistralForCausalLM", "Ministral3ForCausalLM",
                        "Mistral3ForConditionalGeneration")
    model_types = ("mistral", "ministral", "ministral3", "mistral3")
    config_defaults = {
        "mistral": {"max_position_embeddings": 131072, "sliding_window": 4096},
        "ministral": {"max_position_embeddings": 131072, "sliding_window": 4096},
        "ministral3": {"max_position_embeddings": 262144, "rms_norm_eps": 1e-5, "head_dim": 128},
    }
    tool_parser = "mistral"
    gguf_written_as = "llama"
