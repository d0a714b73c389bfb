"""GPTQ, AWQ and FP8 checkpoints end to end on the CPU (issue 27): a random-weight Llama / Qwen3 made with
transformers has its decoder linear weights quantized by the test's packers (tests/python/checkpoint_packers.py,
from the public format descriptions) and saved in each on-disk format with its quantization_config; tallow
(f32, through `LLM`) must produce the greedy tokens of transformers running the same model with the
dequantized weights written back as float, on every prompt (2 prompts x 16 tokens per case). One layer is left
unquantized (listed in the config's exclusion list, stored as float) to exercise per-layer exclusions.
Errors at load (missing scales, wrong shapes, FP8 without a config) name the tensor."""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="transformers (with CPU torch) is the reference model")
pytest.importorskip("transformers", reason="transformers is the reference model")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="writes the quantized checkpoints")

import checkpoint_packers as P  # noqa: E402
from quant_models import hf_greedy, make_llama, prompts, run  # noqa: E402

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
KEEP_FLOAT = "model.layers.1.mlp.down_proj"  # left unquantized, named in the exclusion list


def _gptq(bits, group, desc_act, sym, fmt="gptq"):
    return dict(kind="gptq", bits=bits, group=group, desc_act=desc_act, sym=sym, fmt=fmt,
                config={"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym,
                        "checkpoint_format": fmt, "damp_percent": 0.01, "true_sequential": True,
                        "dynamic": {f"-:{KEEP_FLOAT}": {}}})


def _awq(group):
    return dict(kind="awq", group=group, config={"quant_method": "awq", "bits": 4, "group_size": group,
                                                 "zero_point": True, "version": "gemm",
                                                 "modules_to_not_convert": [KEEP_FLOAT]})


FP8_CONFIGS = {
    "fp8_tensor": ("tensor", None, "weight_scale",
                   {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": [KEEP_FLOAT]}),
    "fp8_block": ("block", (128, 128), "weight_scale_inv",
                  {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                   "weight_block_size": [128, 128], "modules_to_not_convert": [KEEP_FLOAT]}),
    "fbgemm_fp8": ("channel", None, "weight_scale",
                   {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                    "modules_to_not_convert": [KEEP_FLOAT]}),
    "ct_fp8_channel": ("channel", None, "weight_scale",
                       {"quant_method": "compressed-tensors", "format": "float-quantized",
                        "ignore": ["lm_head", KEEP_FLOAT],
                        "config_groups": {"group_0": {"targets": ["Linear"],
                                                      "weights": {"num_bits": 8, "type": "float",
                                                                  "strategy": "channel", "symmetric": True,
                                                                  "dynamic": False},
                                                      "input_activations": {"num_bits": 8, "type": "float",
                                                                            "strategy": "token", "dynamic": True}}}}),
}


def _fp8(name):
    strategy, block, scale_name, config = FP8_CONFIGS[name]
    return dict(kind="fp8", strategy=strategy, block=block, scale_name=scale_name, config=config)


CASES = {
    "llama-gptq4-g128-sym": ("llama", _gptq(4, 128, False, True)),
    "llama-gptq4-g32-actorder-asym": ("llama", _gptq(4, 32, True, False)),
    "llama-gptq8-g-1-actorder-asym": ("llama", _gptq(8, -1, True, False)),
    "llama-gptq4-g64-v2-asym": ("llama", _gptq(4, 64, False, False, "gptq_v2")),
    "llama-awq-g128": ("llama", _awq(128)),
    "llama-awq-g64": ("llama", _awq(64)),
    "llama-fp8-tensor": ("llama", _fp8("fp8_tensor")),
    "llama-fbgemm-fp8": ("llama", _fp8("fbgemm_fp8")),
    "llama-ct-fp8-channel": ("llama", _fp8("ct_fp8_channel")),
    "llama-fp8-block": ("llama", _fp8("fp8_block")),
    "qwen2-gptq4-g128-asym-bias": ("qwen2", _gptq(4, 128, False, False)),  # q/k/v biases beside packed weights
    "qwen3-gptq4-g128-actorder": ("qwen3", _gptq(4, 128, True, True)),
    "qwen3-awq-g128": ("qwen3", _awq(128)),
    "qwen3-fp8-block": ("qwen3", _fp8("fp8_block")),
}


def _quantize_layer(w: np.ndarray, case: dict, rng):
    """(packed tensors {suffix: torch tensor}, dequantized float64 [N, K]) of one linear weight."""
    if case["kind"] in ("gptq", "awq"):
        bits = case.get("bits", 4)
        v1 = case["kind"] == "gptq" and case["fmt"] == "gptq"
        g_idx = P.group_index(w.shape[1], case["group"], rng if case.get("desc_act") else None)
        q, zeros, scales = P.quantize_int(w, bits, g_idx, case.get("sym", False),
                                          (1, (1 << bits) - 1) if v1 else None)
        ref = P.dequant_int_reference(q, zeros, scales, g_idx)
        packed = P.pack_gptq(q, zeros, scales, g_idx, bits, case["fmt"]) if case["kind"] == "gptq" \
            else P.pack_awq(q, zeros, scales)
        return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in packed.items()}, ref
    raw, scale = P.quantize_fp8(w, case["strategy"], case["block"])
    ref = P.dequant_fp8_reference(raw, scale, case["strategy"], case["block"])
    out = {"weight": torch.from_numpy(np.ascontiguousarray(raw)).view(torch.float8_e4m3fn),
           case["scale_name"]: torch.from_numpy(scale)}
    if case["config"].get("activation_scheme") == "static":
        out["input_scale"] = torch.tensor([0.02], dtype=torch.float32)  # W8A8 static: loads, unused on the CPU
    return out, ref


def write_quantized(path: pathlib.Path, arch: str, case: dict, seed: int = 0, **overrides):
    """A random `arch` model saved in `case`'s format; returns the transformers model holding the dequantized
    weights (the reference)."""
    model = make_llama(path, seed=seed, arch=arch, **overrides)
    rng = np.random.default_rng(seed + 100)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    with torch.no_grad():
        for i in range(model.config.num_hidden_layers):
            for lin in LINEARS:
                prefix = f"model.layers.{i}.{lin}"
                if prefix == KEEP_FLOAT:
                    continue
                w = state.pop(prefix + ".weight").double().numpy()
                packed, ref = _quantize_layer(w, case, rng)
                for suffix, t in packed.items():
                    state[f"{prefix}.{suffix}"] = t
                model.get_parameter(prefix + ".weight").copy_(torch.from_numpy(ref.astype(np.float32)))
    safetensors_torch.save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = case["config"]
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return model


@pytest.mark.parametrize("case_id", list(CASES))
def test_quantized_checkpoint_matches_dequantized_reference(tmp_path, case_id):
    arch, case = CASES[case_id]
    overrides = {"intermediate_size": 320} if case.get("block") else {}  # FP8 blocks: a ragged last block
    hf = write_quantized(tmp_path, arch, case, **overrides)
    ps = prompts(2, 7)
    tokens, _, llm = run(str(tmp_path), ps)
    want = [hf_greedy(hf, p) for p in ps]
    assert tokens == want
    from tallow.layers.quantization.quant_config import DequantizingLinearMethod

    model = llm.engine.runner.model  # the excluded layer stayed float, the others took the format's method
    down = model.layers[1].mlp.down_proj.quant_method
    up = model.layers[1].mlp.gate_up_proj.quant_method
    assert not isinstance(down, DequantizingLinearMethod) and isinstance(up, DequantizingLinearMethod)


def test_quantized_checkpoint_dequantization_matters(tmp_path):
    """Sanity of the comparison: the same checkpoint read with a wrong zero convention (v2 read as v1) gives
    other tokens, so token equality above is evidence of a correct reader, not of an insensitive test."""
    _, case = CASES["llama-gptq4-g64-v2-asym"]
    hf = write_quantized(tmp_path, "llama", case)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"]["checkpoint_format"] = "gptq"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ps = prompts(2, 7)
    tokens, _, _ = run(str(tmp_path), ps)
    assert tokens != [hf_greedy(hf, p) for p in ps]


def _load(path):
    from tallow.config import ModelConfig
    from tallow.loader.source import resolve_model_source
    from tallow.models import load_model

    import tallow

    return load_model(ModelConfig.from_pretrained_dir(path), resolve_model_source(w=str(path)), tallow.float32)


def test_missing_scales_and_wrong_shapes_name_the_tensor(tmp_path):
    from safetensors.torch import load_file

    _, case = CASES["llama-gptq4-g128-sym"]
    write_quantized(tmp_path, "llama", case, num_hidden_layers=1)
    state = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.scales"
    scales = state.pop(name)
    safetensors_torch.save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.scales"):
        _load(tmp_path)
    state[name] = scales[:, :-8].contiguous()
    safetensors_torch.save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.scales: shape"):
        _load(tmp_path)


def test_fp8_needs_its_scales_and_its_config(tmp_path):
    from safetensors.torch import load_file

    write_quantized(tmp_path, "llama", _fp8("fp8_block"), num_hidden_layers=1)
    state = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight_scale_inv"
    scale = state.pop(name)
    safetensors_torch.save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight_scale_inv"):
        _load(tmp_path)
    state[name] = scale
    safetensors_torch.save_file(state, str(tmp_path / "model.safetensors"))
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"float8_e4m3 but config\.json has no quantization_config"):
        _load(tmp_path)


def test_unsupported_method_fails_at_load(tmp_path):
    make_llama(tmp_path, num_hidden_layers=1)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 2, "group_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"gptq quantization_config: bits=2 is not supported"):
        _load(tmp_path)


def test_quantize_config_json_beside_config(tmp_path):
    """AutoGPTQ's older folders keep the config in quantize_config.json (no quant_method)."""
    _, case = CASES["llama-gptq4-g128-sym"]
    hf = write_quantized(tmp_path, "llama", case)
    cfg = json.loads((tmp_path / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    qc.pop("quant_method")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "quantize_config.json").write_text(json.dumps(qc))
    ps = prompts(1, 7)
    tokens, _, _ = run(str(tmp_path), ps)
    assert tokens == [hf_greedy(hf, ps[0])]


def test_one_log_line_says_the_weights_run_dequantized(tmp_path, caplog):
    write_quantized(tmp_path, "llama", _fp8("fp8_block"), intermediate_size=320)
    with caplog.at_level("INFO", logger="tallow.quantization"):
        _load(tmp_path)
    lines = [r.getMessage() for r in caplog.records if r.name == "tallow.quantization"]
    assert len(lines) == 1, lines
    assert "FP8" in lines[0] and "block 128x128" in lines[0] and "dequantized" in lines[0]
