"""GGUF dequantization: bit-exact against the gguf package's numpy dequantizers on random blocks.

Blocks are random bytes whose scale fields (d, dmin, m, s) are overwritten with finite f16 values of
moderate magnitude (f32 d for Q8_K), so every quant/scale bit pattern is exercised and NaN is never
expected. Fresh randomness each run (the `rng` fixture prints its seed).
"""
import numpy as np
import pytest

import tallow
from tallow import _core

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as GT  # noqa: E402
import gguf.quants  # noqa: E402

QK_K = 256

from backend_ops.cases_dequant import BLOCKS, random_blocks  # noqa: E402
TYPES = list(BLOCKS)


def reference(raw, name):
    """float32 [rows, K] reference dequantization of (rows, bytes) uint8 blocks."""
    bs, ts, _, _ = BLOCKS[name]
    rows = raw.shape[0]
    if name == "q8_1":
        # gguf has no Q8_1 dequantizer; by hand, as ggml's block_q8_1 (f16 d, f16 s, 32 x int8) reads:
        # y = d * q (s = d * sum(q) is only used by dot products).
        b = raw.reshape(-1, ts)
        d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
        q = b[:, 4:].copy().view(np.int8).astype(np.float32)
        return (q * d).reshape(rows, -1)
    if name == "q8_k":
        # gguf has no Q8_K dequantizer; by hand, as ggml's dequantize_row_q8_K:
        # block_q8_K = f32 d, 256 x int8 qs, 16 x int16 bsums; y = d * q.
        b = raw.reshape(-1, ts)
        d = b[:, 0:4].copy().view(np.float32)
        q = b[:, 4:4 + QK_K].copy().view(np.int8).astype(np.float32)
        return (q * d).reshape(rows, -1)
    return gguf.quants.dequantize(raw, getattr(GT, name.upper()))


def f32_to_bf16_rne(x):
    """float32 -> bfloat16 (round to nearest even), returned widened back to float32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def block_tensor(raw, name):
    bs, ts, _, _ = BLOCKS[name]
    rows = raw.shape[0]
    return tallow.from_buffer(raw, dtype=name, shape=[rows, raw.shape[1] // ts * bs])


def test_block_table_matches_gguf():
    for name, (bs, ts, _, _) in BLOCKS.items():
        # gguf's table still lists Q8_1 as (32, 40), ggml's old layout with f32 d and s; ggml-common.h
        # now has f16 d and s (36 bytes), which tallow follows. Q8_1 never appears in GGUF files.
        if name != "q8_1":
            assert tuple(gguf.GGML_QUANT_SIZES[getattr(GT, name.upper())]) == (bs, ts), name
        dt = getattr(tallow.DType, name)
        assert (dt.block_size, dt.is_block) == (bs, True), name


@pytest.mark.parametrize("name", TYPES)
def test_dequant_bit_exact(name, rng):
    rows, nblocks = int(rng.integers(3, 8)), int(rng.integers(2, 10))
    raw = random_blocks(rng, name, rows, nblocks)
    ref = reference(raw, name)
    assert not np.isnan(ref).any()
    q = block_tensor(raw, name)
    assert q.dtype == getattr(tallow.DType, name)
    out = _core.dequantize(q)
    assert out.dtype == tallow.float32 and tuple(out.shape) == ref.shape
    np.testing.assert_array_equal(out.numpy(), ref)
    # Tensor.to and ops.cast take the same path.
    np.testing.assert_array_equal(q.to("float32").numpy(), ref)
    np.testing.assert_array_equal(tallow.ops.cast(q, "float32").numpy(), ref)


@pytest.mark.parametrize("name", TYPES)
def test_dequant_many_rows_long_rows(name, rng):
    # Long rows (K over the kernel's 4096-element work item, not a multiple of it) and enough rows
    # that every thread gets work.
    bs = BLOCKS[name][0]
    nblocks = (4096 + 1280) // bs
    raw = random_blocks(rng, name, 37, nblocks)
    np.testing.assert_array_equal(_core.dequantize(block_tensor(raw, name)).numpy(), reference(raw, name))


@pytest.mark.parametrize("name", TYPES)
def test_dequant_f16_bf16(name, rng):
    raw = random_blocks(rng, name, 5, int(rng.integers(2, 6)) * (256 // BLOCKS[name][0]))
    ref = reference(raw, name)
    q = block_tensor(raw, name)
    o16 = _core.dequantize(q, "float16")
    assert o16.dtype == tallow.float16
    np.testing.assert_array_equal(o16.numpy(), ref.astype(np.float16))
    obf = _core.dequantize(q, dtype="bfloat16")
    assert obf.dtype == tallow.bfloat16
    np.testing.assert_array_equal(np.asarray(obf), f32_to_bf16_rne(ref))
    np.testing.assert_array_equal(np.asarray(q.to("bfloat16")), f32_to_bf16_rne(ref))


@pytest.mark.parametrize("name", ["q4_0", "q5_1", "q8_0", "q3_k", "q4_k", "q6_k", "q8_k"])
def test_dequant_strided(name, rng):
    bs, ts, _, _ = BLOCKS[name]
    raw = random_blocks(rng, name, 12, 3)
    ref = reference(raw, name)
    K = 3 * bs
    q = block_tensor(raw, name)
    # Every other row, from row 1: leading stride 2*K, offset K (whole blocks).
    sliced = q.slice(0, 1, 12, 2)
    assert not sliced.is_contiguous()
    np.testing.assert_array_equal(_core.dequantize(sliced).numpy(), ref[1::2])
    # A permuted 3-D view (leading dims swapped, last dim still contiguous).
    q3 = tallow.from_buffer(raw, dtype=name, shape=[3, 4, K]).permute(1, 0, 2)
    np.testing.assert_array_equal(_core.dequantize(q3).numpy(), ref.reshape(3, 4, K).transpose(1, 0, 2))
    # A column range of whole blocks.
    cols = q.narrow(1, bs, 2 * bs)
    np.testing.assert_array_equal(_core.dequantize(cols, "float16").numpy(), ref[:, bs:3 * bs].astype(np.float16))


def test_dequant_empty(rng):
    raw = np.zeros((0, 18), np.uint8)
    out = _core.dequantize(tallow.from_buffer(raw, dtype="q4_0", shape=[0, 32]))
    assert tuple(out.shape) == (0, 32)


def test_dequant_bad_input(rng):
    x = tallow.tensor(rng.standard_normal((4, 32)).astype(np.float32))
    with pytest.raises(TypeError, match=r"dequantize.*float32.*\[4, 32\]"):
        _core.dequantize(x)
    u8 = tallow.from_numpy(np.zeros((2, 18), np.uint8))
    with pytest.raises(TypeError, match="dequantize"):
        _core.dequantize(u8)
    q = block_tensor(random_blocks(rng, "q4_0", 2, 1), "q4_0")
    for bad in ("int32", "float8_e4m3", "q8_0"):
        with pytest.raises(TypeError, match=r"dequantize.*output dtype.*\[2, 32\]"):
            _core.dequantize(q, bad)
    # A block tensor whose last dim is not whole blocks cannot be built at all.
    with pytest.raises(ValueError, match=r"q4_0 tensor \[2, 16\].*block size 32"):
        tallow.from_buffer(np.zeros(18, np.uint8), dtype="q4_0", shape=[2, 16])
    with pytest.raises(ValueError, match=r"q4_k tensor \[4, 128\].*block size 256"):
        tallow.from_buffer(np.zeros(288, np.uint8), dtype="q4_k", shape=[4, 128])
    with pytest.raises(ValueError, match="from_buffer"):
        tallow.from_buffer(np.zeros(36, np.uint8), dtype="q4_0", shape=[2, 48])
    # Slicing inside a block is refused too.
    with pytest.raises(ValueError, match="block"):
        q.narrow(1, 0, 16)
