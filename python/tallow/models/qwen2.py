"""Qwen2 / Qwen2.5 (and DeepSeek-R1-Distill-Qwen, QwQ): Llama's layer with biases on q/k/v (none on o);
sliding windows only on layers >= max_window_layers when use_sliding_window is set (config)."""
from __future__ import annotations

from tallow.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass  # the qkv biases are picked up from the checkpoint
