"""Phi-3 / Phi-3.5 / Phi-4 (mini): Llama's layer with the projections fused in the checkpoint itself
(self_attn.qkv_proj = [q; k; v] rows, mlp.gate_up_proj = [gate; up] rows: the fused layers load them
under their fused names), optional partial rotary (Phi-4-mini) and LongRoPE (short factors up to
original_max_position_embeddings, long factors beyond; see layers/decoder.py RopeCaches)."""
from __future__ import annotations

from tallow.layers.decoder import DecoderForCausalLM
from tallow.loader.gguf_weights import COMMON_LAYER


class Phi3ForCausalLM(DecoderForCausalLM):
    family = "phi3"
    hf_architectures = ("Phi3ForCausalLM",)
    model_types = ("phi3",)
    gguf_architectures = ("phi3",)
    config_defaults = {"phi3": {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5}}
    gguf_tensor_names = {"phi3": {**COMMON_LAYER, "ffn_up": "mlp.gate_up_proj"}}  # gate and up fused
    checkpoint_fused = ("qkv_proj", "gate_up_proj")
