"""Phi-3 / Phi-3.5 / Phi-4 (mini): Llama's layer with the projections fused in the checkpoint itself
(self_attn.qkv_proj = [q; k; v] rows, mlp.gate_up_proj = [gate; up] rows), optional partial rotary
(Phi-4-mini) and LongRoPE (short factors up to original_max_position_embeddings, long factors beyond;
see layers/decoder.py RopeCaches)."""
from __future__ import annotations

from tallow.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    pass  # fused qkv_proj / gate_up_proj are recognised by name
