"""Gemma 2: embeddings * sqrt(hidden), RMSNorms with (1 + w), a norm before and after both sublayers
(input / post_attention / pre_feedforward / post_feedforward), GeGLU with tanh GELU, softmax scale
query_pre_attn_scalar ** -0.5, attention logit soft-capping, sliding-window attention on every other
layer (layer_types; keys p - W < j <= p), final logit soft-capping cap * tanh(logits / cap), tied lm_head.
GGUF: norms are stored as 1 + w (undone by the loader)."""
from __future__ import annotations

from tallow.config import FULL_ATTENTION, SLIDING_ATTENTION
from tallow.layers.decoder import DecoderForCausalLM
from tallow.loader.gguf_weights import COMMON_LAYER

GEMMA_LAYER = {
    **COMMON_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def _opt_float(v):
    return None if v is None else float(v)


class Gemma2ForCausalLM(DecoderForCausalLM):
    family = "gemma2"
    hf_architectures = ("Gemma2ForCausalLM",)
    model_types = ("gemma2",)
    gguf_architectures = ("gemma2",)
    config_defaults = {"gemma2": {
        "max_position_embeddings": 8192, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
        "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0}}
    gguf_tensor_names = {"gemma2": GEMMA_LAYER}
    gguf_norm_shifted = True
    gguf_hidden_act = "gelu_pytorch_tanh"

    attn_norm = "input_layernorm"
    attn_post_norm = "post_attention_layernorm"
    mlp_norm = "pre_feedforward_layernorm"
    mlp_post_norm = "post_feedforward_layernorm"
    gemma_norms = True
    embed_scale = True

    @classmethod
    def hf_layer_types(cls, get, n_layers: int, sliding_window):
        return [SLIDING_ATTENTION if (i + 1) % 2 else FULL_ATTENTION for i in range(n_layers)]

    @classmethod
    def hf_config(cls, get, fields: dict) -> None:
        bias = bool(get("attention_bias", default=False))
        fields.update(qkv_bias=bias, o_bias=bias, attn_logit_softcapping=_opt_float(get("attn_logit_softcapping")),
                      final_logit_softcapping=_opt_float(get("final_logit_softcapping")),
                      query_pre_attn_scalar=_opt_float(get("query_pre_attn_scalar")))

    @classmethod
    def gguf_softcaps(cls, key, fields: dict, n_layers_27b: int) -> None:
        # llama.cpp derives the attention scale from the model size: 27B uses hidden / heads
        is_27b = fields["num_hidden_layers"] == n_layers_27b
        fields.update(attn_logit_softcapping=_opt_float(key("attn_logit_softcapping")),
                      final_logit_softcapping=_opt_float(key("final_logit_softcapping")),
                      query_pre_attn_scalar=float(fields["hidden_size"] // fields["num_attention_heads"]
                                                  if is_27b else fields["head_dim"]))

    @classmethod
    def gguf_config(cls, key, md, has, fields: dict) -> None:
        cls.gguf_softcaps(key, fields, 46)
        if fields["attn_logit_softcapping"] is None:
            fields["attn_logit_softcapping"] = 50.0
        if fields["final_logit_softcapping"] is None:
            fields["final_logit_softcapping"] = 30.0
        fields["sliding_window"] = fields["sliding_window"] or 4096
        fields["layer_types"] = [SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION
                                 for i in range(fields["num_hidden_layers"])]
