"""quantize (cpp/ops/quantize.h) on the CPU: the algorithm and the errors.

(a) q4_0 ... q8_0 bit for bit against gguf-py's numpy quantizer, on fresh random inputs of several
    kinds (normal, outliers, per-row scales from 2^-20 to 2^12 with offsets, uniform) plus edge rows
    (all-equal, zero, a single non-zero, tiny, huge, on-grid), from f32, f16 and bf16 tensors.
(b) every type: the relative RMSE of dequantize(quantize(x)) on Gaussian rows within a per-type bound
    (measured for llama.cpp's algorithm; a quantizer with a broken scale, level or packing exceeds it
    by far); quantize(dequantize(q)) == q where the algorithm guarantees it; bit-exactness against
    llama.cpp's own quantizer (ggml_quantize_chunk) when llama-cpp-python is installed or TALLOW_GGML_LIB
    names a libggml-base.so (e.g. TALLOW_GGML_LIB=/work/hb/build-cpu/bin/libggml-base.so here).
(c) the device rows are in backend_ops/cases_quantize.py (CUDA == CPU, byte for byte).
(d) bad input: K not a multiple of the block, an unsupported dtype, a non-float x.
"""
import numpy as np
import pytest

import tallow
from backend_ops.cases_quantize import (GGUF_PY_TYPES, LLAMA_TYPES, QUANT_TYPES, gguf_reference,
                                        llama_quantize_chunk, llama_reference, quantize_bytes, random_rows,
                                        special_rows)

pytest.importorskip("gguf")

KINDS = ("normal", "outliers", "scaled", "uniform")

# Bounds on ||dequantize(quantize(x)) - x|| / ||x|| for x ~ N(0, 1), 256 rows of 4096. Measured with this
# implementation of the reference algorithms (1M samples: run-to-run spread < 0.5%): q4_0 0.0859,
# q4_1 0.0783, q5_0 0.0427, q5_1 0.0379, q8_0 0.0053, q8_1 0.0053, q2_k 0.2967, q3_k 0.1510, q4_k 0.0713,
# q5_k 0.0361, q6_k 0.0177, q8_k 0.0070 (one f32 scale per 256), iq4_nl 0.0762, iq4_xs 0.0768. The bounds
# are about -5% / +8% around those: a quantizer with a wrong level count, scale or packing leaves them;
# the lower bound also catches one that silently keeps more precision than its format.
RMSE_BOUNDS = {
    "q4_0": (0.082, 0.093),
    "q4_1": (0.074, 0.085),
    "q5_0": (0.0405, 0.046),
    "q5_1": (0.036, 0.041),
    "q8_0": (0.0050, 0.0058),
    "q8_1": (0.0050, 0.0058),
    "q2_k": (0.28, 0.32),
    "q3_k": (0.143, 0.163),
    "q4_k": (0.068, 0.077),
    "q5_k": (0.034, 0.039),
    "q6_k": (0.0168, 0.0191),
    "q8_k": (0.0066, 0.0076),
    "iq4_nl": (0.072, 0.082),
    "iq4_xs": (0.073, 0.083),
}


def to_tensor(x, dtype):
    return tallow.tensor(np.ascontiguousarray(x, dtype=np.float32), dtype=dtype)


def widened(t):
    """The exact float32 values of a float tensor (what the quantizer sees)."""
    return t.to("float32").numpy().copy()


def dequantized(q_bytes, name, shape):
    bs, ts, _ = QUANT_TYPES[name]
    q = tallow.from_buffer(np.ascontiguousarray(q_bytes), dtype=name, shape=list(shape))
    return tallow.ops.dequantize(q, "float32").numpy().copy()


@pytest.mark.parametrize("name", GGUF_PY_TYPES)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_matches_gguf_py_bit_for_bit(name, dtype, rng):
    bs = QUANT_TYPES[name][0]
    for kind in KINDS:
        k = bs * int(rng.integers(1, 9))
        x = np.concatenate([random_rows(rng, int(rng.integers(5, 40)), k, kind), special_rows(rng, k, dtype)])
        t = to_tensor(x, dtype)
        got = quantize_bytes(t, name)
        want = gguf_reference(widened(t), name)
        assert got.shape == want.shape
        bad = np.nonzero((got != want).any(axis=1))[0]
        assert bad.size == 0, f"{name} from {dtype} ({kind}): rows {bad[:8]} differ from gguf-py"


@pytest.mark.parametrize("name", list(QUANT_TYPES))
def test_leading_dims_and_strides(name, rng):
    """A 3-D input, a strided view and a non-contiguous last dim give the same bytes as a 2-D contiguous copy."""
    bs = QUANT_TYPES[name][0]
    x = rng.standard_normal((3, 4, 2 * bs)).astype(np.float32)
    flat = quantize_bytes(tallow.from_numpy(x.reshape(12, 2 * bs)), name)
    q3 = tallow.ops.quantize(tallow.from_numpy(x), name)
    assert list(q3.shape) == [3, 4, 2 * bs]
    assert np.array_equal(np.array(q3.numpy(raw=True)).reshape(12, -1), flat)
    # every other row of a wider array (a leading stride)
    wide = np.repeat(x.reshape(12, 2 * bs), 2, axis=0)
    wide[1::2] = np.nan
    strided = tallow.from_numpy(wide)[0::2]
    assert np.array_equal(quantize_bytes(strided, name), flat)
    # a transposed array: the last dim is not contiguous (copied first)
    xt = tallow.from_numpy(np.ascontiguousarray(x.reshape(12, 2 * bs).T)).transpose(0, 1)
    assert np.array_equal(quantize_bytes(xt, name), flat)


@pytest.mark.parametrize("name", list(QUANT_TYPES))
def test_round_trip_error_within_bounds(name, rng):
    lo, hi = RMSE_BOUNDS[name]
    x = rng.standard_normal((256, 4096)).astype(np.float32)
    y = dequantized(quantize_bytes(tallow.from_numpy(x), name), name, x.shape)
    err = float(np.linalg.norm(y - x) / np.linalg.norm(x))
    print(f"{name}: rel RMSE {err:.4f}")
    assert lo <= err <= hi, f"{name}: rel RMSE {err:.4f} outside [{lo}, {hi}]"


@pytest.mark.parametrize("name", list(QUANT_TYPES))
def test_special_rows_are_finite_and_close(name, rng):
    """Edge rows quantize to finite values; all-equal, zero and on-grid rows come back closely."""
    bs = QUANT_TYPES[name][0]
    x = special_rows(rng, 2 * bs)
    y = dequantized(quantize_bytes(tallow.from_numpy(x), name), name, x.shape)
    assert np.isfinite(y).all()
    assert np.array_equal(y[2], np.zeros(2 * bs, np.float32)), "a zero row must stay zero"
    # constant rows (and, with 16+ levels, small integers): a few percent at most
    for i in (0, 1, 7) if name not in ("q2_k", "q3_k", "iq4_nl", "iq4_xs") else (0, 1):
        assert np.abs(y[i] - x[i]).max() <= 0.15 * np.abs(x[i]).max() + 1e-6, (name, i, y[i][:8], x[i][:8])


# quantize(dequantize(q)) == q holds exactly for the symmetric 32-blocks: their scale element comes back
# as exactly -8d / -16d / ±127d, so d is recovered bit for bit and every level sits half a step from
# its rounding edge. Not for q4_1 / q5_1 (max - min is rounded in f32, so d' may differ in its last bit),
# q8_1 (s = sum * d uses the unrounded f32 d the first time, the f16 one the second) nor the k-quants
# (the scale search may settle on another candidate for the already-quantized values).
@pytest.mark.parametrize("name", ["q4_0", "q5_0", "q8_0"])
def test_requantizing_is_exact(name, rng):
    bs = QUANT_TYPES[name][0]
    # Not the "scaled" kind: at 2^-20 a block's d underflows f16 (stored as 0 or a 1-bit subnormal), and
    # the zeros that come back re-quantize to other bytes.
    x = np.concatenate([random_rows(rng, 64, 8 * bs, kind) for kind in ("normal", "outliers", "uniform")])
    x *= np.exp2(rng.integers(-8, 9, size=(len(x), 1))).astype(np.float32)
    q = quantize_bytes(tallow.from_numpy(x), name)
    again = quantize_bytes(tallow.from_numpy(dequantized(q, name, x.shape)), name)
    bad = np.nonzero((again != q).any(axis=1))[0]
    assert bad.size == 0, f"{name}: rows {bad[:8]} changed on re-quantization"


@pytest.mark.parametrize("name", ["q4_k", "q5_k"])
def test_grouped_blocks_match_single_blocks(name, rng):
    """The CPU quantizes q4_k / q5_k blocks four at a time (wider vectors); one block alone must give the
    same bytes."""
    x = (rng.standard_normal((1, 9 * 256)) * np.exp2(rng.integers(-6, 6, size=(1, 9 * 256)))).astype(np.float32)
    together = quantize_bytes(tallow.from_numpy(x), name)
    alone = np.concatenate([quantize_bytes(tallow.from_numpy(np.ascontiguousarray(x[:, i * 256:(i + 1) * 256])), name)
                            for i in range(9)], axis=1)
    assert np.array_equal(together, alone)


def test_thread_count_does_not_change_bytes(rng):
    x = tallow.from_numpy(rng.standard_normal((64, 1024)).astype(np.float32))
    before = tallow.get_num_threads()
    try:
        tallow.set_num_threads(1)
        one = {n: quantize_bytes(x, n) for n in ("q4_0", "q4_k", "q6_k")}
        tallow.set_num_threads(max(2, before))
        for n, b in one.items():
            assert np.array_equal(quantize_bytes(x, n), b), n
    finally:
        tallow.set_num_threads(before)


@pytest.mark.parametrize("name", LLAMA_TYPES)
def test_matches_llama_cpp_bit_for_bit(name, rng):
    if llama_quantize_chunk() is None:
        from backend_ops import cases_quantize

        pytest.skip(f"no llama.cpp reference: {cases_quantize.llama_unavailable_reason}")
    bs = QUANT_TYPES[name][0]
    for kind in KINDS:
        k = bs * int(rng.integers(1, 9))
        x = np.concatenate([random_rows(rng, int(rng.integers(5, 40)), k, kind), special_rows(rng, k)])
        got = quantize_bytes(tallow.from_numpy(x), name)
        want = llama_reference(x, name)
        bad = np.nonzero((got != want).any(axis=1))[0]
        assert bad.size == 0, f"{name} ({kind}): rows {bad[:8]} differ from llama.cpp"


def test_errors_name_the_op_shape_and_type():
    x = tallow.from_numpy(np.ones((2, 48), np.float32))
    with pytest.raises(ValueError, match=r"quantize.*\[2, 48\].*q4_0.*32"):
        tallow.ops.quantize(x, "q4_0")
    with pytest.raises(ValueError, match=r"quantize.*q4_k.*256"):
        tallow.ops.quantize(tallow.from_numpy(np.ones((2, 64), np.float32)), "q4_k")
    for bad in ("float8_e4m3", "float32", "int8"):
        with pytest.raises(TypeError, match=f"quantize.*{bad}"):
            tallow.ops.quantize(tallow.from_numpy(np.ones((2, 256), np.float32)), bad)
    with pytest.raises(TypeError, match=r"quantize.*int32"):
        tallow.ops.quantize(tallow.from_numpy(np.ones((2, 32), np.int32)), "q8_0")
    with pytest.raises(ValueError):
        tallow.ops.quantize(tallow.from_numpy(np.ones((2, 32), np.float32)), "q9_9")
