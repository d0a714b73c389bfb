"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's layer (qkv bias) with a sparse MoE MLP on the layers
config.is_moe_layer(i) picks (decoder_sparse_step / mlp_only_layers; the others keep a dense MLP of
intermediate_size): softmax router, top-k without renormalisation unless norm_topk_prob, plus a shared
expert scaled by sigmoid(shared_expert_gate(x)). See layers/moe.py."""
from __future__ import annotations

from tallow.config import FULL_ATTENTION, SLIDING_ATTENTION
from tallow.layers.moe import SparseMoE
from tallow.loader.gguf_weights import COMMON_LAYER, MOE_LAYER, SHARED_EXPERT_LAYER
from tallow.models.qwen2 import Qwen2ForCausalLM


def _opt_int(v):
    return None if v is None else int(v)


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    family = "qwen2_moe"
    hf_architectures = ("Qwen2MoeForCausalLM",)
    model_types = ("qwen2_moe",)
    gguf_architectures = ("qwen2moe",)
    config_defaults = {"qwen2_moe": {
        "max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 4096,
        "max_window_layers": 28, "qkv_bias": True, "decoder_sparse_step": 1, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4, "num_experts": 60,
        "norm_topk_prob": False, "mlp_only_layers": []}}
    gguf_tensor_names = {"qwen2moe": {**COMMON_LAYER, **MOE_LAYER, **SHARED_EXPERT_LAYER}}
    shared_expert = True

    def make_mlp(self, i: int):
        if not self.cfg.is_moe_layer(i):
            return super().make_mlp(i)
        return SparseMoE(self.cfg, f"model.layers.{i}.mlp.", self.dtype, self.device, self.quant_config,
                         self.tp_rank, self.tp_size)

    @classmethod
    def hf_layer_types(cls, get, n_layers: int, sliding_window):
        if sliding_window is None:
            return None
        mwl = int(get("max_window_layers", default=n_layers))
        return [SLIDING_ATTENTION if (i + 1) % 2 and i < mwl else FULL_ATTENTION for i in range(n_layers)]

    @classmethod
    def hf_moe(cls, get) -> dict:
        return dict(
            num_experts=int(get("num_experts", "num_local_experts")),
            num_experts_per_tok=int(get("num_experts_per_tok")),
            moe_intermediate_size=int(get("moe_intermediate_size")),
            shared_expert_intermediate_size=(_opt_int(get("shared_expert_intermediate_size"))
                                             if cls.shared_expert else None),
            norm_topk_prob=bool(get("norm_topk_prob")),
            decoder_sparse_step=int(get("decoder_sparse_step") or 1),
            mlp_only_layers=[int(i) for i in (get("mlp_only_layers") or [])],
        )

    @classmethod
    def hf_config(cls, get, fields: dict) -> None:
        fields.update(qkv_bias=bool(get("qkv_bias", default=True)), o_bias=False, **cls.hf_moe(get))

    @classmethod
    def gguf_config(cls, key, md, has, fields: dict) -> None:
        num_experts = int(key("expert_count", 0) or 0)
        if not num_experts:
            key("expert_count", required=True)
        norm = key("expert_weights_norm")
        fields.update(
            num_experts=num_experts,
            num_experts_per_tok=int(key("expert_used_count", required=True)),
            moe_intermediate_size=_opt_int(key("expert_feed_forward_length")),
            shared_expert_intermediate_size=_opt_int(key("expert_shared_feed_forward_length")),
            norm_topk_prob=bool(norm) if norm is not None else not cls.shared_expert,
        )
        if cls.shared_expert and fields["moe_intermediate_size"] is None:
            fields["moe_intermediate_size"] = fields["intermediate_size"]
