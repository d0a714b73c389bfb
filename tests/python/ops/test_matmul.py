"""matmul / linear beyond the backend table: bad input raises a ValueError/TypeError naming the op and
the shapes; accuracy at a long reduction (K = 4096); results independent of the thread count; edge
shapes (K = 0, M = 0)."""
import numpy as np
import pytest

import tallow
import tallow.cuda as tc
from tallow import ops


def t(shape, dtype="float32", rng=None):
    rng = rng or np.random.default_rng(0)
    return tallow.tensor(rng.standard_normal(shape).astype(np.float32), dtype=dtype)


def ints(shape):
    return tallow.from_numpy(np.ones(shape, dtype=np.int32))


def q8_0_weight(n, k):
    """An [n, k] Q8_0 tensor (34-byte blocks of 32) over random bytes."""
    raw = np.random.default_rng(0).integers(0, 256, size=(n, k // 32 * 34), dtype=np.uint8)
    return tallow.from_numpy(raw).view_as_dtype("q8_0", [n, k])


def rel(out, ref):
    out = np.asarray(out, dtype=np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def f64(x):
    return x.to("float32").numpy().astype(np.float64)


# ---- bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize("call,exc,pattern", [
    (lambda: ops.matmul(t((3, 4)), t((5, 6))), ValueError, r"^matmul: a \[3, 4\] and b \[5, 6\]: inner dim"),
    (lambda: ops.matmul(t((2, 3, 4)), t((3, 5, 6))), ValueError, r"^matmul: a \[2, 3, 4\] and b \[3, 5, 6\]"),
    (lambda: ops.matmul(t((2, 3, 4)), t((3, 4, 6))), ValueError, r"^matmul: batch dimensions of a \[2, 3, 4\] and b \[3, 4, 6\]"),
    (lambda: ops.matmul(t((4,)), t((4, 2))), ValueError, r"^matmul: a \[4\] and b \[4, 2\] must both be at least 2-D"),
    (lambda: ops.matmul(t((3, 4)), t((4, 2), "bfloat16")), TypeError, r"^matmul: a \(float32\[3, 4\]\) and b \(bfloat16\[4, 2\]\)"),
    (lambda: ops.matmul(ints((3, 4)), ints((4, 2))), TypeError, r"^matmul: a must be float32, float16 or bfloat16, got int32"),
    (lambda: ops.matmul(q8_0_weight(4, 64), t((64, 3))), TypeError, r"^matmul: a is q8_0 .*quantized GEMMs are not supported yet"),
    (lambda: ops.matmul(t((3, 4)), t((4, 2)), out=t((3, 3))), ValueError, r"^matmul: out has shape \[3, 3\], expected \[3, 2\]"),
    (lambda: ops.matmul(t((3, 4)), t((4, 2)), out=t((3, 2), "float16")), TypeError, r"^matmul: out has dtype float16"),
    (lambda: ops.matmul(t((3, 4)), t((4, 2)), out=t((2, 3)).T), ValueError, r"^matmul: out .* must be contiguous"),
    (lambda: ops.linear(t((3, 4)), t((5, 6))), ValueError, r"^linear: x \[3, 4\] and w \[5, 6\]: x.shape\[-1\] = 4 must equal w.shape\[1\] = 6"),
    (lambda: ops.linear(t((3, 4)), t((4,))), ValueError, r"^linear: w must be 2-D \[N, K\], got shape \[4\]"),
    (lambda: ops.linear(t((3, 4)), t((5, 4)), t((4,))), ValueError, r"^linear: bias must have shape \[5\] for w \[5, 4\], got \[4\]"),
    (lambda: ops.linear(t((3, 4)), t((5, 4)), t((1, 5))), ValueError, r"^linear: bias must have shape \[5\]"),
    (lambda: ops.linear(t((3, 4)), t((5, 4), "float16")), TypeError, r"^linear: x \(float32\[3, 4\]\) and w \(float16\[5, 4\]\)"),
    (lambda: ops.linear(t((3, 4)), t((5, 4)), t((5,), "bfloat16")), TypeError, r"^linear: x .* and bias .* same dtype"),
    (lambda: ops.linear(t((3, 64)), q8_0_weight(8, 64)), TypeError, r"^linear: w is q8_0 of shape \[8, 64\]; quantized GEMMs are not supported yet"),
    (lambda: ops.linear(ints((3, 4)), ints((5, 4))), TypeError, r"^linear: x must be float"),
    (lambda: ops.linear(t((3, 4)), t((5, 4)), out=t((3, 4))), ValueError, r"^linear: out has shape \[3, 4\], expected \[3, 5\]"),
])
def test_errors(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


# ---- accuracy at K = 4096 --------------------------------------------------------------------------
# f32: the sum of K products in f32 has relative L2 error ~2^-24 * sqrt(K/6) ~ 1.6e-6 on random data
# (see backend_ops/cases_matmul.py); 1e-5 leaves >5x margin. f16/bf16: one output rounding dominates.
TOL = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3}


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("m", [1, 4, 64])
def test_linear_long_k(rng, dtype, m):
    k, n = 4096, 96
    x, w, b = t((m, k), dtype, rng), t((n, k), dtype, rng), t((n,), dtype, rng)
    ref = f64(x) @ f64(w).T + f64(b)
    assert rel(f64(ops.linear(x, w, b)), ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("m", [1, 48])
def test_matmul_long_k(rng, dtype, m):
    k, n = 4096, 80
    a, b = t((m, k), dtype, rng), t((k, n), dtype, rng)
    assert rel(f64(ops.matmul(a, b)), f64(a) @ f64(b)) <= TOL[dtype]


# ---- thread-count independence ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(1, 2048, 1024), (7, 512, 600), (200, 256, 160), (96, 128, 640)])
def test_threads(rng, dtype, shape):
    """Work is split by rows/columns, never along K, so every thread count gives the same sums; the
    check allows the f32 rounding bound anyway (the contract), which the results meet exactly today."""
    m, k, n = shape
    x, w, b = t((m, k), dtype, rng), t((n, k), dtype, rng), t((n,), dtype, rng)
    a, bb = t((2, m, k), dtype, rng), t((2, k, n), dtype, rng)
    before = tallow.get_num_threads()
    try:
        results = []
        for threads in (1, before, 3):
            tallow.set_num_threads(threads)
            results.append((f64(ops.linear(x, w, b)), f64(ops.matmul(a, bb))))
    finally:
        tallow.set_num_threads(before)
    for lin, mm in results[1:]:
        assert rel(lin, results[0][0]) <= 1e-6
        assert rel(mm, results[0][1]) <= 1e-6


# ---- edge shapes -----------------------------------------------------------------------------------
def test_empty_reduction_gives_zeros_or_bias():
    out = ops.matmul(t((3, 0)), t((0, 4)))
    assert out.shape == (3, 4) and not np.asarray(out).any()
    b = t((4,))
    y = ops.linear(t((2, 0)), t((4, 0)), b)
    np.testing.assert_array_equal(np.asarray(y), np.broadcast_to(np.asarray(b), (2, 4)))


def test_empty_rows():
    assert ops.matmul(t((0, 5)), t((5, 3))).shape == (0, 3)
    assert ops.linear(t((2, 0, 5)), t((3, 5))).shape == (2, 0, 3)
    assert ops.matmul(t((2, 0, 4, 5)), t((5, 3))).shape == (2, 0, 4, 3)


# ---- CUDA: timed algorithms shared by M buckets -----------------------------------------------------
@pytest.mark.skipif(not tc.is_available(), reason="needs a CUDA device (tallow built with CUDA)")
@pytest.mark.parametrize("bias", [False, True])
def test_cuda_linear_rows_sharing_a_tuning_bucket(rng, bias):
    """Products timed at first use (m * n * k >= 1e9) whose M lies in one bucket (1025..1280) reuse
    the first one's algorithm (cuda/gemm.cu); each stays within the bf16 bound of its own reference."""
    n, k = 1024, 1024
    w = tallow.tensor(rng.standard_normal((n, k)).astype(np.float32), dtype="bfloat16")
    b = tallow.tensor(rng.standard_normal(n).astype(np.float32), dtype="bfloat16") if bias else None
    for m in (1100, 1030, 1279, 1200):
        x = tallow.tensor(rng.standard_normal((m, k)).astype(np.float32), dtype="bfloat16")
        out = ops.linear(x.to("cuda"), w.to("cuda"), b.to("cuda") if bias else None)
        ref = f64(x) @ f64(w).T + (f64(b) if bias else 0.0)
        assert rel(f64(out.to("cpu")), ref) < 8e-3, m
