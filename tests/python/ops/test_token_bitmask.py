"""apply_token_bitmask_ (cpp/ops/sampling.h): a grammar's next-token mask applied to logits in place, on
every backend and float dtype, against numpy: allowed tokens keep their value bit for bit, the others
become -inf. Masks are fresh random words (with all-ones and all-zero words mixed in), V not a multiple
of 32, and W wider than needed (llguidance rounds its vocabulary up)."""
import numpy as np
import pytest

import tallow
from tallow import ops
from test_sampling_ops import BACKENDS, FLOATS, dev, to_np


def reference(logits: np.ndarray, mask: np.ndarray) -> np.ndarray:
    B, V = logits.shape
    bits = (mask.view(np.uint32)[:, :, None] >> np.arange(32, dtype=np.uint32)) & 1
    allowed = bits.reshape(B, -1)[:, :V].astype(bool)
    return np.where(allowed, logits, -np.inf)


@pytest.mark.parametrize("device", BACKENDS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("B,V,extra_words", [(1, 1, 0), (3, 100, 1), (7, 4099, 0), (64, 49152, 2)])
def test_matches_numpy(rng, device, dtype, B, V, extra_words):
    W = (V + 31) // 32 + extra_words
    x = rng.standard_normal((B, V)).astype(np.float32)
    mask = rng.integers(-2**31, 2**31, size=(B, W), dtype=np.int64).astype(np.int32)
    pick = rng.random((B, W))
    mask[pick < 0.2] = -1  # whole words allowed
    mask[pick > 0.9] = 0  # whole words banned
    if B > 1:
        mask[0] = -1  # an unconstrained row
    t = dev(x, device, dtype)
    before = to_np(tallow.ops.cast(t, tallow.float32) if dtype != "float32" else t.clone())
    ops.apply_token_bitmask_(t, dev(mask, device))
    got = to_np(tallow.ops.cast(t, tallow.float32) if dtype != "float32" else t)
    np.testing.assert_array_equal(got, reference(before, mask))


@pytest.mark.parametrize("device", BACKENDS)
def test_rows_of_a_wider_tensor(rng, device):
    """Rows with a stride larger than V (a narrowed view of a padded logits buffer)."""
    x = rng.standard_normal((4, 96)).astype(np.float32)
    full = dev(x, device)
    view = full.narrow(1, 0, 70)
    mask = rng.integers(-2**31, 2**31, size=(4, 3), dtype=np.int64).astype(np.int32)
    ops.apply_token_bitmask_(view, dev(mask, device))
    got = to_np(full)
    np.testing.assert_array_equal(got[:, :70], reference(x[:, :70], mask))
    np.testing.assert_array_equal(got[:, 70:], x[:, 70:])  # past V: untouched


def Z(shape, dtype):
    return tallow.from_numpy(np.ones(shape, dtype=dtype))


@pytest.mark.parametrize("bad,match", [
    (lambda: (Z((2, 64), np.float32), Z((2, 1), np.int32)), r"W >= 2"),
    (lambda: (Z((2, 64), np.float32), Z((3, 2), np.int32)), r"B = 2"),
    (lambda: (Z((2, 64), np.float32), Z((2, 2), np.int64)), r"int32"),
    (lambda: (Z((2, 64), np.int32), Z((2, 2), np.int32)), r"float32, float16"),
])
def test_bad_arguments_name_the_op(bad, match):
    logits, mask = bad()
    with pytest.raises((ValueError, TypeError), match=match) as e:
        ops.apply_token_bitmask_(logits, mask)
    assert "apply_token_bitmask_" in str(e.value)
