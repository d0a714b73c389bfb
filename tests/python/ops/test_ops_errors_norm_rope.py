"""Bad input to the norm, rope, activation and softmax ops: a Python exception of the right type
whose message names the op (and the shapes), never a crash; and the defined edge cases."""
import numpy as np
import pytest

import tallow
from tallow import ops


def t(shape, dtype="float32", fill=None):
    a = np.random.default_rng(0).standard_normal(shape) if fill is None else np.full(shape, fill)
    return tallow.tensor(a.astype(np.float32), dtype=dtype)


def scalar():
    """A 0-d tensor (tallow.tensor of a 0-d array gives shape (1,), so select from a 1-D one)."""
    return t((1,))[0]


def ints(values, dtype=np.int64):
    return tallow.from_numpy(np.asarray(values, dtype=dtype))


def cache(max_pos=16, rot=8):
    return t((max_pos, rot))


# ---- rms_norm / fused_add_rms_norm / layer_norm -------------------------------------------------
@pytest.mark.parametrize("call,exc,pattern", [
    (lambda: ops.rms_norm(t((4, 8)), t((7,)), eps=1e-6), ValueError, r"^rms_norm: .*\[8\].*\[4, 8\].*\[7\]"),
    (lambda: ops.rms_norm(t((4, 8)), t((1, 8)), eps=1e-6), ValueError, r"^rms_norm: w must have shape"),
    (lambda: ops.rms_norm(t((4, 8)), t((8,), "bfloat16"), eps=1e-6), TypeError, r"^rms_norm: .*same dtype"),
    (lambda: ops.rms_norm(ints([[1, 2]]), ints([1, 2]), eps=1e-6), TypeError, r"^rms_norm: x must be float"),
    (lambda: ops.rms_norm(scalar(), t((1,)), eps=1e-6), ValueError, r"^rms_norm: x must have at least 1 dim"),
    (lambda: ops.rms_norm(t((4, 8)), t((8,)), eps=-1.0), ValueError, r"^rms_norm: eps"),
    (lambda: ops.rms_norm(t((4, 8)), t((8,)), eps=1e-6, out=t((4, 9))), ValueError, r"^rms_norm: out has shape"),
    (lambda: ops.rms_norm(t((4, 8)), t((8,)), eps=1e-6, out=t((4, 8), "float16")), TypeError, r"^rms_norm: out has dtype"),
    (lambda: ops.rms_norm(t((4, 8)), t((8,)), eps=1e-6, out=t((8, 4)).T), ValueError, r"^rms_norm: out .* contiguous"),
    (lambda: ops.fused_add_rms_norm(t((4, 8)), t((4, 9)), t((8,)), eps=1e-6), ValueError,
     r"^fused_add_rms_norm: residual has shape \[4, 9\], x has shape \[4, 8\]"),
    (lambda: ops.fused_add_rms_norm(t((4, 8)), t((8, 4)).T, t((8,)), eps=1e-6), ValueError,
     r"^fused_add_rms_norm: residual .* contiguous last dim"),
    (lambda: ops.fused_add_rms_norm(t((4, 8)), t((1, 8)).expand(4, 8), t((8,)), eps=1e-6), ValueError,
     r"^fused_add_rms_norm: residual .* broadcast"),
    (lambda: ops.fused_add_rms_norm(t((4, 8)), ints(np.zeros((4, 8))), t((8,)), eps=1e-6), TypeError,
     r"^fused_add_rms_norm: residual must be float"),
    (lambda: ops.fused_add_rms_norm(t((4, 8)), t((4, 8)), t((8,), "float16"), eps=1e-6), TypeError,
     r"^fused_add_rms_norm: .*same dtype"),
    (lambda: ops.layer_norm(t((4, 8)), t((8,)), t((5,))), ValueError, r"^layer_norm: b must have shape \[8\]"),
    (lambda: ops.layer_norm(t((4, 8)), t((8,), "float16"), None), TypeError, r"^layer_norm: .*same dtype"),
    (lambda: ops.layer_norm(ints([1, 2])), TypeError, r"^layer_norm: x must be float"),
])
def test_norm_errors(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


def test_fused_add_rms_norm_bad_input_leaves_residual_alone():
    res = t((4, 8), fill=1.0)
    with pytest.raises(TypeError):
        ops.fused_add_rms_norm(t((4, 8)), res, t((8,), "bfloat16"), eps=1e-6)
    np.testing.assert_array_equal(res.numpy(), np.ones((4, 8), np.float32))


def test_fused_add_rms_norm_x_is_residual():
    r = t((3, 16))
    before = r.numpy().copy()
    out = ops.fused_add_rms_norm(r, r, t((16,), fill=1.0), eps=0.0)
    np.testing.assert_allclose(r.numpy(), 2 * before, rtol=1e-6)
    ref = before / np.sqrt((before.astype(np.float64) ** 2).mean(-1, keepdims=True))
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-6)


# ---- rotary_embedding ------------------------------------------------------------------------------
def rope(positions=None, q=None, k=None, c=None, neox=True):
    positions = ints([0, 3, 5]) if positions is None else positions
    q = t((3, 4, 8)) if q is None else q
    return ops.rotary_embedding(positions, q, k, cache() if c is None else c, neox=neox)


@pytest.mark.parametrize("call,exc,pattern", [
    (lambda: rope(positions=ints([0, 16, 1])), IndexError, r"^rotary_embedding: positions\[1\] = 16 .*\[16, 8\]"),
    (lambda: rope(positions=ints([0, -1, 1], np.int32)), IndexError, r"^rotary_embedding: positions\[1\] = -1"),
    (lambda: rope(positions=t((3,))), TypeError, r"^rotary_embedding: positions must be one of \{int32, int64\}"),
    (lambda: rope(positions=ints([0, 1])), ValueError, r"^rotary_embedding: q must be .*\[2\].*\[3, 4, 8\]"),
    (lambda: rope(q=t((3, 32))), ValueError, r"^rotary_embedding: q must be \[\.\.\., heads, head_dim\]"),
    (lambda: rope(q=ints(np.zeros((3, 4, 8)))), TypeError, r"^rotary_embedding: q must be float"),
    (lambda: rope(k=t((3, 2, 16))), ValueError, r"^rotary_embedding: k has head_dim 16"),
    (lambda: rope(k=t((3, 2, 8), "bfloat16")), TypeError, r"^rotary_embedding: .*same dtype"),
    (lambda: rope(k=t((4, 2, 8))), ValueError, r"^rotary_embedding: k must be"),
    (lambda: rope(c=t((16, 8), "bfloat16")), TypeError, r"^rotary_embedding: cos_sin_cache must be one of \{float32\}"),
    (lambda: rope(c=cache(16, 10), q=t((3, 4, 8))), ValueError, r"^rotary_embedding: rot_dim .*\[16, 10\]"),
    (lambda: rope(c=cache(16, 7), q=t((3, 4, 8))), ValueError, r"^rotary_embedding: rot_dim"),
    (lambda: rope(c=t((16,))), ValueError, r"^rotary_embedding: cos_sin_cache must be \[max_pos, rot_dim\]"),
    (lambda: rope(c=t((8, 16)).T), ValueError, r"^rotary_embedding: cos_sin_cache .* contiguous last dim"),
    (lambda: rope(q=t((3, 8, 4)).transpose(1, 2)), ValueError, r"^rotary_embedding: q .* contiguous last dim"),
])
def test_rope_errors(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


def test_rope_out_of_range_writes_nothing():
    q, k = t((3, 4, 8)), t((3, 2, 8))
    q0, k0 = q.numpy().copy(), k.numpy().copy()
    with pytest.raises(IndexError, match="rotary_embedding"):
        ops.rotary_embedding(ints([1, 2, 99]), q, k, cache(), neox=False)
    np.testing.assert_array_equal(q.numpy(), q0)
    np.testing.assert_array_equal(k.numpy(), k0)


def test_rope_position_zero_is_identity():
    c = np.concatenate([np.ones((4, 4)), np.zeros((4, 4))], axis=1).astype(np.float32)  # cos 1, sin 0
    q = t((2, 3, 8), "bfloat16")
    q0 = q.to("float32").numpy().copy()
    ops.rotary_embedding(ints([0, 0]), q, None, tallow.tensor(c), neox=True)
    np.testing.assert_array_equal(q.to("float32").numpy(), q0)


# ---- activations ---------------------------------------------------------------------------------
@pytest.mark.parametrize("call,exc,pattern", [
    (lambda: ops.silu_and_mul(t((4, 7))), ValueError, r"^silu_and_mul: .*even last dimension.*\[4, 7\]"),
    (lambda: ops.silu_and_mul(scalar()), ValueError, r"^silu_and_mul: "),
    (lambda: ops.silu_and_mul(ints(np.zeros((2, 4)))), TypeError, r"^silu_and_mul: x must be float"),
    (lambda: ops.silu_and_mul(t((4, 8)), out=t((4, 8))), ValueError, r"^silu_and_mul: out has shape \[4, 8\], expected \[4, 4\]"),
    (lambda: ops.silu_and_mul(t((4, 8)), out=t((4, 4), "bfloat16")), TypeError, r"^silu_and_mul: out has dtype"),
    (lambda: ops.gelu_and_mul(t((4, 8)), approximate="erf"), ValueError, r"^gelu_and_mul: approximate must be"),
    (lambda: ops.gelu_and_mul(t((4, 9)), approximate="none"), ValueError, r"^gelu_and_mul: .*\[4, 9\]"),
    (lambda: ops.gelu_and_mul(ints(np.zeros((2, 4)))), TypeError, r"^gelu_and_mul: x must be float"),
])
def test_activation_errors(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


# ---- softmax -------------------------------------------------------------------------------------
@pytest.mark.parametrize("call,exc,pattern", [
    (lambda: ops.softmax(ints(np.zeros((2, 4)))), TypeError, r"^softmax: x must be float"),
    (lambda: ops.softmax(scalar()), ValueError, r"^softmax: x must have at least 1 dim"),
    (lambda: ops.softmax(t((2, 4)), scale=float("nan")), ValueError, r"^softmax: scale must be finite.*\[2, 4\]"),
    (lambda: ops.softmax(t((2, 4)), softcap=-1.0), ValueError, r"^softmax: softcap must be"),
    (lambda: ops.softmax(t((2, 4)), out=t((2, 5))), ValueError, r"^softmax: out has shape"),
    (lambda: ops.softmax(t((2, 4)), out=t((2, 4), "float16")), TypeError, r"^softmax: out has dtype"),
])
def test_softmax_errors(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("softcap", [0.0, 10.0])
def test_softmax_fully_masked_row_is_zeros(dtype, softcap):
    x = np.array([[-np.inf] * 5, [0.0, -np.inf, 1.0, -np.inf, 2.0]], np.float32)
    p = ops.softmax(tallow.tensor(x, dtype=dtype), scale=0.0 if softcap == 0 else 1.0, softcap=softcap)
    p = p.to("float32").numpy()
    np.testing.assert_array_equal(p[0], np.zeros(5))
    assert not np.isnan(p).any()
    assert p[1, 1] == 0 and p[1, 3] == 0  # masked entries stay masked under softcap and scale 0
    np.testing.assert_allclose(p[1].sum(), 1.0, rtol=1e-2)


def test_softmax_in_place():
    x = t((3, 50))
    ref = np.exp(x.numpy() - x.numpy().max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    y = ops.softmax(x, out=x)
    np.testing.assert_allclose(x.numpy(), ref, rtol=1e-5)
    assert y.data_ptr == x.data_ptr


def test_empty_inputs():
    assert ops.rms_norm(t((0, 8)), t((8,)), eps=1e-6).shape == (0, 8)
    assert ops.softmax(t((3, 0))).shape == (3, 0)
    assert ops.silu_and_mul(t((2, 0))).shape == (2, 0)
    ops.rotary_embedding(ints(np.zeros(0)), t((0, 4, 8)), None, cache(), neox=True)
