"""Qwen3: Llama's layer with a per-head RMSNorm on q and k (q_norm / k_norm over head_dim) before RoPE,
no qkv bias, explicit head_dim."""
from __future__ import annotations

from tallow.loader.gguf_weights import COMMON_LAYER
from tallow.models.qwen2 import Qwen2ForCausalLM


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    family = "qwen3"
    hf_architectures = ("Qwen3ForCausalLM",)
    model_types = ("qwen3",)
    gguf_architectures = ("qwen3",)
    config_defaults = {"qwen3": {"max_position_embeddings": 32768, "use_sliding_window": False,
                                 "sliding_window": 4096, "max_window_layers": 28, "head_dim": 128}}
    gguf_tensor_names = {"qwen3": dict(COMMON_LAYER)}

    @classmethod
    def hf_config(cls, get, fields: dict) -> None:
        bias = bool(get("attention_bias", default=False))
        fields.update(qkv_bias=bias, o_bias=bias, qk_norm=True)

    @classmethod
    def gguf_config(cls, key, md, has, fields: dict) -> None:
        fields["qk_norm"] = True
