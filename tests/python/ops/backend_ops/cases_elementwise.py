import numpy as np

from backend_ops import OpCase, poisoned, register
import tallow


def _pair(shape_a, shape_b):
    return lambda rng, dtype: {"a": rng.standard_normal(shape_a), "b": rng.standard_normal(shape_b)}


register(
    OpCase("add", _pair((7, 33), (7, 33)), lambda t, d, dev: tallow.ops.add(t["a"], t["b"], out=poisoned((7, 33), d, dev)),
           lambda r: r["a"] + r["b"]),
    OpCase("add[broadcast]", _pair((3, 1, 65), (5, 1)), lambda t, d, dev: tallow.ops.add(t["a"], t["b"]),
           lambda r: r["a"] + r["b"]),
    OpCase("add[transposed]", _pair((40, 24), (24, 40)), lambda t, d, dev: tallow.ops.add(t["a"], t["b"].T),
           lambda r: r["a"] + r["b"].T),
    OpCase("mul", _pair((4, 5, 130), (130,)), lambda t, d, dev: tallow.ops.mul(t["a"], t["b"]),
           lambda r: r["a"] * r["b"]),
    OpCase("scale", lambda rng, d: {"a": rng.standard_normal((9, 77)), "s": float(rng.uniform(-3, 3))},
           lambda t, d, dev: tallow.ops.scale(t["a"], t["s"]), lambda r: r["a"] * np.float32(r["s"])),
)
