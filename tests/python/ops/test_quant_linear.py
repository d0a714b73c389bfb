"""quant_linear: x @ dequantize(w)^T (+ bias) with w kept in its GGUF block format (CPU).

Weights: random floats quantized with the gguf package (gguf.quants.quantize) where it has a quantizer
(q4_0, q4_1, q5_0, q5_1, q8_0); for the other types random blocks with scale fields of realistic magnitude.
Each product test runs on the default CPU kernel set, on avx2 and on portable where available. Inputs are
fresh random normals every run (the `rng` fixture prints its seed).

Two paths, two bounds per output element, ref = the float64 product of the same operands:
 * prefill (M > 4 rows of x; and q8_1 / q8_k weights): |out - ref| <= 4 K 2^-24 (|x| @ |w|^T) (+ one
   rounding of |ref| for f16/bf16 outputs): f32 sums of K products; bit-identical to linear(x, dequantize(w)).
 * decode (M <= 4, every other type): x is quantized to 8 bits per block of B = 32 (B = 256 for the
   K-quants and IQ4_XS) elements, x_k -> d q_k with d = max|x| / 127 over the block and |x_k - d q_k| <= d / 2
   (<= 0.57 d when d is kept in f16, as llama.cpp's q8_0 does: 127 * 2^-11 more). So
   |out - ref| <= 0.6 * sum_k d(k) |w_k| + the f32 term above: any correct 8-bit-activation kernel meets it.
   On the CPU the kernel is also checked against an emulation of its own activation quantization
   (q = nearest-even(x * 127 / max|x|), f32): then only f32 rounding remains, (K/32 + 8) 2^-20 of
   |x| @ |w|^T, tight enough that one wrong 16-element sub-scale or nibble fails it.
"""
import numpy as np
import pytest

import tallow
import tallow.cuda as tc
from tallow import _core, ops

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as GT  # noqa: E402
import gguf.quants  # noqa: E402

from backend_ops.cases_dequant import BLOCKS  # noqa: E402
from q8_activations import act_block, quantize_act  # noqa: E402

TYPES = list(BLOCKS)
QUANTIZABLE = {"q4_0", "q4_1", "q5_0", "q5_1", "q8_0"}


def make_weight(rng, name, n, k):
    """(raw uint8 [n, bytes], f32 reference dequantization [n, k])."""
    bs, ts, f16_at, f32_at = BLOCKS[name]
    assert k % bs == 0
    if name in QUANTIZABLE:
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        raw = np.ascontiguousarray(gguf.quants.quantize(w, getattr(GT, name.upper())))
    else:
        raw = rng.integers(0, 256, size=(n, k // bs, ts), dtype=np.uint8)
        for off in f16_at:
            v = (rng.uniform(0.5, 2.0, size=(n, k // bs)) * 1e-2).astype(np.float16)
            raw[:, :, off:off + 2] = v.view(np.uint8).reshape(n, k // bs, 2)
        for off in f32_at:
            v = (rng.uniform(0.5, 2.0, size=(n, k // bs)) * 1e-3).astype(np.float32)
            raw[:, :, off:off + 4] = v.view(np.uint8).reshape(n, k // bs, 4)
        raw = raw.reshape(n, -1)
    assert raw.shape == (n, k // bs * ts)
    return raw, reference_dequant(raw, name)


def reference_dequant(raw, name):
    bs, ts, _, _ = BLOCKS[name]
    rows = raw.shape[0]
    b = raw.reshape(-1, ts)
    if name == "q8_1":  # f16 d, f16 s, 32 x int8: y = d * q (gguf has no Q8_1 dequantizer)
        d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
        return (b[:, 4:].copy().view(np.int8).astype(np.float32) * d).reshape(rows, -1)
    if name == "q8_k":  # f32 d, 256 x int8, 16 x int16 bsums: y = d * q
        d = b[:, 0:4].copy().view(np.float32)
        return (b[:, 4:260].copy().view(np.int8).astype(np.float32) * d).reshape(rows, -1)
    return gguf.quants.dequantize(raw, getattr(GT, name.upper())).astype(np.float32)


def block_tensor(raw, name):
    bs, ts, _, _ = BLOCKS[name]
    return tallow.from_buffer(raw, dtype=name, shape=[raw.shape[0], raw.shape[1] // ts * bs])


def check(out, x64, wref, bias=None, dtype_eps=0.0, act=0, emulate=True):
    """out (numpy) against float64 x @ wref^T (+ bias) within the module's bound; act: the activation block
    of the decode path (0: prefill). emulate: also the tight check against the emulated quantization."""
    w64 = wref.astype(np.float64)
    ref = x64 @ w64.T
    scale = np.abs(x64) @ np.abs(w64).T
    if bias is not None:
        ref = ref + bias.astype(np.float64)
        scale = scale + np.abs(bias.astype(np.float64))
    K = x64.shape[-1]
    bound = 4 * K * 2.0 ** -24 * scale + dtype_eps * np.abs(ref) + 1e-30
    if act:
        d, xq = quantize_act(x64, act)
        bound = bound + 0.6 * (d @ np.abs(w64).T)
    err = np.abs(out.astype(np.float64) - ref)
    assert out.shape == ref.shape
    assert np.all(err <= bound), f"max err/bound {np.max(err / bound):.3g}"
    if act and emulate:
        refq = xq @ w64.T + (0 if bias is None else bias.astype(np.float64))
        tight = (K / 32 + 8) * 2.0 ** -20 * scale + dtype_eps * np.abs(ref) + 1e-30
        errq = np.abs(out.astype(np.float64) - refq)
        assert np.all(errq <= tight), f"vs emulated 8-bit x: max err/bound {np.max(errq / tight):.3g}"
    return float(np.max(err / bound))


@pytest.fixture(params=["default", "avx2", "portable"])
def isa(request):
    first = _core._cpu_isa()
    if request.param != "default" and not _core._set_cpu_isa(request.param):
        pytest.skip(f"kernel set {request.param} not available")
    yield _core._cpu_isa()
    _core._set_cpu_isa(first)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("M", [1, 3, 4, 5, 16, 17, 40])
def test_quant_linear_every_type(name, M, rng, isa):
    bs = BLOCKS[name][0]
    K = 512 if bs == 256 else 32 * int(rng.integers(5, 20))
    N = 67  # not a multiple of any tile (tiles are multiples of 8 rows)
    raw, wref = make_weight(rng, name, N, K)
    w = block_tensor(raw, name)
    x = rng.standard_normal((M, K)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    out = ops.quant_linear(tallow.tensor(x), w, tallow.tensor(bias))
    assert out.dtype == tallow.float32 and tuple(out.shape) == (M, N)
    act = act_block(name, M)
    check(out.numpy(), x.astype(np.float64), wref, bias, act=act)
    # The row routines in use (AVX2 or reference) are bit-exact with gguf's dequantizers.
    np.testing.assert_array_equal(ops.dequantize(w).numpy(), wref)
    out_nb = ops.quant_linear(tallow.tensor(x), w)
    check(out_nb.numpy(), x.astype(np.float64), wref, act=act)
    if not act:
        # Prefill sums each output as linear sums it (packed path, whatever the tiles): bit-identical to
        # linear on the dequantized weight.
        np.testing.assert_array_equal(out_nb.numpy(), ops.linear(tallow.tensor(x), ops.dequantize(w)).numpy())


@pytest.mark.parametrize("name", TYPES)
def test_row_routines_bit_exact_any_scale(name, rng, isa):
    # Random bytes with scales from f16 subnormals (2^-20) to ~8, both signs, some zeros (as
    # test_dequant.py): every vectorized row routine matches gguf's dequantizer bit for bit.
    bs, ts, f16_at, f32_at = BLOCKS[name]
    rows, nb = 7, (4096 + 1280) // bs
    raw = rng.integers(0, 256, size=(rows, nb, ts), dtype=np.uint8)
    n = rows * nb
    for off in f16_at:
        v = rng.standard_normal(n) * np.exp2(rng.integers(-20, 3, size=n))
        v[rng.random(n) < 0.02] = 0.0
        raw[:, :, off:off + 2] = v.astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    for off in f32_at:
        v = (rng.standard_normal(n) * np.exp2(rng.integers(-30, 3, size=n))).astype(np.float32)
        raw[:, :, off:off + 4] = v.view(np.uint8).reshape(rows, nb, 4)
    raw = raw.reshape(rows, -1)
    np.testing.assert_array_equal(ops.dequantize(block_tensor(raw, name)).numpy(), reference_dequant(raw, name))


@pytest.mark.parametrize("name", ["q4_0", "q4_1", "q8_0", "q4_k", "q6_k", "q5_k"])
@pytest.mark.parametrize("M", [1, 5, 16, 64, 256])
def test_quant_linear_model_shapes(name, M, rng):
    # Larger N and K (many tiles on every thread), as a model's projections are.
    bs = BLOCKS[name][0]
    K, N = (768, 1000) if bs == 32 else (1536, 517)
    raw, wref = make_weight(rng, name, N, K)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = block_tensor(raw, name)
    out = ops.quant_linear(tallow.tensor(x), w)
    check(out.numpy(), x.astype(np.float64), wref, act=act_block(name, M))
    if not act_block(name, M):
        np.testing.assert_array_equal(out.numpy(), ops.linear(tallow.tensor(x), ops.dequantize(w)).numpy())


@pytest.mark.parametrize("M", [1, 3, 17, 100])
def test_strided_and_batched_x(M, rng):
    name, K, N = "q4_1", 256, 45
    raw, wref = make_weight(rng, name, N, K)
    w = block_tensor(raw, name)
    big = rng.standard_normal((M, K + 40)).astype(np.float32)
    xs = tallow.tensor(big).narrow(1, 24, K)  # rows 296 floats apart
    assert M == 1 or not xs.is_contiguous()
    check(ops.quant_linear(xs, w).numpy(), big[:, 24:24 + K].astype(np.float64), wref, act=act_block(name, M))
    # Every other row of a 3-D x (rows not evenly spaced after merging: copied once).
    x3 = rng.standard_normal((2, 2 * M, K)).astype(np.float32)
    v = tallow.tensor(x3).slice(1, 0, 2 * M, 2)
    out = ops.quant_linear(v, w)
    assert tuple(out.shape) == (2, M, N)
    check(out.numpy().reshape(-1, N), x3[:, ::2].reshape(-1, K).astype(np.float64), wref, act=act_block(name, 2 * M))
    # A 1-D x.
    x1 = rng.standard_normal(K).astype(np.float32)
    o1 = ops.quant_linear(tallow.tensor(x1), w)
    assert tuple(o1.shape) == (N,)
    check(o1.numpy()[None], x1[None].astype(np.float64), wref, act=act_block(name, 1))


def test_strided_w_rows(rng):
    # Every other row of w, and a block-aligned column range of w (with x of that width).
    name, K, N = "q8_0", 320, 90
    raw, wref = make_weight(rng, name, N, K)
    w = block_tensor(raw, name)
    x = rng.standard_normal((3, K)).astype(np.float32)
    out = ops.quant_linear(tallow.tensor(x), w.slice(0, 1, N, 2))
    check(out.numpy(), x.astype(np.float64), wref[1::2], act=act_block(name, 3))
    xn = rng.standard_normal((20, 128)).astype(np.float32)
    out = ops.quant_linear(tallow.tensor(xn), w.narrow(1, 64, 128))
    check(out.numpy(), xn.astype(np.float64), wref[:, 64:192])


@pytest.mark.parametrize("dtype,eps", [("float16", 2.0 ** -11), ("bfloat16", 2.0 ** -8)])
@pytest.mark.parametrize("M", [2, 40])
def test_half_inputs(dtype, eps, M, rng):
    name, K, N = "q4_k", 512, 70
    raw, wref = make_weight(rng, name, N, K)
    x = tallow.tensor(rng.standard_normal((M, K)).astype(np.float32), dtype=dtype)
    b = tallow.tensor(rng.standard_normal(N).astype(np.float32), dtype=dtype)
    out = ops.quant_linear(x, block_tensor(raw, name), b)
    assert out.dtype == getattr(tallow, dtype)
    x64 = x.to("float32").numpy().astype(np.float64)
    check(out.to("float32").numpy(), x64, wref, b.to("float32").numpy(), dtype_eps=eps, act=act_block(name, M))


def test_float_weight_is_linear(rng):
    x = tallow.tensor(rng.standard_normal((5, 48)).astype(np.float32))
    w = tallow.tensor(rng.standard_normal((7, 48)).astype(np.float32))
    b = tallow.tensor(rng.standard_normal(7).astype(np.float32))
    np.testing.assert_array_equal(ops.quant_linear(x, w, b).numpy(), ops.linear(x, w, b).numpy())


def test_independent_of_threads(rng):
    name, K, N = "q4_1", 576, 300
    raw, _ = make_weight(rng, name, N, K)
    w = block_tensor(raw, name)
    x = tallow.tensor(rng.standard_normal((64, K)).astype(np.float32))
    x1 = tallow.tensor(rng.standard_normal((1, K)).astype(np.float32))
    n = _core.get_num_threads()
    try:
        ref, ref1 = ops.quant_linear(x, w).numpy(), ops.quant_linear(x1, w).numpy()
        _core.set_num_threads(1)
        np.testing.assert_array_equal(ops.quant_linear(x, w).numpy(), ref)
        np.testing.assert_array_equal(ops.quant_linear(x1, w).numpy(), ref1)
        _core.set_num_threads(3)
        np.testing.assert_array_equal(ops.quant_linear(x, w).numpy(), ref)
    finally:
        _core.set_num_threads(n)


def test_out_and_empty(rng):
    name, K, N = "q8_0", 64, 9
    raw, wref = make_weight(rng, name, N, K)
    w = block_tensor(raw, name)
    x = rng.standard_normal((4, K)).astype(np.float32)
    o = tallow.tensor(np.full((4, N), 7.0, np.float32))
    r = ops.quant_linear(tallow.tensor(x), w, out=o)
    check(o.numpy(), x.astype(np.float64), wref, act=act_block(name, 4))
    np.testing.assert_array_equal(r.numpy(), o.numpy())
    assert tuple(ops.quant_linear(tallow.tensor(np.zeros((0, K), np.float32)), w).shape) == (0, N)


def q_weight(rng, name="q4_0", n=8, k=64):
    return block_tensor(make_weight(rng, name, n, k)[0], name)


def ft(rng, shape, dtype="float32"):
    return tallow.tensor(rng.standard_normal(shape).astype(np.float32), dtype=dtype)


def test_errors(rng):
    w = q_weight(rng)  # q4_0 [8, 64]
    cases = [
        (lambda: ops.quant_linear(ft(rng, (3, 32)), w), ValueError,
         r"^quant_linear: x \[3, 32\] and w q4_0\[8, 64\]: x.shape\[-1\] = 32 must equal w.shape\[1\] = 64"),
        (lambda: ops.quant_linear(ft(rng, (3, 64)), w, ft(rng, (7,))), ValueError,
         r"^quant_linear: bias must have shape \[8\] for w q4_0\[8, 64\], got \[7\]"),
        (lambda: ops.quant_linear(ft(rng, (3, 64)), w, ft(rng, (1, 8))), ValueError,
         r"^quant_linear: bias must have shape \[8\]"),
        (lambda: ops.quant_linear(ft(rng, (3, 64)), w, ft(rng, (8,), "float16")), TypeError,
         r"^quant_linear: x .* and bias .* same dtype"),
        (lambda: ops.quant_linear(ft(rng, (3, 64)), tallow.from_numpy(np.ones((8, 64), np.int32))), TypeError,
         r"^quant_linear: w must be a GGUF block dtype .* got int32 tensor of shape \[8, 64\]"),
        (lambda: ops.quant_linear(ft(rng, (3, 64)), ft(rng, (8, 64), "bfloat16")), TypeError,
         r"^quant_linear: x \(float32\[3, 64\]\) and w \(bfloat16\[8, 64\]\)"),
        (lambda: ops.quant_linear(tallow.from_numpy(np.ones((3, 64), np.int32)), w), TypeError,
         r"^quant_linear: x must be float32, float16 or bfloat16, got int32"),
        (lambda: ops.quant_linear(w, w), TypeError, r"^quant_linear: x must be float32"),
        (lambda: ops.quant_linear(ft(rng, (3, 64)), w.unsqueeze(0)), ValueError,
         r"^quant_linear: w must be 2-D \[N, K\], got q4_0 shape \[1, 8, 64\]"),
        (lambda: ops.quant_linear(ft(rng, (3, 64)), w, out=ft(rng, (3, 9))), ValueError,
         r"^quant_linear: out has shape \[3, 9\], expected \[3, 8\]"),
    ]
    for call, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            call()


@pytest.mark.skipif(not tc.is_available(), reason="needs a CUDA device (tallow built with CUDA)")
def test_mixed_devices_raise(rng):
    w = q_weight(rng)
    x = ft(rng, (2, 64))
    with pytest.raises(ValueError, match=r"^quant_linear: tensors on different devices"):
        ops.quant_linear(x, w.to("cuda"))


# -- quant_linear_parts: the parts of a fused layer (qkv, gate_up) kept apart, one op --------------------
def concat_parts(x, parts, bias):
    """The per-part quant_linear results side by side: what quant_linear_parts must equal bit for bit."""
    outs, start = [], 0
    for p in parts:
        n = p.shape[0]
        b = None if bias is None else bias.narrow(0, start, n)
        outs.append(ops.quant_linear(x, p, b).to("float32").numpy())
        start += n
    return np.concatenate(outs, axis=-1)


@pytest.mark.parametrize("names", [("q4_k", "q4_k", "q6_k"), ("q4_1", "q4_1", "q4_1"), ("q8_0", "q4_k"),
                                   ("q4_0", "q8_1", "iq4_xs"), ("q5_k",)])
@pytest.mark.parametrize("M", [1, 3, 5])
@pytest.mark.parametrize("with_bias", [False, True])
def test_quant_linear_parts_matches_per_part(names, M, with_bias, rng, isa):
    K = 512  # a multiple of 256: every block type
    sizes = [int(rng.integers(1, 90)) for _ in names]
    made = [make_weight(rng, name, n, K) for name, n in zip(names, sizes)]
    parts = [block_tensor(raw, name) for (raw, _), name in zip(made, names)]
    x = ft(rng, (M, K))
    bias = ft(rng, (sum(sizes),)) if with_bias else None
    want = concat_parts(x, parts, bias)
    np.testing.assert_array_equal(ops.quant_linear_parts(x, parts, bias).numpy(), want)
    o = tallow.tensor(np.full((M, sum(sizes)), 7.0, np.float32))
    r = ops.quant_linear_parts(x, parts, bias, out=o)
    np.testing.assert_array_equal(o.numpy(), want)
    np.testing.assert_array_equal(r.numpy(), want)
    # against the reference product too (not only against quant_linear): the decode bound when M <= 4
    # and each part's columns against the float64 product within quant_linear's bound
    start = 0
    for (_, wref), name, n in zip(made, names, sizes):
        b = None if bias is None else bias.numpy()[start:start + n]
        check(want[:, start:start + n], x.numpy().astype(np.float64), wref, b, act=act_block(name, M))
        start += n


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_quant_linear_parts_half_and_batched(dtype, rng):
    K = 256
    parts = [q_weight(rng, "q4_k", 40, K), q_weight(rng, "q6_k", 24, K)]
    for shape in [(1, K), (2, 1, K), (3, 2, K)]:  # M = 1, 2 (decode) and 6 (per part) rows
        x = ft(rng, shape, dtype)
        got = ops.quant_linear_parts(x, parts)
        assert tuple(got.shape) == shape[:-1] + (64,) and got.dtype == x.dtype
        np.testing.assert_array_equal(got.to("float32").numpy(), concat_parts(x, parts, None))


def test_quant_linear_parts_independent_of_threads(rng):
    K = 576
    parts = [q_weight(rng, "q4_1", 200, K), q_weight(rng, "q4_1", 37, K), q_weight(rng, "q8_0", 64, K)]
    x = ft(rng, (2, K))
    n = _core.get_num_threads()
    try:
        ref = ops.quant_linear_parts(x, parts).numpy()
        for t in (1, 3):
            _core.set_num_threads(t)
            np.testing.assert_array_equal(ops.quant_linear_parts(x, parts).numpy(), ref)
    finally:
        _core.set_num_threads(n)


def test_quant_linear_parts_errors(rng):
    a, b = q_weight(rng, "q4_0", 8, 64), q_weight(rng, "q4_k", 4, 256)
    x = ft(rng, (3, 64))
    cases = [
        (lambda: ops.quant_linear_parts(x, []), ValueError,
         r"^quant_linear_parts: parts must hold at least one weight"),
        (lambda: ops.quant_linear_parts(x, [a, b]), ValueError,
         r"^quant_linear_parts: parts\[1\] must be \[N_i, K = x.shape\[-1\] = 64\], got q4_k\[4, 256\]"),
        (lambda: ops.quant_linear_parts(x, [a, a], ft(rng, (8,))), ValueError,
         r"^quant_linear_parts: bias must have shape \[16\]"),
        (lambda: ops.quant_linear_parts(x, [a, a], out=ft(rng, (3, 8))), ValueError,
         r"^quant_linear_parts: out has shape \[3, 8\], expected \[3, 16\]"),
        (lambda: ops.quant_linear_parts(tallow.from_numpy(np.ones((3, 64), np.int32)), [a]), TypeError,
         r"^quant_linear_parts: x must be float32"),
    ]
    for call, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            call()


@pytest.mark.skipif(not tc.is_available(), reason="needs a CUDA device (tallow built with CUDA)")
def test_quant_linear_parts_cpu_only(rng):
    a = q_weight(rng, "q4_0", 8, 64).to("cuda")
    with pytest.raises(ValueError, match=r"^quant_linear_parts: CPU only, x is on cuda"):
        ops.quant_linear_parts(ft(rng, (2, 64)).to("cuda"), [a, a])
