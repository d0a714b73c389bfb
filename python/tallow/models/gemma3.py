"""Gemma 3 (text; the language model of Gemma3ForConditionalGeneration too): Gemma 2's layer plus
per-head (1 + w) RMSNorms on q and k, sliding-window (local) layers and global layers in a 5:1 pattern,
each kind with its own RoPE (rope_local_base_freq for local layers; the global RoPE may be linearly
scaled), optional soft-capping (off by default)."""
from __future__ import annotations

from tallow.config import FULL_ATTENTION, SLIDING_ATTENTION, RopeConfig
from tallow.models.gemma2 import GEMMA_LAYER, Gemma2ForCausalLM

_TEXT_DEFAULTS = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "tie_word_embeddings": True, "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "sliding_window_pattern": 6, "final_logit_softcapping": None, "attn_logit_softcapping": None}


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    family = "gemma3"
    hf_architectures = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
    model_types = ("gemma3", "gemma3_text")
    gguf_architectures = ("gemma3",)
    # Gemma 3 multimodal checkpoints ship a sparse text_config that relies on these.
    config_defaults = {"gemma3_text": _TEXT_DEFAULTS, "gemma3": _TEXT_DEFAULTS}
    gguf_tensor_names = {"gemma3": GEMMA_LAYER}
    legacy_rope_local = True

    def qk_norm_kind(self):
        return "gemma_rms_norm"

    @classmethod
    def hf_layer_types(cls, get, n_layers: int, sliding_window):
        pattern = int(get("sliding_window_pattern", "_sliding_window_pattern", default=6))
        return [SLIDING_ATTENTION if pattern and (i + 1) % pattern else FULL_ATTENTION for i in range(n_layers)]

    @classmethod
    def hf_config(cls, get, fields: dict) -> None:
        super().hf_config(get, fields)
        fields["qk_norm"] = True

    @classmethod
    def gguf_config(cls, key, md, has, fields: dict) -> None:
        cls.gguf_softcaps(key, fields, 62)
        fields["qk_norm"] = True
        if fields["sliding_window"]:
            n = fields["num_hidden_layers"]
            pat = md.get(f"{fields['model_type']}.attention.sliding_window_pattern", 6)
            if isinstance(pat, (int, float)):
                pat = int(pat)
                fields["layer_types"] = [SLIDING_ATTENTION if pat == 0 or i % pat < pat - 1 else FULL_ATTENTION
                                         for i in range(n)]
            else:
                fields["layer_types"] = [SLIDING_ATTENTION if bool(x) else FULL_ATTENTION for x in pat]
            fields["rope_local"] = RopeConfig(theta=float(key("rope.freq_base_swa", 10000.0)),
                                              max_position_embeddings=fields["max_position_embeddings"])
