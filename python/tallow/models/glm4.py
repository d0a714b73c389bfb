"""GLM-4-0414 (Glm4ForCausalLM): partial rotary (half of head_dim) with interleaved pairs (2i, 2i+1),
qkv bias, RMSNorms after both sublayers as well as before (post_self_attn_layernorm,
post_mlp_layernorm), fused gate_up_proj in the checkpoint."""
from __future__ import annotations

from tallow.layers.decoder import DecoderForCausalLM
from tallow.loader.gguf_weights import COMMON_LAYER


class Glm4ForCausalLM(DecoderForCausalLM):
    family = "glm4"
    hf_architectures = ("Glm4ForCausalLM",)
    model_types = ("glm4",)
    gguf_architectures = ("glm4",)
    config_defaults = {"glm4": {"max_position_embeddings": 131072, "rms_norm_eps": 1.5625e-07,
                                "partial_rotary_factor": 0.5, "attention_bias": True, "head_dim": 128}}
    gguf_tensor_names = {"glm4": {**COMMON_LAYER, "ffn_up": "mlp.gate_up_proj",  # gate and up fused
                                  "post_attention_norm": "post_self_attn_layernorm",
                                  "post_ffw_norm": "post_mlp_layernorm"}}
    checkpoint_fused = ("gate_up_proj",)
    rope_neox = False

    attn_norm = "input_layernorm"
    attn_post_norm = "post_self_attn_layernorm"
    mlp_norm = "post_attention_layernorm"
    mlp_post_norm = "post_mlp_layernorm"

    @classmethod
    def hf_config(cls, get, fields: dict) -> None:
        fields.update(qkv_bias=bool(get("attention_bias", default=False)), o_bias=False)
