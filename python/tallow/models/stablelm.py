"""StableLM (StableLM-2, StableLM-3B-4E1T, StableCode): LayerNorm with bias, partial rotary (NeoX pairs
over the first partial_rotary_factor * head_dim dims), optional qkv bias, optional per-head q/k
LayerNorms (qk_layernorm, one weight per head), and optionally the parallel residual
h + attn(ln(h)) + mlp(ln(h)) (use_parallel_residual: no post-attention norm)."""
from __future__ import annotations

from tallow.layers.decoder import DecoderForCausalLM
from tallow.loader.gguf_weights import COMMON_LAYER

_DEFAULTS = {"max_position_embeddings": 4096, "layer_norm_eps": 1e-5, "partial_rotary_factor": 0.25,
             "use_qkv_bias": False, "qk_layernorm": False, "use_parallel_residual": False}


class StableLmForCausalLM(DecoderForCausalLM):
    family = "stablelm"
    hf_architectures = ("StableLmForCausalLM", "StableLMEpochForCausalLM")
    model_types = ("stablelm", "stablelm_epoch")
    gguf_architectures = ("stablelm",)
    config_defaults = {"stablelm": _DEFAULTS, "stablelm_epoch": _DEFAULTS}
    gguf_tensor_names = {"stablelm": {**COMMON_LAYER, "attn_q_norm": "self_attn.q_layernorm.norms.{h}",
                                      "attn_k_norm": "self_attn.k_layernorm.norms.{h}"}}
    norm_type = "layer_norm"

    attn_norm = "input_layernorm"
    mlp_norm = "post_attention_layernorm"

    def qk_norm_kind(self):
        return "layer_norm" if self.cfg.qk_norm else None

    @classmethod
    def hf_config(cls, get, fields: dict) -> None:
        fields.update(qkv_bias=bool(get("use_qkv_bias", default=False)), o_bias=False,
                      qk_norm=bool(get("qk_layernorm")),
                      use_parallel_residual=bool(get("use_parallel_residual", default=False)))

    @classmethod
    def gguf_config(cls, key, md, has, fields: dict) -> None:
        fields["use_parallel_residual"] = bool(key("use_parallel_residual", False))
