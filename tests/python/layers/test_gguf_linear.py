"""GGUF block weights in the layers (layers/quantization/gguf.py): every product is ops.quant_linear on the
blocks as stored, one per part where a fused layer's parts differ in type (Q4_K_M: attn_v Q6_K beside Q4_K
q/k), and nothing dequantizes a whole weight per call. On the CPU each weight is the checkpoint tensor
itself (no copy); a tied lm head follows a block-typed token table.

Weights are random valid blocks (backend_ops.cases_dequant.random_blocks, whose scales span many orders
of magnitude), the reference is float64 on gguf's dequantization of them, applied to x as the CPU kernel
sees it: for up to 4 rows quant_linear quantizes each activation row to 8 bits per block (llama.cpp's Q8
activations; q8_activations.py emulates it exactly), and through the gated MLP the reference quantizes the
intermediate the same way. Left is f32 accumulation: relative L2 <= 1e-5 (measured <= 1.1e-6 over 600 seeds).
Against unquantized x the error is not bounded usefully here: with these heavy-tailed weights one output can
hang on a few activations, and 6% of M = 1 gated-MLP draws exceeded a 4e-2 relative L2."""
import numpy as np
import pytest

import tallow
from tallow import ops
from tallow.layers.linear import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    VocabParallelEmbedding,
)
from tallow.layers.mlp import GatedMLP
from tallow.layers.quantization import get_quantization_config

gguf = pytest.importorskip("gguf")
from backend_ops.cases_dequant import BLOCKS, _reference, random_blocks  # noqa: E402
from q8_activations import as_kernel_sees  # noqa: E402

REL_L2 = 1e-5


def blocks(rng, name, rows, k):
    """(block tensor [rows, k], its float64 dequantization)."""
    bs = BLOCKS[name][0]
    raw = random_blocks(rng, name, rows, k // bs)
    t = tallow.from_buffer(raw, dtype=name, shape=[rows, k])
    return t, _reference(raw, name).astype(np.float64)


def T(a):
    return tallow.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


def rel_l2(got, ref):
    return float(np.linalg.norm(np.asarray(got, np.float64) - ref) / np.linalg.norm(ref))


@pytest.fixture
def no_dequantize(monkeypatch):
    """Fail on any whole-weight dequantization; count the products: one (w shape, dtype, out given) per
    quant_linear call, one (w shape, dtype, "parts") per part of a quant_linear_parts call."""
    calls = []

    def refuse(*a, **k):
        raise AssertionError("a GGUF layer dequantized a whole weight")

    real = ops.quant_linear

    def counted(x, w, bias=None, out=None):
        calls.append((tuple(w.shape), w.dtype.name, out is not None))
        return real(x, w, bias, out=out)

    monkeypatch.setattr(ops, "dequantize", refuse)
    monkeypatch.setattr(tallow._core, "dequantize", refuse)
    real_parts = ops.quant_linear_parts

    def counted_parts(x, parts, bias=None, out=None):
        calls.extend((tuple(w.shape), w.dtype.name, "parts") for w in parts)
        return real_parts(x, parts, bias, out=out)

    monkeypatch.setattr(ops, "quant_linear", counted)
    monkeypatch.setattr(ops, "quant_linear_parts", counted_parts)
    return calls


@pytest.mark.parametrize("M", [1, 5])
def test_mixed_block_types_one_product_per_part(rng, no_dequantize, M):
    H, D = 512, 32  # 8 query heads, 2 kv heads of 32
    q, qd = blocks(rng, "q4_k", 8 * D, H)
    k, kd = blocks(rng, "q4_k", 2 * D, H)
    v, vd = blocks(rng, "q6_k", 2 * D, H)
    names = ["a.q_proj", "a.k_proj", "a.v_proj"]
    qc = get_quantization_config("gguf", weight_dtypes={f"{n}.weight": t.dtype for n, t in zip(names, (q, k, v))})
    layer = QKVParallelLinear(H, D, 8, 2, bias=True, prefix="a.qkv_proj", part_names=names, quant_config=qc)
    for i, t in enumerate((q, k, v)):
        layer.weight_loader("weight", t, i)
    bias = rng.standard_normal(12 * D)
    start = 0
    for i, n in enumerate(names):
        rows = layer.output_partition_sizes[i]
        layer.weight_loader("bias", T(bias[start:start + rows]), i)
        start += rows
    assert layer.missing() == []
    # on the CPU the parts are the loaded tensors themselves
    assert [p.data_ptr for p in layer.weight_parts] == [t.data_ptr for t in (q, k, v)]

    x = rng.standard_normal((M, H))
    ref = as_kernel_sees(x, "q4_k") @ np.concatenate([qd, kd, vd]).T + bias
    got = layer(T(x)).numpy()
    assert got.shape == (M, 12 * D)
    assert len(no_dequantize) == 3 and [c[1] for c in no_dequantize] == ["q4_k", "q4_k", "q6_k"]
    # on the CPU the three parts are one quant_linear_parts call (x quantized once, one parallel region)
    assert [c[2] for c in no_dequantize] == ["parts"] * 3
    assert rel_l2(got, ref) < REL_L2, rel_l2(got, ref)
    # into a caller's out
    out = tallow.empty([M, 12 * D], tallow.float32, "cpu")
    assert layer(T(x), out=out).data_ptr == out.data_ptr
    assert rel_l2(out.numpy(), ref) < REL_L2


def test_same_type_parts_are_views_on_cpu(rng, no_dequantize):
    H = 256
    g, gd = blocks(rng, "q8_0", 96, H)
    u, ud = blocks(rng, "q8_0", 96, H)
    qc = get_quantization_config("gguf", weight_dtypes={"m.gate_proj.weight": g.dtype, "m.up_proj.weight": u.dtype})
    layer = MergedColumnParallelLinear(H, [96, 96], prefix="m.gate_up_proj", part_names=["m.gate_proj", "m.up_proj"],
                                       quant_config=qc)
    layer.weight_loader("weight", g, 0)
    layer.weight_loader("weight", u, 1)
    assert layer.weight is None and [p.data_ptr for p in layer.weight_parts] == [g.data_ptr, u.data_ptr]
    x = rng.standard_normal((3, H))
    assert rel_l2(layer(T(x)).numpy(), as_kernel_sees(x, "q8_0") @ np.concatenate([gd, ud]).T) < REL_L2


@pytest.mark.parametrize("M", [1, 4])
def test_gated_mlp_with_mixed_parts(rng, no_dequantize, M):
    H, I = 256, 512
    g, gd = blocks(rng, "q4_k", I, H)
    u, ud = blocks(rng, "q6_k", I, H)
    d, dd = blocks(rng, "q6_k", H, I)
    dtypes = {"mlp.gate_proj.weight": g.dtype, "mlp.up_proj.weight": u.dtype, "mlp.down_proj.weight": d.dtype}
    mlp = GatedMLP(H, I, "silu", prefix="mlp.", quant_config=get_quantization_config("gguf", weight_dtypes=dtypes))
    mlp.gate_up_proj.weight_loader("weight", g, 0)
    mlp.gate_up_proj.weight_loader("weight", u, 1)
    mlp.down_proj.weight_loader("weight", d, None)
    x = rng.standard_normal((M, H)) * 0.05
    xq = as_kernel_sees(x, "q4_k")
    a, b = xq @ gd.T, xq @ ud.T
    ref = as_kernel_sees(a * (0.5 + 0.5 * np.tanh(a / 2)) * b, "q6_k") @ dd.T  # silu(a) * b without overflow
    got = mlp(T(x)).numpy()
    assert [c[1] for c in no_dequantize] == ["q4_k", "q6_k", "q6_k"]
    assert rel_l2(got, ref) < REL_L2, rel_l2(got, ref)


@pytest.mark.parametrize("name", ["q4_k", "iq4_nl"])
def test_tied_lm_head_on_block_token_table(rng, no_dequantize, name):
    V, H = 300, 256
    table, td = blocks(rng, name, V, H)
    qc = get_quantization_config("gguf", weight_dtypes={"model.embed_tokens.weight": table.dtype})
    emb = VocabParallelEmbedding(V, H, quant_config=qc)
    head = ParallelLMHead(V, H, tied_to=emb, quant_config=qc)
    emb.weight_loader("weight", table)
    emb.process_weights_after_loading()
    head.process_weights_after_loading()
    assert emb.weight.data_ptr == table.data_ptr and head.weight.data_ptr == table.data_ptr
    ids = rng.integers(0, V, size=7)
    np.testing.assert_array_equal(emb(tallow.from_numpy(ids.astype(np.int64))).numpy(), td[ids].astype(np.float32))
    h = rng.standard_normal((2, H))
    assert rel_l2(head(T(h)).numpy(), as_kernel_sees(h, name) @ td.T) < REL_L2
    assert [c[1] for c in no_dequantize] == [name]
