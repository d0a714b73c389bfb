"""Llama family: Llama 2 / 3 / 3.1 / 3.2 (llama3 RoPE scaling, tied embeddings), Yi, SmolLM,
DeepSeek-R1-Distill-Llama, and Llama-architecture GGUF files (q/k rows un-permuted by the loader).

    embed -> N x [rms_norm -> attention (RoPE) -> + ; rms_norm -> SwiGLU MLP -> +] -> rms_norm -> lm_head

Optional attention_bias / mlp_bias come with the checkpoint's bias tensors. q/k/v and gate/up are fused
into one GEMM each at load time (layers/self_attention.py, layers/mlp.py)."""
from __future__ import annotations

from tallow.layers.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    attn_norm = "input_layernorm"
    mlp_norm = "post_attention_layernorm"
