"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's layer (per-head q/k RMSNorm, no qkv bias) with the
sparse MoE MLP of Qwen2-MoE minus the shared expert; norm_topk_prob renormalises the top-k weights."""
from __future__ import annotations

from tallow.loader.gguf_weights import COMMON_LAYER, MOE_LAYER
from tallow.models.qwen2_moe import Qwen2MoeForCausalLM


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    family = "qwen3_moe"
    hf_architectures = ("Qwen3MoeForCausalLM",)
    model_types = ("qwen3_moe",)
    gguf_architectures = ("qwen3moe",)
    config_defaults = {"qwen3_moe": {
        "max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 4096,
        "decoder_sparse_step": 1, "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_experts": 128,
        "norm_topk_prob": False, "mlp_only_layers": []}}
    gguf_tensor_names = {"qwen3moe": {**COMMON_LAYER, **MOE_LAYER}}
    shared_expert = False

    @classmethod
    def hf_layer_types(cls, get, n_layers: int, sliding_window):
        return None  # every layer slides when there is a window

    @classmethod
    def hf_config(cls, get, fields: dict) -> None:
        bias = bool(get("attention_bias", default=False))
        fields.update(qkv_bias=bias, o_bias=bias, qk_norm=True, **cls.hf_moe(get))

    @classmethod
    def gguf_config(cls, key, md, has, fields: dict) -> None:
        if fields["intermediate_size"] is None:
            fields["intermediate_size"] = int(key("expert_feed_forward_length", 0))
        super().gguf_config(key, md, has, fields)
        fields["qk_norm"] = True
