"""Qwen2 / Qwen2.5 (and DeepSeek-R1-Distill-Qwen, QwQ): Llama's layer with biases on q/k/v (none on o);
sliding windows only on layers >= max_window_layers when use_sliding_window is set (config)."""
from __future__ import annotations

from tallow.config import FULL_ATTENTION, SLIDING_ATTENTION
from tallow.layers.decoder import DecoderForCausalLM
from tallow.loader.gguf_weights import COMMON_LAYER


class Qwen2ForCausalLM(DecoderForCausalLM):
    family = "qwen2"
    hf_architectures = ("Qwen2ForCausalLM",)
    model_types = ("qwen2",)
    gguf_architectures = ("qwen2",)
    config_defaults = {"qwen2": {"max_position_embeddings": 32768, "use_sliding_window": False,
                                 "sliding_window": 4096, "max_window_layers": 28}}
    gguf_tensor_names = {"qwen2": dict(COMMON_LAYER)}
    tool_parser = "hermes"
    sliding_window_opt_in = True

    @classmethod
    def hf_layer_types(cls, get, n_layers: int, sliding_window):
        if sliding_window is None:
            return None
        mwl = int(get("max_window_layers", default=n_layers))
        return [SLIDING_ATTENTION if i >= mwl else FULL_ATTENTION for i in range(n_layers)]

    @classmethod
    def hf_config(cls, get, fields: dict) -> None:
        fields.update(qkv_bias=True, o_bias=False)
