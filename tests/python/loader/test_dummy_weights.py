"""Dummy (random) weights from a config alone, filled in place into a model built empty: every name and
shape a checkpoint of that config has (the model's declared layers, checked against transformers' own
models where transformers is installed), value ranges per kind, determinism, the numbers pinned to
those of earlier releases, and the config-only model folder."""
import json

import numpy as np
import pytest

import tallow
from tallow.config import ModelConfig
from tallow.models import build_model, checkpoint_names, dummy_weights, load_model, num_params

_DENSE = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
          "rms_norm_eps": 1e-6}
CONFIGS = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **_DENSE, "rope_theta": 500000.0,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    "llama_bias_tied": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **_DENSE,
                        "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True},
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", **_DENSE, "head_dim": 16},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **_DENSE, "tie_word_embeddings": True},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **_DENSE, "head_dim": 16,
              "tie_word_embeddings": True},
    "qwen2_moe": {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", **_DENSE, "num_experts": 4,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 24, "shared_expert_intermediate_size": 40,
                  "decoder_sparse_step": 1, "mlp_only_layers": [1]},
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **_DENSE, "head_dim": 16,
                  "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24, "norm_topk_prob": True},
    "phi3": {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", **_DENSE, "pad_token_id": 0},
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", **_DENSE, "head_dim": 16},
    "glm4": {"architectures": ["Glm4ForCausalLM"], "model_type": "glm4", **_DENSE, "head_dim": 16, "pad_token_id": 0},
    "stablelm": {"architectures": ["StableLmForCausalLM"], "model_type": "stablelm",
                 **{k: v for k, v in _DENSE.items() if k != "rms_norm_eps"}, "layer_norm_eps": 1e-5,
                 "qk_layernorm": True, "use_qkv_bias": True},
}
# the families the task names explicitly; the others are built too (test_every_family_builds)
TRANSFORMERS_CHECKED = ["llama", "llama_bias_tied", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "phi3",
                        "gemma2", "glm4", "stablelm"]


def cfg_of(name: str) -> ModelConfig:
    return ModelConfig.from_hf_dict(CONFIGS[name])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_family_builds(name):
    cfg = cfg_of(name)
    model = load_model(cfg, None, tallow.float32, load_format="dummy", seed=1)
    assert len(model.layers) == cfg.num_hidden_layers
    assert model.lm_head.tied == cfg.tie_word_embeddings
    w = dummy_weights(cfg, tallow.float32, "cpu", seed=1)
    if cfg.tie_word_embeddings:
        assert "lm_head.weight" not in w
    else:
        assert tuple(w["lm_head.weight"].shape) == (cfg.vocab_size, cfg.hidden_size)
    assert sum(t.numel() for t in w.values()) == num_params(cfg)
    # the fused names the dummy weights are seeded by load back into a model (Phi-3 style checkpoints)
    again = build_model(cfg, w, tallow.float32)
    assert np.array_equal(again.layers[0].attn.qkv_proj.weight.numpy(), model.layers[0].attn.qkv_proj.weight.numpy())


def test_dummy_numbers_are_pinned():
    """The values of earlier releases (loader/dummy.py seeded each checkpoint tensor by name; fused layers
    by their fused names): benchmarks on dummy weights stay comparable."""
    got = {}
    for name in ("llama_bias_tied", "qwen2_moe", "stablelm"):
        w = dummy_weights(cfg_of(name), tallow.float32, "cpu", seed=7)
        got[name] = {k: np.asarray(t.numpy(), dtype=np.float64) for k, t in w.items()}
    pinned = [
        ("llama_bias_tied", "model.layers.0.self_attn.qkv_proj.weight", 5.084785408166454, 0.028465496376156807),
        ("llama_bias_tied", "model.layers.1.mlp.gate_up_proj.weight", 12.012683640235991, 0.171486034989357),
        ("llama_bias_tied", "model.embed_tokens.weight", -16.429540038108826, -0.4025496244430542),
        ("llama_bias_tied", "model.layers.0.self_attn.qkv_proj.bias", -0.038633296091575176, 0.0059732673689723015),
        ("qwen2_moe", "model.layers.0.mlp.gate.weight", -2.1907440077047795, -0.0859590619802475),
        ("qwen2_moe", "model.layers.0.mlp.shared_expert_gate.weight", 0.2536797821521759, 0.17110568284988403),
        ("stablelm", "model.layers.0.self_attn.q_layernorm.norms.3.weight", 8.08013904094696, 1.014758825302124),
    ]
    for cfg_name, tensor, total, first in pinned:
        a = got[cfg_name][tensor]
        assert a.sum() == pytest.approx(total, rel=1e-9, abs=1e-12), tensor
        assert a.reshape(-1)[0] == first, tensor


def test_dummy_module_knows_no_family():
    """loader/dummy.py fills what the layers describe: it imports no model file."""
    import subprocess
    import sys

    code = "import sys, tallow.loader.dummy; print(any(m.startswith('tallow.models') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name", TRANSFORMERS_CHECKED)
def test_names_and_shapes_match_transformers_checkpoint(name, tmp_path):
    """What transformers' save_pretrained writes for the same config (its on-disk names: per-expert MoE
    tensors, one copy of tied embeddings), read back with tallow's safetensors reader, is exactly what the
    model's layers declare."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from tallow.loader.safetensors_loader import SafetensorsCheckpoint

    d = CONFIGS[name]
    hf_cfg = transformers.AutoConfig.for_model(**{k: v for k, v in d.items() if k != "architectures"})
    transformers.AutoModelForCausalLM.from_config(hf_cfg).save_pretrained(tmp_path)
    ckpt = SafetensorsCheckpoint(str(tmp_path))
    expected = {k: tuple(ckpt[k].shape) for k in ckpt}
    got = checkpoint_names(cfg_of(name))
    assert got == expected


def test_qwen2_has_qkv_bias_and_qwen3_qk_norm():
    w = checkpoint_names(cfg_of("qwen2"))
    assert w["model.layers.0.self_attn.q_proj.bias"] == (32,)
    assert w["model.layers.0.self_attn.k_proj.bias"] == (16,)
    assert "model.layers.0.self_attn.o_proj.bias" not in w
    w = checkpoint_names(cfg_of("qwen3"))
    assert w["model.layers.1.self_attn.q_norm.weight"] == (16,)
    assert w["model.layers.1.self_attn.q_proj.weight"] == (64, 32)  # head_dim 16 x 4 heads
    assert "model.layers.0.self_attn.q_proj.bias" not in w


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_value_ranges_and_determinism(dtype):
    cfg = cfg_of("qwen2")
    w = dummy_weights(cfg, dtype, "cpu", seed=3)
    again = dummy_weights(cfg, dtype, "cpu", seed=3)
    other = dummy_weights(cfg, dtype, "cpu", seed=4)

    def arr(t):
        return np.asarray(t.to(tallow.float32).numpy(), dtype=np.float32)

    tol = 1e-2  # bf16 rounding of the bounds
    for name, t in w.items():
        assert str(t.dtype) == str(tallow._core.dtype(dtype)) and t.device == "cpu"
        a = arr(t)
        np.testing.assert_array_equal(a, arr(again[name]))
        if a.size > 8:
            assert not np.array_equal(a, arr(other[name])), name
        if name.endswith("_proj.weight"):
            bound = 1 / np.sqrt(t.shape[1])
        elif "norm" in name:
            assert a.min() >= 0.9 - tol and a.max() <= 1.1 + tol, name
            continue
        elif name.endswith(".bias"):
            bound = 0.02
        else:
            bound = 0.5
        assert np.abs(a).max() <= bound * (1 + tol), name
        if a.size >= 1000:  # uses the range: std of U(-b, b) is b / sqrt(3)
            assert abs(a.std() - bound / np.sqrt(3)) < 0.1 * bound, name
    # tensors of equal shape get different values (seeded by name)
    assert not np.array_equal(arr(w["model.layers.0.self_attn.qkv_proj.weight"]),
                              arr(w["model.layers.1.self_attn.qkv_proj.weight"]))


def test_forward_stays_finite_and_order_one():
    """Activations stay O(1): a forward pass over the dummy llama gives finite logits of modest size."""
    from tallow.layers.attention import AttentionMetadata
    cfg = cfg_of("llama")
    model = load_model(cfg, None, tallow.float32, load_format="dummy")
    n, bs = 8, 16
    caches = []
    for _ in range(cfg.num_hidden_layers):
        shape = [1, bs, cfg.num_key_value_heads, cfg.head_dim]
        caches.append((tallow.tensor(np.zeros(shape, np.float32)), tallow.tensor(np.zeros(shape, np.float32))))
    meta = AttentionMetadata(slot_mapping=tallow.tensor(np.arange(n, dtype=np.int64)),
                             block_tables=tallow.tensor(np.zeros((1, 1), np.int32)),
                             seq_lens=tallow.tensor(np.array([n], np.int32)),
                             query_start_loc=tallow.tensor(np.array([0, n], np.int32)), num_tokens=n)
    ids = tallow.tensor(np.arange(1, n + 1, dtype=np.int32))
    hidden = model.forward(ids, tallow.tensor(np.arange(n, dtype=np.int64)), caches, meta)
    logits = np.asarray(model.compute_logits(hidden).numpy())
    assert np.all(np.isfinite(logits))
    assert 0.05 < logits.std() < 20


def test_config_only_folder_resolves(tmp_path):
    from tallow.loader.source import ModelSourceError, resolve_model_source

    (tmp_path / "config.json").write_text(json.dumps(CONFIGS["qwen3"]))
    with pytest.raises(ModelSourceError, match="no model weights"):
        resolve_model_source(w=str(tmp_path))
    src = resolve_model_source(w=str(tmp_path), config_only=True)
    assert src.kind == "safetensors" and src.model_dir == str(tmp_path)
    assert resolve_model_source(m=str(tmp_path), config_only=True).model_dir == str(tmp_path)
    cfg = ModelConfig.from_pretrained_dir(src.model_dir)
    assert load_model(cfg, None, tallow.float32, load_format="dummy") is not None


def test_placeholder_tokenizer():
    pytest.importorskip("tokenizers")
    from tallow.loader.dummy import placeholder_tokenizer
    from tallow.tokenizer import IncrementalDetokenizer

    cfg = ModelConfig.from_hf_dict({**CONFIGS["qwen3"], "eos_token_id": [7, 9], "bos_token_id": 3})
    tok = placeholder_tokenizer(cfg)
    assert tok.eos_token_ids == {7, 9} and tok.bos_token_id == 3
    assert tok.encode("t5 t95") == [5, 95]
    assert tok.decode([1, 2, 95]) == "t1 t2 t95"
    d = IncrementalDetokenizer(tok, [1, 2])
    assert d.add(4) + d.add(5) + d.finish() == " t4 t5"


def _cuda_available() -> bool:
    if not tallow._core.build_info.get("cuda"):
        return False
    from tallow import cuda
    return cuda.is_available()


@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA build of tallow and a CUDA device")
def test_cuda_dummy_equals_cpu_dummy():
    cfg = cfg_of("qwen3")
    gpu = dummy_weights(cfg, "bfloat16", "cuda:0", seed=5)
    cpu = dummy_weights(cfg, "bfloat16", "cpu", seed=5)
    assert gpu.keys() == cpu.keys()
    for k in cpu:
        assert gpu[k].device == "cuda:0"
        np.testing.assert_array_equal(np.asarray(gpu[k].to("cpu").numpy(raw=True)),
                                      np.asarray(cpu[k].numpy(raw=True)), err_msg=k)


def test_missing_and_undeclared_weights_are_named():
    """A checkpoint without a tensor the model declares fails with the loader's MissingWeightError text
    naming it (under the checkpoint's unfused name); one with a bias the config does not declare fails
    instead of being dropped."""
    from tallow.layers.names import MissingWeightError

    cfg = cfg_of("llama")
    w = dict(dummy_weights(cfg, tallow.float32, "cpu"))
    w.pop("model.layers.1.mlp.gate_up_proj.weight")
    with pytest.raises(MissingWeightError, match=r"the checkpoint has no weight 'model\.layers\.1\.mlp\.gate_proj\.weight' "
                                                 r"\(a different architecture, or an incomplete download\?\)"):
        build_model(cfg, w, tallow.float32)
    w = dict(dummy_weights(cfg, tallow.float32, "cpu"))
    w["model.layers.0.self_attn.o_proj.bias"] = tallow.from_numpy(np.zeros(32, np.float32))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.o_proj\.bias', which this llama config does not"):
        build_model(cfg, w, tallow.float32)
