"""The linear layers (layers/linear.py) and their quantization methods (layers/quantization), on the CPU.

Tensor-parallel shard arithmetic is checked at tp_size 2 without communication: each rank's layer loads
its shard of the same checkpoint tensors, and the ranks' products put together (concatenated for
column-parallel layers, summed for row-parallel ones) equal the tp_size 1 product. The fused checkpoint
forms (Phi-3's qkv_proj, gate_up_proj) load the same rows as the separate tensors. GGUF block weights
stay in their block type and give the product of their dequantized values."""
import numpy as np
import pytest

import tallow
from tallow import ops
from tallow.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from tallow.layers.quantization import config_for_checkpoint, get_quantization_config
from tallow.layers.quantization.gguf import GGUFLinearMethod
from tallow.layers.quantization.unquantized import UnquantizedLinearMethod

H = 64


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def T(a):
    return tallow.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


def A(t):
    return np.asarray(t.numpy(), dtype=np.float32)


def _load(layer, names_tensors):
    cmap = layer.checkpoint_map()
    for name, t in names_tensors.items():
        param, shard = cmap[name]
        layer.weight_loader(param, T(t), shard)
    assert layer.missing() == []


def test_column_parallel_shards_concatenate(rng):
    w, b = rng.standard_normal((96, H)), rng.standard_normal(96)
    x = T(rng.standard_normal((5, H)))
    full = ColumnParallelLinear(H, 96, True, prefix="p")
    _load(full, {"p.weight": w, "p.bias": b})
    ranks = [ColumnParallelLinear(H, 96, True, prefix="p", tp_rank=r, tp_size=2) for r in range(2)]
    for layer in ranks:
        assert tuple(layer.weight.shape) == (48, H) and layer.tp_size == 2
        _load(layer, {"p.weight": w, "p.bias": b})
    np.testing.assert_allclose(np.concatenate([A(layer(x)) for layer in ranks], -1), A(full(x)), rtol=1e-5, atol=1e-5)


def test_merged_gate_up_shards_per_part_and_fused_form(rng):
    inter = 48
    g, u = rng.standard_normal((inter, H)), rng.standard_normal((inter, H))
    x = T(rng.standard_normal((3, H)))
    names = dict(prefix="m.gate_up_proj", part_names=["m.gate_proj", "m.up_proj"])
    full = MergedColumnParallelLinear(H, [inter, inter], **names)
    _load(full, {"m.gate_proj.weight": g, "m.up_proj.weight": u})
    fused = MergedColumnParallelLinear(H, [inter, inter], **names)
    _load(fused, {"m.gate_up_proj.weight": np.concatenate([g, u])})  # Phi-3 / GLM-4 store it so
    np.testing.assert_array_equal(A(fused.weight), A(full.weight))
    y = A(full(x))
    for load in ("parts", "fused"):
        outs = []
        for r in range(2):
            layer = MergedColumnParallelLinear(H, [inter, inter], tp_rank=r, tp_size=2, **names)
            if load == "parts":
                _load(layer, {"m.gate_proj.weight": g, "m.up_proj.weight": u})
            else:
                _load(layer, {"m.gate_up_proj.weight": np.concatenate([g, u])})
            outs.append(A(layer(x)))
        # each rank holds [its gate rows; its up rows]: gate = concat of the ranks' first halves
        gate = np.concatenate([o[:, :inter // 2] for o in outs], -1)
        up = np.concatenate([o[:, inter // 2:] for o in outs], -1)
        np.testing.assert_allclose(gate, y[:, :inter], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(up, y[:, inter:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_heads,n_kv,tp", [(4, 2, 2), (4, 1, 2), (8, 2, 4)])
def test_qkv_shards_by_heads_with_kv_replication(rng, n_heads, n_kv, tp):
    d = 8
    q, k, v = (rng.standard_normal((n * d, H)) for n in (n_heads, n_kv, n_kv))
    bq, bk, bv = (rng.standard_normal(n * d) for n in (n_heads, n_kv, n_kv))
    x = T(rng.standard_normal((2, H)))
    names = dict(prefix="a.qkv_proj", part_names=["a.q_proj", "a.k_proj", "a.v_proj"])
    tensors = {"a.q_proj.weight": q, "a.k_proj.weight": k, "a.v_proj.weight": v,
               "a.q_proj.bias": bq, "a.k_proj.bias": bk, "a.v_proj.bias": bv}
    full = QKVParallelLinear(H, d, n_heads, n_kv, True, **names)
    _load(full, tensors)
    y = A(full(x))
    yq, yk = y[:, :n_heads * d], y[:, n_heads * d:(n_heads + n_kv) * d]
    qs, ks = [], []
    for r in range(tp):
        layer = QKVParallelLinear(H, d, n_heads, n_kv, True, tp_rank=r, tp_size=tp, **names)
        assert layer.num_heads == n_heads // tp and layer.num_kv_heads == max(1, n_kv // tp)
        _load(layer, tensors)
        o = A(layer(x))
        qs.append(o[:, :layer.num_heads * d])
        ks.append(o[:, layer.num_heads * d:(layer.num_heads + layer.num_kv_heads) * d])
    np.testing.assert_allclose(np.concatenate(qs, -1), yq, rtol=1e-5, atol=1e-5)
    if n_kv >= tp:
        np.testing.assert_allclose(np.concatenate(ks, -1), yk, rtol=1e-5, atol=1e-5)
    else:  # each kv head on tp / n_kv consecutive ranks
        for r in range(tp):
            h = r // (tp // n_kv)
            np.testing.assert_allclose(ks[r], yk[:, h * d:(h + 1) * d], rtol=1e-5, atol=1e-5)


def test_qkv_fused_checkpoint_tensor_and_row_count_error(rng):
    d, nh, nkv = 8, 4, 2
    w = rng.standard_normal(((nh + 2 * nkv) * d, H))
    layer = QKVParallelLinear(H, d, nh, nkv, prefix="a.qkv_proj", part_names=["a.q_proj", "a.k_proj", "a.v_proj"])
    _load(layer, {"a.qkv_proj.weight": w})
    np.testing.assert_array_equal(A(layer.weight), w.astype(np.float32))
    with pytest.raises(ValueError, match=r"a\.qkv_proj\.weight: shape \[40, 64\], the config needs 64 rows"):
        layer.weight_loader("weight", T(w[:40]), None)
    with pytest.raises(ValueError, match=r"a\.k_proj\.weight: shape \[8, 64\], the config needs 16 rows"):
        layer.weight_loader("weight", T(w[:8]), 1)


def test_row_parallel_partial_products_sum(rng):
    w, b = rng.standard_normal((H, 96)), rng.standard_normal(H)
    x = rng.standard_normal((4, 96))
    full = RowParallelLinear(96, H, True, prefix="o")
    _load(full, {"o.weight": w, "o.bias": b})
    total = 0
    for r in range(2):
        layer = RowParallelLinear(96, H, True, prefix="o", tp_rank=r, tp_size=2)
        assert tuple(layer.weight.shape) == (H, 48)
        _load(layer, {"o.weight": w, "o.bias": b})
        part = A(ops.linear(T(x[:, r * 48:(r + 1) * 48]), layer.weight))  # the all-reduce's inputs
        total = total + part
    np.testing.assert_allclose(total + b.astype(np.float32), A(full(T(x))), rtol=1e-4, atol=1e-4)


def test_vocab_parallel_embedding_and_lm_head_shards(rng):
    vocab = 40
    table = rng.standard_normal((vocab, H))
    ids = tallow.from_numpy(np.array([0, 7, 39, 20], np.int64))
    full = VocabParallelEmbedding(vocab, H)
    _load(full, {"model.embed_tokens.weight": table})
    np.testing.assert_array_equal(A(full(ids)), table.astype(np.float32)[[0, 7, 39, 20]])
    rows = []
    for r in range(2):
        e = VocabParallelEmbedding(vocab, H, tp_rank=r, tp_size=2)
        _load(e, {"model.embed_tokens.weight": table})
        assert (e.vocab_start, e.vocab_end) == (20 * r, 20 * (r + 1))
        rows.append(A(e.weight))
    np.testing.assert_array_equal(np.concatenate(rows), table.astype(np.float32))
    heads = [ParallelLMHead(vocab, H, tp_rank=r, tp_size=2) for r in range(2)]
    x = T(rng.standard_normal((3, H)))
    for hd in heads:
        _load(hd, {"lm_head.weight": table})
    local = [A(hd.local_logits(x)) for hd in heads]  # each rank's vocabulary range, before the all-gather
    np.testing.assert_allclose(np.concatenate(local, -1), A(x) @ table.T.astype(np.float32),
                               rtol=1e-4, atol=1e-4)


def test_tied_lm_head_shares_the_table(rng):
    vocab = 40
    e = VocabParallelEmbedding(vocab, H)
    head = ParallelLMHead(vocab, H, tied_to=e)
    assert head.tied and head.weight is e.weight and head.checkpoint_map() == {}
    _load(e, {"model.embed_tokens.weight": rng.standard_normal((vocab, H))})
    x = T(rng.standard_normal((2, H)))
    np.testing.assert_allclose(A(head(x)), A(x) @ A(e.weight).T, rtol=1e-5, atol=1e-5)


def test_router_parts_load_under_their_own_names(rng):
    r, s = rng.standard_normal((4, H)), rng.standard_normal((1, H))
    router = ReplicatedLinear(H, [4, 1], prefix="m.gate", part_names=["m.gate", "m.shared_expert_gate"])
    assert set(router.checkpoint_map()) == {"m.gate.weight", "m.shared_expert_gate.weight"}
    assert router.missing() == ["m.gate.weight", "m.shared_expert_gate.weight"]
    _load(router, {"m.gate.weight": r, "m.shared_expert_gate.weight": s})
    np.testing.assert_array_equal(A(router.weight), np.concatenate([r, s]).astype(np.float32))


# -- GGUF blocks --------------------------------------------------------------------------------------
# ops.quant_linear may round each activation row to 8 bits per block (as llama.cpp does): a relative L2
# error of ~2^-8 / sqrt(3) per product (test_gguf_linear.py), bounded here with margin
GGUF_REL_L2 = 2e-2


def _rel_l2(got, ref):
    return float(np.linalg.norm(np.asarray(got, np.float64) - ref) / np.linalg.norm(ref))


def _q8_0(a: np.ndarray):
    gguf = pytest.importorskip("gguf")
    Q = gguf.GGMLQuantizationType
    raw = gguf.quants.quantize(np.ascontiguousarray(a, dtype=np.float32), Q.Q8_0)
    deq = gguf.quants.dequantize(raw, Q.Q8_0)
    return tallow.from_numpy(np.ascontiguousarray(raw)).view_as_dtype("q8_0", list(a.shape)), deq


def test_gguf_method_keeps_blocks_and_matches_dequantized_product(rng):
    g, u = rng.standard_normal((48, H)), rng.standard_normal((48, H))
    (gq, gd), (uq, ud) = _q8_0(g), _q8_0(u)
    dtypes = {"m.gate_proj.weight": gq.dtype, "m.up_proj.weight": uq.dtype}
    qc = get_quantization_config("gguf", weight_dtypes=dtypes)
    layer = MergedColumnParallelLinear(H, [48, 48], prefix="m.gate_up_proj", part_names=["m.gate_proj", "m.up_proj"],
                                       quant_config=qc)
    # on the CPU each part is the checkpoint tensor itself (layers/quantization/gguf.py)
    assert isinstance(layer.quant_method, GGUFLinearMethod) and [p.dtype for p in layer.weight_parts] == [gq.dtype] * 2
    cmap = layer.checkpoint_map()
    for name, t in (("m.gate_proj.weight", gq), ("m.up_proj.weight", uq)):
        layer.weight_loader(cmap[name][0], t, cmap[name][1])
    x = rng.standard_normal((3, H)).astype(np.float32)
    assert _rel_l2(A(layer(T(x))), x @ np.concatenate([gd, ud]).T) < GGUF_REL_L2
    # a float tensor of the same file takes the unquantized method
    other = ColumnParallelLinear(H, 8, prefix="n", quant_config=qc)
    assert isinstance(other.quant_method, UnquantizedLinearMethod) and other.weight.dtype == tallow.float32


def test_gguf_method_with_parts_of_different_block_types(rng):
    gguf = pytest.importorskip("gguf")
    Q = gguf.GGMLQuantizationType
    q = rng.standard_normal((32, H))
    k = rng.standard_normal((16, H))
    v = rng.standard_normal((16, H))
    qq, qd = _q8_0(q)
    raw = gguf.quants.quantize(np.ascontiguousarray(k, dtype=np.float32), Q.Q4_0)
    kq, kd = tallow.from_numpy(np.ascontiguousarray(raw)).view_as_dtype("q4_0", [16, H]), \
        gguf.quants.dequantize(raw, Q.Q4_0)
    dtypes = {"a.q_proj.weight": qq.dtype, "a.k_proj.weight": kq.dtype, "a.v_proj.weight": tallow.float32}
    qc = get_quantization_config("gguf", weight_dtypes=dtypes)
    layer = QKVParallelLinear(H, 8, 4, 2, prefix="a.qkv_proj", part_names=["a.q_proj", "a.k_proj", "a.v_proj"],
                              quant_config=qc)
    assert layer.weight is None and [p.dtype for p in layer.weight_parts] == [qq.dtype, kq.dtype, tallow.float32]
    layer.weight_loader("weight", qq, 0)
    layer.weight_loader("weight", kq, 1)
    layer.weight_loader("weight", T(v), 2)
    x = rng.standard_normal((2, H)).astype(np.float32)
    assert _rel_l2(A(layer(T(x))), x @ np.concatenate([qd, kd, v]).T) < GGUF_REL_L2


def test_checkpoint_config_choice():
    assert config_for_checkpoint(None).name == "unquantized"
    with pytest.raises(ValueError, match="unknown quantization 'bitsandbytes'"):
        get_quantization_config("bitsandbytes")
