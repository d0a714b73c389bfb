"""attention / argmax / topk / embedding: bad input raises a Python error naming the op, and the
rules the table-driven test cannot show (ties, NaN, fully-masked rows, determinism)."""
import math

import numpy as np
import pytest

import tallow
from tallow import ops

FLOATS = ("float32", "float16", "bfloat16")


def t(shape, dtype="float32", rng=None):
    rng = rng or np.random.default_rng(0)
    return tallow.tensor(rng.standard_normal(shape).astype(np.float32), dtype=dtype)


def ids(values, dtype=np.int64):
    return tallow.from_numpy(np.asarray(values, dtype=dtype))


# ---- attention: bad input -------------------------------------------------------------------

@pytest.mark.parametrize("q,k,v,exc", [
    ((4, 64), (4, 2, 64), (4, 2, 64), ValueError),                 # q 2-D
    ((4, 2, 64), (1, 4, 2, 64), (1, 4, 2, 64), ValueError),       # ranks differ
    ((1, 2, 3, 4, 5), (1, 2, 3, 4, 5), (1, 2, 3, 4, 5), ValueError),  # 5-D
    ((4, 6, 64), (4, 4, 64), (4, 4, 64), ValueError),              # Hq % Hk != 0
    ((4, 4, 64), (4, 2, 32), (4, 2, 64), ValueError),              # head dims of q and k differ
    ((4, 4, 64), (5, 2, 64), (4, 2, 64), ValueError),              # k and v token counts differ
    ((4, 4, 64), (4, 2, 64), (4, 1, 64), ValueError),              # k and v head counts differ
    ((2, 4, 4, 64), (3, 4, 2, 64), (3, 4, 2, 64), ValueError),    # batch sizes differ
])
def test_attention_bad_shapes(q, k, v, exc):
    with pytest.raises(exc, match="attention"):
        ops.attention(t(q), t(k), t(v), 0.125)


def test_attention_dtype_mismatch_and_int():
    with pytest.raises(TypeError, match="attention"):
        ops.attention(t((4, 2, 64)), t((4, 2, 64), "float16"), t((4, 2, 64)), 0.125)
    with pytest.raises(TypeError, match="attention"):
        ops.attention(t((4, 2, 64), "bfloat16"), t((4, 2, 64), "bfloat16"), t((4, 2, 64)), 0.125)
    x = tallow.from_numpy(np.ones((4, 2, 8), np.int32))
    with pytest.raises(TypeError, match="attention"):
        ops.attention(x, x, x, 0.125)


def test_attention_bad_options():
    q = t((4, 2, 16))
    with pytest.raises(ValueError, match="attention.*sliding_window"):
        ops.attention(q, q, q, 0.25, sliding_window=-1)
    with pytest.raises(ValueError, match="attention.*softcap"):
        ops.attention(q, q, q, 0.25, softcap=-1.0)
    with pytest.raises(ValueError, match="attention.*scale"):
        ops.attention(q, q, q, float("nan"))


# ---- attention: semantics -----------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS)
def test_attention_fully_masked_rows_are_zero(dtype):
    # Tq > Tk with a causal mask: query i sits at position Tk - Tq + i < 0 for i < Tq - Tk.
    rng = np.random.default_rng(1)
    q, k, v = t((7, 2, 32), dtype, rng), t((3, 1, 32), dtype, rng), t((3, 1, 32), dtype, rng)
    out = np.asarray(ops.attention(q, k, v, 32**-0.5))
    assert np.all(out[:4] == 0.0)
    assert np.all(np.abs(out[4:]).sum(axis=-1) > 0)
    # and with no keys at all
    empty = t((0, 1, 32), dtype)
    assert np.all(np.asarray(ops.attention(q, empty, empty, 1.0, causal=False)) == 0.0)


def test_attention_window_implies_causal_bound_and_window_one():
    rng = np.random.default_rng(2)
    q, k, v = t((9, 2, 16), rng=rng), t((9, 2, 16), rng=rng), t((9, 2, 16), rng=rng)
    a = np.asarray(ops.attention(q, k, v, 0.25, causal=True, sliding_window=4))
    b = np.asarray(ops.attention(q, k, v, 0.25, causal=False, sliding_window=4))
    np.testing.assert_array_equal(a, b)
    # window 1: each query sees only its own key, so the output is its own value row
    one = np.asarray(ops.attention(q, k, v, 0.25, sliding_window=1))
    np.testing.assert_array_equal(one, np.asarray(v))
    # a window at least as long as the sequence is plain causal attention
    np.testing.assert_allclose(np.asarray(ops.attention(q, k, v, 0.25, sliding_window=9)),
                               np.asarray(ops.attention(q, k, v, 0.25)), rtol=0, atol=0)


def test_attention_same_result_for_any_thread_count():
    rng = np.random.default_rng(3)
    q, k, v = t((40, 8, 64), rng=rng), t((64, 2, 64), rng=rng), t((64, 2, 64), rng=rng)
    n = tallow.get_num_threads()
    try:
        tallow.set_num_threads(1)
        one = np.asarray(ops.attention(q, k, v, 0.125, sliding_window=20))
        tallow.set_num_threads(max(n, 3))
        many = np.asarray(ops.attention(q, k, v, 0.125, sliding_window=20))
    finally:
        tallow.set_num_threads(n)
    np.testing.assert_array_equal(one, many)


# ---- argmax / topk ------------------------------------------------------------------------

def order_ref(row):
    """The documented order: NaN largest, then descending value, ties by lower index."""
    return sorted(range(len(row)), key=lambda i: (0, 0.0, i) if math.isnan(row[i]) else (1, -row[i], i))


@pytest.mark.parametrize("dtype", FLOATS)
def test_argmax_topk_ties_and_nan(dtype):
    nan, inf = float("nan"), float("inf")
    rows = [
        [1.0, 3.0, 3.0, -2.0, 3.0, 0.5],          # ties: lower index first
        [2.0, nan, 5.0, nan, inf, 5.0],            # NaN above +inf; first NaN wins
        [-inf, -inf, -inf, -inf, -inf, -inf],      # all equal
        [0.0, -0.0, 0.0, -1.0, -0.0, -3.0],        # +0 == -0 is a tie
    ]
    x = tallow.tensor(np.array(rows, np.float32), dtype=dtype)
    xr = np.asarray(x.to("float32"))
    am = ops.argmax(x).numpy()
    vals, idx = ops.topk(x, 6)
    vals, idx = np.asarray(vals.to("float32")), idx.numpy()
    assert idx.dtype == np.int64 and am.dtype == np.int64
    for r, row in enumerate(xr.tolist()):
        expect = order_ref(row)
        assert am[r] == expect[0], (r, am[r], expect)
        assert idx[r].tolist() == expect, (r, idx[r], expect)
        np.testing.assert_array_equal(vals[r], xr[r][expect])
    # a shorter k is a prefix of the full order
    assert ops.topk(x, 2)[1].numpy().tolist() == idx[:, :2].tolist()


def test_argmax_topk_empty_and_k_zero():
    x = t((3, 5))
    v, i = ops.topk(x, 0)
    assert v.shape == (3, 0) and i.shape == (3, 0)
    assert ops.argmax(t((0, 5))).shape == (0,)


@pytest.mark.parametrize("k", [6, -1])
def test_topk_bad_k(k):
    with pytest.raises(ValueError, match=r"topk.*k = " + str(k)):
        ops.topk(t((2, 5)), k)


def test_argmax_topk_bad_input():
    xi = tallow.from_numpy(np.arange(10, dtype=np.int32))
    with pytest.raises(TypeError, match="argmax"):
        ops.argmax(xi)
    with pytest.raises(TypeError, match="topk"):
        ops.topk(xi, 2)
    scalar = tallow.from_numpy(np.array(1.0, np.float32))
    with pytest.raises(ValueError, match="argmax"):
        ops.argmax(scalar)
    with pytest.raises(ValueError, match="topk"):
        ops.topk(scalar, 1)
    with pytest.raises(ValueError, match="argmax.*empty"):
        ops.argmax(t((2, 0)))


# ---- embedding ----------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [10, -1, 2**40])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_embedding_id_out_of_range(bad, id_dtype):
    if id_dtype is np.int32 and bad > 2**31:
        pytest.skip("does not fit i32")
    table = t((10, 8))
    with pytest.raises(IndexError, match=rf"embedding.*id {bad}\b.*V = 10"):
        ops.embedding(ids([[1, 2], [bad, 3]], id_dtype), table)


def test_embedding_bad_input():
    table = t((10, 8))
    with pytest.raises(TypeError, match="embedding.*ids"):
        ops.embedding(tallow.from_numpy(np.array([1.0, 2.0], np.float32)), table)
    with pytest.raises(ValueError, match="embedding.*table"):
        ops.embedding(ids([1]), t((10,)))
    with pytest.raises(ValueError, match="embedding.*table"):
        ops.embedding(ids([1]), t((2, 10, 8)))
    with pytest.raises(TypeError, match="embedding.*table"):
        ops.embedding(ids([1]), tallow.from_numpy(np.ones((10, 8), np.int32)))
    with pytest.raises(TypeError, match="embedding.*output dtype"):
        ops.embedding(ids([1]), table, dtype="q8_0")
    with pytest.raises(TypeError, match="embedding.*output dtype"):
        ops.embedding(ids([1]), table, dtype="int32")


def test_embedding_out_dtype_defaults():
    assert ops.embedding(ids([0]), t((4, 8), "bfloat16")).dtype == tallow.bfloat16
    q8 = tallow.from_numpy(np.zeros((4, 34), np.uint8)).view_as_dtype("q8_0", [4, 32])
    assert ops.embedding(ids([0, 3]), q8).dtype == tallow.float32
