"""Gemma (1): Gemma 2B / 7B, CodeGemma. Llama's pre-norm layer with Gemma's conventions: embeddings
* sqrt(hidden) (rounded to the model dtype, as transformers does), RMSNorms multiplying by (1 + w), GeGLU
with the tanh GELU (config.json's legacy hidden_act "gelu" means it too), head_dim independent of
hidden / heads (256), tied lm_head. GGUF: architecture "gemma", norms stored as 1 + w (undone by the
loader), q/k as in the checkpoint."""
from __future__ import annotations

from tallow.layers.decoder import DecoderForCausalLM
from tallow.loader.gguf_weights import COMMON_LAYER


class GemmaForCausalLM(DecoderForCausalLM):
    family = "gemma"
    hf_architectures = ("GemmaForCausalLM",)
    model_types = ("gemma",)
    gguf_architectures = ("gemma",)
    config_defaults = {"gemma": {"max_position_embeddings": 8192, "head_dim": 256,
                                 "hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True}}
    gguf_tensor_names = {"gemma": dict(COMMON_LAYER)}
    gguf_norm_shifted = True
    gguf_hidden_act = "gelu_pytorch_tanh"

    attn_norm = "input_layernorm"
    mlp_norm = "post_attention_layernorm"
    gemma_norms = True
    embed_scale = True

    @classmethod
    def hf_config(cls, get, fields: dict) -> None:
        bias = bool(get("attention_bias", default=False))
        fields.update(qkv_bias=bias, o_bias=bias)
        if fields["hidden_act"] == "gelu":  # the official releases' legacy value (transformers reads it so)
            fields["hidden_act"] = "gelu_pytorch_tanh"
