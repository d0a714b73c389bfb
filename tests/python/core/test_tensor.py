"""The Tensor type: dtypes, views, copies, numpy/DLPack interop, lifetimes and errors."""
import gc

import numpy as np
import pytest

import tallow
from tallow import _core

BLOCK_TYPES = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q8_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q8_k"]


def test_block_dtype_sizes_match_gguf():
    gguf = pytest.importorskip("gguf", reason="gguf package is the reference for block sizes")
    for name in BLOCK_TYPES:
        dt = _core.dtype(name)
        qt = gguf.GGMLQuantizationType[name.upper()]
        if name == "q8_1":
            # ggml's block_q8_1 is {f16 d, f16 s, int8 qs[32]} = 36 bytes; gguf-py's table still says
            # 40 (its old f32 layout). Q8_1 never appears in files; tallow follows ggml.
            assert (dt.block_size, dt.type_size) == (32, 36)
        else:
            assert (dt.block_size, dt.type_size) == gguf.GGML_QUANT_SIZES[qt], name
        assert dt.ggml_type == int(qt)
        assert _core.dtype_from_ggml_type(int(qt)) == dt


def test_scalar_dtypes():
    sizes = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3": 1, "int8": 1, "uint8": 1, "int32": 4,
             "int64": 8, "bool": 1}
    for name, size in sizes.items():
        dt = _core.dtype(name)
        assert dt.block_size == 1 and dt.type_size == size and not dt.is_block
    assert _core.dtype("bf16") == tallow.bfloat16
    assert _core.dtype(np.float16) == tallow.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        _core.dtype("float128x")


def test_from_numpy_is_zero_copy_both_ways(rng):
    a = rng.standard_normal((5, 7)).astype(np.float32)
    t = tallow.from_numpy(a)
    assert t.shape == (5, 7) and t.dtype == tallow.float32 and t.data_ptr == a.ctypes.data
    a[2, 3] = 42.0
    back = t.numpy()
    assert back[2, 3] == 42.0 and back.ctypes.data == a.ctypes.data
    back[0, 0] = -1.0
    assert a[0, 0] == -1.0


def test_lifetime_outlives_sources(rng):
    a = rng.standard_normal(1000).astype(np.float32)
    expected = a.copy()
    t = tallow.from_numpy(a)
    del a
    gc.collect()
    np.testing.assert_array_equal(t.numpy(), expected)
    arr = tallow.tensor(expected).numpy()  # the tensor handle dies; the array keeps its storage
    gc.collect()
    np.testing.assert_array_equal(arr, expected)


def test_strided_numpy_views(rng):
    a = rng.standard_normal((6, 8)).astype(np.float32)
    t = tallow.from_numpy(a.T)
    assert t.shape == (8, 6) and t.strides == (1, 8) and not t.is_contiguous()
    np.testing.assert_array_equal(t.numpy(), a.T)
    rev = tallow.from_numpy(a[::-1])  # negative strides: copied
    np.testing.assert_array_equal(rev.numpy(), a[::-1])


@pytest.mark.parametrize("dtype", ["float32", "float16", "int32", "int64", "int8", "uint8"])
def test_views_match_numpy(rng, dtype):
    a = (rng.standard_normal((4, 6, 10)) * 50).astype(dtype)
    t = tallow.from_numpy(a)
    cases = [
        (t.narrow(1, 2, 3), a[:, 2:5]),
        (t.slice(2, 1, 9, 3), a[:, :, 1:9:3]),
        (t.select(0, -1), a[-1]),
        (t.transpose(0, 2), a.transpose(2, 1, 0)),
        (t.permute(1, 2, 0), a.transpose(1, 2, 0)),
        (t.unsqueeze(1), a[:, None]),
        (t.view(24, 10), a.reshape(24, 10)),
        (t.view(-1), a.reshape(-1)),
        (t.transpose(0, 1).reshape(6, 40), a.transpose(1, 0, 2).reshape(6, 40)),
        (t[1:3, ::2, 5], a[1:3, ::2, 5]),
        (t[..., 0], a[..., 0]),
        (t[None, 0], a[None, 0]),
        (t.select(2, 0).unsqueeze(0).squeeze(0), a[:, :, 0]),
        (t[:, :1].expand(4, 5, 10), np.broadcast_to(a[:, :1], (4, 5, 10))),
    ]
    for i, (view, ref) in enumerate(cases):
        assert view.shape == ref.shape, i
        np.testing.assert_array_equal(view.numpy(), ref, err_msg=str(i))
        c = view.contiguous()
        assert c.is_contiguous()
        np.testing.assert_array_equal(c.numpy(), ref, err_msg=str(i))
    # views share storage
    v = t.narrow(0, 1, 1)
    v.numpy()[0, 0, 0] = 7
    assert a[1, 0, 0] == 7


def test_clone_and_copy(rng):
    a = rng.standard_normal((3, 4)).astype(np.float32)
    t = tallow.from_numpy(a)
    c = t.clone()
    assert c.data_ptr != t.data_ptr
    np.testing.assert_array_equal(c.numpy(), a)
    dst = tallow.empty([4, 3])
    dst.copy_(t.T)
    np.testing.assert_array_equal(dst.numpy(), a.T)
    with pytest.raises(ValueError, match="copy_"):
        dst.copy_(t)
    with pytest.raises(TypeError, match="copy_"):
        tallow.empty([3, 4], dtype="float16").copy_(t)


def test_f16_exhaustive_roundtrip():
    bits = np.arange(65536, dtype=np.uint16)
    h = bits.view(np.float16)
    f = tallow.from_numpy(h).to("float32").numpy()
    np.testing.assert_array_equal(np.isnan(f), np.isnan(h))
    ok = ~np.isnan(h)
    np.testing.assert_array_equal(f[ok], h[ok].astype(np.float32))
    back = tallow.from_numpy(f).to("float16").numpy()
    np.testing.assert_array_equal(back.view(np.uint16)[ok], bits[ok])


def test_f32_to_f16_matches_numpy_rounding(rng):
    # random bit patterns over the whole f16 range incl. subnormals, overflow and halfway cases
    x = np.concatenate([
        rng.standard_normal(20000) * 10.0 ** rng.integers(-9, 6, 20000),
        (np.arange(-2048, 2048) * 2.0 ** -25),  # f16 subnormal halfway points
        [65504.0, 65519.9, 65520.0, 1e6, -1e6, np.inf, -np.inf, 0.0, -0.0],
    ]).astype(np.float32)
    got = tallow.from_numpy(x).to("float16").numpy()
    with np.errstate(over="ignore"):
        ref = x.astype(np.float16)
    np.testing.assert_array_equal(got.view(np.uint16), ref.view(np.uint16))


def bf16_reference(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even f32 -> bf16 bits, in numpy integer arithmetic."""
    u = x.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), ((u >> 16) | 0x40).astype(np.uint16), rounded)


def test_bf16_rounding(rng):
    x = (rng.standard_normal(50000) * 10.0 ** rng.integers(-30, 30, 50000)).astype(np.float32)
    x[:4] = [np.inf, -np.inf, 3.0e38, -0.0]
    t = tallow.from_numpy(x).to("bfloat16")
    np.testing.assert_array_equal(t.numpy(raw=True), bf16_reference(x))
    back = t.to("float32").numpy()
    np.testing.assert_array_equal(back.view(np.uint32), bf16_reference(x).astype(np.uint32) << 16)


def f8e4m3_table() -> np.ndarray:
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    e, m = (codes >> 3) & 0xF, codes & 7
    val = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7.0)) * sign
    val[(e == 15) & (m == 7)] = np.nan
    return val


def test_f8e4m3_exhaustive_and_rounding(rng):
    table = f8e4m3_table()
    codes = np.arange(256, dtype=np.uint8)
    dec = tallow.from_buffer(codes, "float8_e4m3", [256]).to("float32").numpy()
    np.testing.assert_array_equal(np.isnan(dec), np.isnan(table))
    ok = ~np.isnan(table)
    np.testing.assert_array_equal(dec[ok], table[ok])
    # f32 -> f8: nearest representable, ties to even code, saturating at ±448
    x = (rng.standard_normal(20000) * 10.0 ** rng.integers(-4, 3, 20000)).astype(np.float32)
    x = np.concatenate([x, table[ok].astype(np.float32), [1000.0, -1000.0, 464.0, 2.0 ** -10]]).astype(np.float32)
    got = tallow.from_numpy(x).to("float8_e4m3").numpy(raw=True)
    finite = np.where(ok)[0]
    vals = table[finite]
    order = np.argsort(vals, kind="stable")
    vals, finite = vals[order], finite[order]
    for xi, gi in zip(x, got):
        xc = float(np.clip(xi, -448.0, 448.0))
        dist = np.abs(vals - xc)
        best = finite[dist == dist.min()]
        if len(best) > 1:  # tie: even mantissa, and +0 over -0
            best = [b for b in best if b % 2 == 0 and not (xc == 0 and b == 0x80)] or best
        assert table[gi] == table[best[0]] or (xc == 0 and table[gi] == 0), (xi, gi, best)


def test_array_protocol_for_bf16(rng):
    a = rng.standard_normal((3, 5)).astype(np.float32)
    t = tallow.tensor(a, dtype="bfloat16")
    arr = np.asarray(t)
    assert arr.dtype == np.float32 and arr.shape == (3, 5)
    np.testing.assert_allclose(arr, a, rtol=2 ** -8)
    with pytest.raises(TypeError, match="numpy"):
        t.numpy()


def test_dlpack_numpy_roundtrip(rng):
    a = rng.standard_normal((4, 3)).astype(np.float32)
    t = tallow.from_dlpack(a)
    assert t.data_ptr == a.ctypes.data
    b = np.from_dlpack(t)
    assert b.ctypes.data == a.ctypes.data
    np.testing.assert_array_equal(b, a)
    s = np.from_dlpack(tallow.from_numpy(a).T)
    np.testing.assert_array_equal(s, a.T)


def test_dlpack_torch_bf16(rng):
    torch = pytest.importorskip("torch", reason="torch is the only DLPack peer here with bf16")
    x = torch.randn(6, 4, dtype=torch.bfloat16)
    t = tallow.from_dlpack(x)
    assert t.dtype == tallow.bfloat16 and t.shape == (6, 4)
    np.testing.assert_array_equal(t.to("float32").numpy(), x.float().numpy())
    y = torch.from_dlpack(t)
    assert y.data_ptr() == x.data_ptr()


def test_block_tensor_from_buffer(rng):
    raw = rng.integers(0, 256, 3 * 2 * 18, dtype=np.uint8)
    t = tallow.from_buffer(raw, "q4_0", [3, 64])
    assert t.dtype == _core.dtype("q4_0") and t.shape == (3, 64) and t.nbytes == raw.nbytes
    np.testing.assert_array_equal(t.numpy(raw=True).reshape(-1), raw)
    row = t.select(0, 1)
    np.testing.assert_array_equal(row.numpy(raw=True), raw[36:72])
    with pytest.raises(ValueError, match="block"):
        tallow.from_buffer(raw[:54], "q4_0", [3, 48])
    with pytest.raises(ValueError, match="from_buffer"):
        tallow.from_buffer(raw, "q4_0", [3, 32])
    with pytest.raises(ValueError, match="split"):
        t.narrow(1, 16, 32)


def test_errors_name_the_op():
    t = tallow.empty([4, 6])
    with pytest.raises(ValueError, match="not contiguous"):
        t.T.view(24)
    with pytest.raises(IndexError, match="narrow"):
        t.narrow(0, 2, 5)
    with pytest.raises(ValueError, match="view"):
        t.view(5, 5)
    with pytest.raises(ValueError, match="add: shapes \\[4, 6\\] and \\[5\\]"):
        tallow.ops.add(t, tallow.empty([5]))
    with pytest.raises(TypeError, match="add"):
        tallow.ops.add(t, tallow.empty([4, 6], dtype="float16"))
    with pytest.raises(ValueError, match="invalid device"):
        tallow.empty([2], device="tpu")
    with pytest.raises(ValueError, match="negative"):
        tallow.empty([-1, 2])


def test_repr_and_threads(rng):
    t = tallow.tensor(rng.standard_normal((2, 3)), dtype="float16")
    r = repr(t)
    assert "shape=[2, 3]" in r and "float16" in r and "cpu" in r
    n = tallow.get_num_threads()
    try:
        tallow.set_num_threads(1)
        assert tallow.get_num_threads() == 1
    finally:
        tallow.set_num_threads(n)
    assert tallow.get_num_threads() == n
