"""argmax / topk over the last dim: exact (indices and values) against numpy.

Inputs are distinct values drawn from a pool exactly representable in f32, f16 and bf16 (bf16's
8-bit significand, magnitudes 2^-8..4), so rounding to the case's dtype changes nothing and the
ranking has no ties; the reference is numpy's sort. Tie and NaN rules are tested separately in
test_ops_errors_attn.py.
"""
import numpy as np

from backend_ops import OpCase, register
import tallow


def _pool():
    mant = 1.0 + np.arange(128) / 128.0  # bf16 significands
    mags = np.concatenate([mant * 2.0**e for e in range(-8, 2)])  # [2^-8, 4)
    return np.concatenate([mags, -mags])  # 2560 distinct values


POOL = _pool()


def distinct(rng, shape):
    n = shape[-1]
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    return np.stack([rng.choice(POOL, n, replace=False) for _ in range(rows)]).reshape(shape)


def topk_ref(x, k):
    idx = np.argsort(-x, axis=-1, kind="stable")[..., :k]
    return np.take_along_axis(x, idx, axis=-1), idx.astype(np.int64)


def _argmax(name, shape, transpose=False):
    def make(rng, dtype):
        # stored as `shape`; when transposed, the rows the op sees (columns here) are the distinct ones
        return {"x": distinct(rng, shape[::-1]).T if transpose else distinct(rng, shape)}

    def run(t, dtype, dev):
        return tallow.ops.argmax(t["x"].T if transpose else t["x"])

    def ref(r):
        return np.argmax(r["x"].T if transpose else r["x"], axis=-1).astype(np.int64)

    return OpCase(f"argmax[{name}]", make, run, ref, exact=True)


def _topk(name, shape, k, transpose=False):
    def make(rng, dtype):
        # stored as `shape`; when transposed, the rows the op sees (columns here) are the distinct ones
        return {"x": distinct(rng, shape[::-1]).T if transpose else distinct(rng, shape)}

    def run(t, dtype, dev):
        return tallow.ops.topk(t["x"].T if transpose else t["x"], k)

    def ref(r):
        return topk_ref(r["x"].T if transpose else r["x"], k)

    return OpCase(f"topk[{name}]", make, run, ref, exact=True)


register(
    _argmax("rows", (6, 2000)),
    _argmax("3d", (2, 3, 129)),
    _argmax("1d-vocab", (2560,)),
    _argmax("strided", (300, 5), transpose=True),
    _topk("rows-k10", (7, 1000), 10),
    _topk("3d-k1", (2, 3, 257), 1),
    _topk("k-eq-n", (4, 33), 33),
    _topk("vocab-k50", (1, 2560), 50),
    _topk("strided", (200, 3), 7, transpose=True),
)
