"""Llama family: Llama 2 / 3 / 3.1 / 3.2 (llama3 RoPE scaling, tied embeddings), Yi, SmolLM,
DeepSeek-R1-Distill-Llama, and Llama-architecture GGUF files (q/k rows un-permuted by the loader).

    embed -> N x [rms_norm -> attention (RoPE) -> + ; rms_norm -> SwiGLU MLP -> +] -> rms_norm -> lm_head

Optional attention_bias / mlp_bias (config). q/k/v and gate/up are one GEMM each (QKVParallelLinear,
MergedColumnParallelLinear: the checkpoint's separate tensors load into their rows)."""
from __future__ import annotations

from tallow.layers.decoder import DecoderForCausalLM
from tallow.loader.gguf_weights import COMMON_LAYER


class LlamaForCausalLM(DecoderForCausalLM):
    family = "llama"
    hf_architectures = ("LlamaForCausalLM", "YiForCausalLM")
    model_types = ("llama", "yi")
    gguf_architectures = ("llama",)
    config_defaults = {"llama": {"max_position_embeddings": 2048}, "yi": {"max_position_embeddings": 2048}}
    gguf_tensor_names = {"llama": {
        **COMMON_LAYER,
        # Mixtral-style MoE converted as llama (named, so such files map; no model serves them yet)
        "ffn_gate_inp": "block_sparse_moe.gate",
        "ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
        "ffn_down_exps": "block_sparse_moe.experts.{e}.w2",
        "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
    }}
    gguf_permuted_qk = True

    attn_norm = "input_layernorm"
    mlp_norm = "post_attention_layernorm"

    @classmethod
    def hf_config(cls, get, fields: dict) -> None:
        bias = bool(get("attention_bias", default=False))
        fields.update(qkv_bias=bias, o_bias=bias, mlp_bias=bool(get("mlp_bias", default=False)))
