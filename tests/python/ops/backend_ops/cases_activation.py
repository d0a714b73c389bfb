"""silu_and_mul and gelu_and_mul (tanh and erf) against float64 references.

Tolerances: DEFAULT_TOL. The kernels use f32 polynomial exp/tanh/erf (a few f32 ulps; erf's absolute
error < 5e-7), far below the f32 bound of 1e-5; f16/bf16 are dominated by the one output rounding.
"""
import math

import numpy as np

from backend_ops import OpCase, poisoned, register
import tallow

_erf = np.vectorize(math.erf, otypes=[np.float64])


def silu(a):
    return a / (1.0 + np.exp(-a))


def gelu_tanh(a):
    return 0.5 * a * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (a + 0.044715 * a**3)))


def gelu_erf(a):
    return 0.5 * a * (1.0 + _erf(a / math.sqrt(2.0)))


def gated_ref(x, act):
    d = x.shape[-1] // 2
    return act(x[..., :d]) * x[..., d:]


_OPS = {
    "silu_and_mul": (lambda x, out: tallow.ops.silu_and_mul(x, out=out), silu),
    "gelu_and_mul[tanh]": (lambda x, out: tallow.ops.gelu_and_mul(x, approximate="tanh", out=out), gelu_tanh),
    "gelu_and_mul[erf]": (lambda x, out: tallow.ops.gelu_and_mul(x, approximate="none", out=out), gelu_erf),
}


def _case(op, suffix, shape, view=lambda t: t, out=True, scale=3.0):
    fn, act = _OPS[op]

    def run(t, d, dev):
        x = view(t["x"])
        o = poisoned(tuple(x.shape[:-1]) + (x.shape[-1] // 2,), d, dev) if out else None
        return fn(x, o)

    # scale 3 reaches both tails (silu/gelu saturation, exp over/underflow of the polynomial)
    return OpCase(f"{op}[{suffix}]", lambda rng, d: {"x": rng.standard_normal(shape) * scale}, run,
                  lambda r: gated_ref(view(r["x"]), act))


for _op in _OPS:
    register(
        _case(_op, "basic", (7, 2 * 33)),
        _case(_op, "3d", (2, 3, 2 * 64), out=False),
        _case(_op, "long-odd", (2, 2 * 4099)),
        _case(_op, "wide-range", (4, 2 * 500), scale=20.0),
        _case(_op, "row-strided", (9, 2 * 17), view=lambda t: t[::2]),
        _case(_op, "transposed", (2 * 12, 5), view=lambda t: t.T, out=False),   # last dim stride != 1
    )
