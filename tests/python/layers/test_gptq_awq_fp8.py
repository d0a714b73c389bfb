"""GPTQ, AWQ and FP8 layers on the CPU path (issue 27): packed tensors written by the test's own packers
(tests/python/checkpoint_packers.py, from the public format descriptions) load through the linear layers'
weight loaders and dequantize to exactly the float64 reference of the same format (every value is exact in
float32: small integers times a float16 scale, or an e4m3 value times a float32 scale), for every group size,
symmetric and asymmetric zeros, random desc_act permutations, fused layers, tensor-parallel shards; the
product then matches x @ W^T. Bad configs and tensors fail with a ValueError naming the field or tensor."""
from __future__ import annotations

import numpy as np
import pytest

import tallow
from checkpoint_packers import (
    dequant_fp8_reference,
    dequant_int_reference,
    e4m3_reference,
    group_index,
    pack_awq,
    pack_gptq,
    quantize_fp8,
    quantize_int,
    random_e4m3,
)
from tallow.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from tallow.layers.quantization.awq import AWQConfig
from tallow.layers.quantization.fp8 import FP8Config, decode_e4m3
from tallow.layers.quantization.gptq import GPTQConfig
from tallow.layers.quantization.quant_config import QuantizationConfigError, parse_quantization_config


def _t(a: np.ndarray) -> tallow.Tensor:
    if a.dtype == np.float16:
        return tallow.from_numpy(np.ascontiguousarray(a.astype(np.float32))).to(tallow.float16)
    return tallow.from_numpy(np.ascontiguousarray(a))


def _weight(layer) -> np.ndarray:
    return np.asarray(layer.weight.to(tallow.float32).numpy(), np.float64)


def _random_int_layer(rng, n, k, bits, group, sym, desc_act, zero_range=None):
    g_idx = group_index(k, group, rng if desc_act else None)
    w = rng.standard_normal((n, k)) * 0.05
    q, zeros, scales = quantize_int(w, bits, g_idx, sym, zero_range)
    if not sym:  # fresh random zeros and codes too, so every stored value and nibble position is exercised
        lo, hi = zero_range or (0, (1 << bits) - 1)
        zeros = rng.integers(lo, hi + 1, zeros.shape)
        q = rng.integers(0, 1 << bits, q.shape)
    return q, zeros, scales, g_idx


# -- (a) dequantization against float64 ------------------------------------------------------------
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128, -1])
@pytest.mark.parametrize("desc_act", [False, True])
@pytest.mark.parametrize("fmt,sym", [("gptq", True), ("gptq", False), ("gptq_v2", False)])
def test_gptq_dequantizes_exactly(bits, group, desc_act, fmt, sym):
    rng = np.random.default_rng([bits, group + 2, desc_act, sym, fmt == "gptq"])
    n, k = 96, 256
    zr = (1, (1 << bits) - 1) if fmt == "gptq" else None  # v1 stores zero - 1: a zero of 0 cannot be written
    q, zeros, scales, g_idx = _random_int_layer(rng, n, k, bits, group, sym, desc_act, zr)
    packed = pack_gptq(q, zeros, scales, g_idx, bits, fmt)
    cfg = GPTQConfig(bits=bits, group_size=group, desc_act=desc_act, sym=sym, checkpoint_format=fmt)
    layer = ColumnParallelLinear(k, n, prefix="m.proj", quant_config=cfg)
    assert set(layer.checkpoint_map()) == {f"m.proj.{p}" for p in ("qweight", "qzeros", "scales", "g_idx")}
    for name, arr in packed.items():
        if name == "g_idx" and not desc_act and rng.random() < 0.5:
            continue  # optional without act order
        layer.weight_loader(name, _t(arr))
    assert layer.missing() == []
    layer.process_weights_after_loading()
    ref = dequant_int_reference(q, zeros, scales, g_idx)
    np.testing.assert_array_equal(_weight(layer), ref)
    x = rng.standard_normal((3, k)).astype(np.float32)
    y = np.asarray(layer(tallow.from_numpy(x)).numpy(), np.float64)
    np.testing.assert_allclose(y, x.astype(np.float64) @ ref.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("group", [32, 64, 128, -1])
def test_awq_dequantizes_exactly(group):
    rng = np.random.default_rng(group + 7)
    n, k = 64, 256
    q, zeros, scales, g_idx = _random_int_layer(rng, n, k, 4, group, False, False)
    cfg = AWQConfig(group_size=group)
    layer = ColumnParallelLinear(k, n, prefix="m.proj", quant_config=cfg)
    for name, arr in pack_awq(q, zeros, scales).items():
        layer.weight_loader(name, _t(arr))
    layer.process_weights_after_loading()
    np.testing.assert_array_equal(_weight(layer), dequant_int_reference(q, zeros, scales, g_idx))


def test_awq_packing_order_is_not_the_plain_one():
    """A checkpoint packed in natural order reads as a different matrix: the interleaved order matters."""
    rng = np.random.default_rng(3)
    q = rng.integers(0, 16, (16, 128))
    zeros = np.full((1, 16), 8)
    scales = np.ones((1, 16), np.float16)
    packed = pack_awq(q, zeros, scales)
    natural = (q.T.reshape(128, 2, 8).astype(np.uint64) << (np.arange(8, dtype=np.uint64) * 4)).sum(-1)
    packed["qweight"] = natural.astype(np.uint32).view(np.int32)
    layer = ColumnParallelLinear(128, 16, prefix="m.proj", quant_config=AWQConfig(group_size=-1))
    for name, arr in packed.items():
        layer.weight_loader(name, _t(arr))
    layer.process_weights_after_loading()
    assert not np.array_equal(_weight(layer), q - 8.0)


def test_e4m3_decoding_matches_bit_fields_and_torch():
    codes = np.arange(256, dtype=np.uint8)
    ok = (codes & 0x7F) != 0x7F
    mine = decode_e4m3(codes)
    assert np.isnan(mine[~ok]).all()
    np.testing.assert_array_equal(mine[ok].astype(np.float64), e4m3_reference(codes[ok]))
    assert mine[0x7E] == 448.0 and mine[0x01] == 2.0 ** -9 and mine[0x38] == 1.0
    torch = pytest.importorskip("torch", reason="torch's float8_e4m3fn is a second reference")
    t = torch.from_numpy(codes.copy()).view(torch.float8_e4m3fn).to(torch.float64).numpy()
    np.testing.assert_array_equal(mine[ok].astype(np.float64), t[ok])


@pytest.mark.parametrize("strategy,block", [("tensor", None), ("channel", None), ("block", (128, 128)),
                                            ("block", (64, 32))])
def test_fp8_dequantizes_exactly(strategy, block):
    rng = np.random.default_rng(len(strategy) + (block[1] if block else 0))
    n, k = 200, 320  # not multiples of 128: partial edge blocks
    raw = random_e4m3(rng, (n, k))
    if strategy == "tensor":
        scale = np.array([rng.uniform(0.001, 0.01)], np.float32)
    elif strategy == "channel":
        scale = rng.uniform(0.001, 0.01, (n, 1)).astype(np.float32)
    else:
        scale = rng.uniform(0.001, 0.01, (-(-n // block[0]), -(-k // block[1]))).astype(np.float32)
    name = "weight_scale_inv" if strategy == "block" else "weight_scale"
    cfg = FP8Config(strategy, block, name)
    layer = ColumnParallelLinear(k, n, prefix="m.proj", quant_config=cfg)
    layer.weight_loader("weight", tallow._core.from_buffer(np.ascontiguousarray(raw).reshape(-1), "float8_e4m3",
                                                           [n, k]))
    layer.weight_loader(name, _t(scale))
    layer.weight_loader("input_scale", _t(np.array([0.5], np.float32)))  # static activation scale: accepted
    layer.process_weights_after_loading()
    ref = dequant_fp8_reference(raw, scale, strategy, block)
    # the float32 product of two float32 values is the float64 product rounded once
    np.testing.assert_array_equal(_weight(layer), ref.astype(np.float32).astype(np.float64))


# -- fused layers and tensor-parallel shards --------------------------------------------------------
def _load_gptq_parts(layer, parts_packed, names):
    for pname, packed in zip(names, parts_packed):
        for tname, arr in packed.items():
            layer.weight_loader(tname, _t(arr), names.index(pname))


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_gptq_merged_column_parallel_shards(tp_rank):
    rng = np.random.default_rng(11)
    k, sizes = 128, [64, 96]
    refs, packs = [], []
    for n in sizes:
        q, zeros, scales, g_idx = _random_int_layer(rng, n, k, 4, 32, False, True, (1, 15))
        packs.append(pack_gptq(q, zeros, scales, g_idx, 4))
        refs.append(dequant_int_reference(q, zeros, scales, g_idx))
    cfg = GPTQConfig(bits=4, group_size=32, desc_act=True, sym=False)
    layer = MergedColumnParallelLinear(k, sizes, prefix="mlp.gate_up_proj", part_names=["mlp.gate", "mlp.up"],
                                       quant_config=cfg, tp_rank=tp_rank, tp_size=2)
    _load_gptq_parts(layer, packs, ["mlp.gate", "mlp.up"])
    layer.process_weights_after_loading()
    want = np.concatenate([r[tp_rank * n // 2:(tp_rank + 1) * n // 2] for r, n in zip(refs, sizes)])
    np.testing.assert_array_equal(_weight(layer), want)


def test_fp8_row_parallel_takes_its_columns():
    rng = np.random.default_rng(12)
    n, k = 64, 256
    w = rng.standard_normal((n, k)) * 0.1
    raw, scale = quantize_fp8(w, "block", (128, 128))
    ref = dequant_fp8_reference(raw, scale, "block", (128, 128)).astype(np.float32)
    layer = RowParallelLinear(k, n, prefix="o_proj", quant_config=FP8Config("block", (128, 128), "weight_scale_inv"),
                              tp_rank=1, tp_size=2)
    layer.weight_loader("weight", tallow._core.from_buffer(np.ascontiguousarray(raw).reshape(-1), "float8_e4m3",
                                                           [n, k]))
    layer.weight_loader("weight_scale_inv", _t(scale))
    layer.process_weights_after_loading()
    np.testing.assert_array_equal(_weight(layer), ref[:, k // 2:])


def test_awq_fused_tensor_splits_by_part_sizes():
    """All parts in one checkpoint tensor (Phi-3's qkv_proj): columns of the packed tensors split by parts."""
    rng = np.random.default_rng(13)
    k, sizes = 128, [32, 16, 16]
    q, zeros, scales, g_idx = _random_int_layer(rng, sum(sizes), k, 4, 64, False, False)
    layer = MergedColumnParallelLinear(k, sizes, prefix="attn.qkv_proj", part_names=["attn.q", "attn.k", "attn.v"],
                                       quant_config=AWQConfig(group_size=64))
    for name, arr in pack_awq(q, zeros, scales).items():
        layer.weight_loader(name, _t(arr))
    assert layer.missing() == []
    layer.process_weights_after_loading()
    np.testing.assert_array_equal(_weight(layer), dequant_int_reference(q, zeros, scales, g_idx))


def test_exclusion_lists_leave_layers_unquantized():
    from tallow.layers.quantization.quant_config import DequantizingLinearMethod

    def plain(layer):  # the quantized methods extend the unquantized one
        return not isinstance(layer.quant_method, DequantizingLinearMethod)

    cfg = parse_quantization_config({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                     "version": "GEMM", "modules_to_not_convert": ["mlp.down_proj"]})
    assert plain(ColumnParallelLinear(128, 64, prefix="model.layers.0.mlp.down_proj", quant_config=cfg))
    assert not plain(ColumnParallelLinear(128, 64, prefix="model.layers.0.mlp.up_proj", quant_config=cfg))
    assert plain(ColumnParallelLinear(128, 64, prefix="lm_head", quant_config=cfg))
    ct = parse_quantization_config({"quant_method": "compressed-tensors", "format": "float-quantized",
                                    "ignore": ["lm_head", "re:.*layers\\.1\\..*"],
                                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                        "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                                        "dynamic": False}}}})
    assert plain(ColumnParallelLinear(128, 64, prefix="model.layers.1.mlp.up_proj", quant_config=ct))
    assert not plain(ColumnParallelLinear(128, 64, prefix="model.layers.0.mlp.up_proj", quant_config=ct))
    assert ct.strategy == "channel" and ct.scale_name == "weight_scale"


# -- (c) clear errors ----------------------------------------------------------------------------
@pytest.mark.parametrize("raw,words", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, ["gptq", "bits=3"]),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, ["group_size=0"]),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, ["checkpoint_format='marlin'"]),
    ({"quant_method": "gptq", "bits": 4, "dynamic": {"+:.*down.*": {"bits": 8}}}, ["dynamic"]),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, ["version='gemv'"]),
    ({"quant_method": "awq", "w_bit": 8}, ["awq", "bits=8"]),
    ({"quant_method": "awq", "bits": 4, "zero_point": False}, ["zero_point=False"]),
    ({"quant_method": "fp8", "fmt": "e5m2"}, ["fmt='e5m2'"]),
    ({"quant_method": "fp8", "weight_block_size": [128]}, ["weight_block_size"]),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, ["'bitsandbytes'", "gptq"]),
    ({"bits": 4}, ["quant_method"]),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}, ["pack-quantized"]),
    ({"quant_method": "compressed-tensors", "sparsity_config": {"format": "sparse-24-bitmask"}, "config_groups": {}},
     ["sparse-24-bitmask"]),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}},
     ["num_bits=4", "type='int'"]),
])
def test_unsupported_configs_name_the_field(raw, words):
    with pytest.raises(QuantizationConfigError) as e:
        parse_quantization_config(raw)
    assert isinstance(e.value, ValueError)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_wrong_shapes_and_dtypes_name_the_tensor():
    rng = np.random.default_rng(5)
    q, zeros, scales, g_idx = _random_int_layer(rng, 64, 128, 4, 32, True, False)
    good = pack_gptq(q, zeros, scales, g_idx, 4)
    cfg = GPTQConfig(bits=4, group_size=32)
    cases = {"qweight": good["qweight"][:-1], "qzeros": good["qzeros"][:, :-1], "scales": good["scales"][:2]}
    for bad_name, bad in cases.items():
        layer = ColumnParallelLinear(128, 64, prefix="m.proj", quant_config=cfg)
        for name, arr in good.items():
            layer.weight_loader(name, _t(bad if name == bad_name else arr))
        with pytest.raises(ValueError, match=rf"m\.proj\.{bad_name}: shape"):
            layer.process_weights_after_loading()
    layer = ColumnParallelLinear(128, 64, prefix="m.proj", quant_config=cfg)
    for name, arr in good.items():
        layer.weight_loader(name, _t(arr.astype(np.float32) if name == "qweight" else arr))
    with pytest.raises(ValueError, match=r"m\.proj\.qweight: dtype float32"):
        layer.process_weights_after_loading()
    dcfg = GPTQConfig(bits=4, group_size=32, desc_act=True)
    layer = ColumnParallelLinear(128, 64, prefix="m.proj", quant_config=dcfg)
    for name, arr in good.items():
        layer.weight_loader(name, _t(arr + 10 if name == "g_idx" else arr))
    with pytest.raises(ValueError, match=r"m\.proj\.g_idx: group indices"):
        layer.process_weights_after_loading()


def test_missing_tensors_are_reported_by_name():
    cfg = GPTQConfig(bits=4, group_size=32, desc_act=True)
    layer = ColumnParallelLinear(128, 64, prefix="m.proj", quant_config=cfg)
    layer.weight_loader("qweight", _t(np.zeros((16, 64), np.int32)))
    layer.weight_loader("qzeros", _t(np.zeros((4, 8), np.int32)))
    assert layer.missing() == ["m.proj.scales", "m.proj.g_idx"]  # g_idx required with act order
    fp8 = ColumnParallelLinear(128, 64, prefix="m.proj", quant_config=FP8Config("block", (128, 128),
                                                                                "weight_scale_inv"))
    fp8.weight_loader("weight", tallow._core.from_buffer(np.zeros(64 * 128, np.uint8), "float8_e4m3", [64, 128]))
    assert fp8.missing() == ["m.proj.weight_scale_inv"]  # never an upcast without scales


def test_fp8_scale_of_the_wrong_strategy_is_refused():
    layer = ColumnParallelLinear(128, 64, prefix="m.proj", quant_config=FP8Config("tensor", None, "weight_scale"))
    layer.weight_loader("weight", tallow._core.from_buffer(np.zeros(64 * 128, np.uint8), "float8_e4m3", [64, 128]))
    layer.weight_loader("weight_scale", _t(np.ones((64, 1), np.float32)))
    with pytest.raises(ValueError, match=r"m\.proj\.weight_scale: shape \[64, 1\]"):
        layer.process_weights_after_loading()
