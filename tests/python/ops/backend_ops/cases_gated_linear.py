"""gated_linear (linear(act(x[..., :K]) * x[..., K:], w, bias)) against float64 references.

Tolerances: DEFAULT_TOL. The reference does not round the activated product; the op rounds it to the
dtype before the product (as silu_and_mul does), which adds a relative error of about u/sqrt(3) (f16
2.8e-4, bf16 2.3e-3) on top of the output rounding: ~4e-4 / 3.3e-3 in all, inside the 1e-3 / 8e-3
bounds. f32 has no intermediate rounding (polynomial activations, f32 sums: ~1e-6 << 1e-5).
Rows cover the CUDA gated GEMV (f16/bf16, M <= 16, K % 8 == 0, aligned rows) and its fallbacks
(M = 64, K % 8 != 0, f32), 1-D and 3-D x, a row-strided x and a NaN-filled out=.
"""
import numpy as np

from backend_ops import OpCase, poisoned, register
from backend_ops.cases_activation import gated_ref, gelu_erf, gelu_tanh, silu
import tallow

_ACT = {"silu": silu, "gelu_tanh": gelu_tanh, "gelu": gelu_erf}


def _case(act, shape_x, n, bias=True, view=lambda t: t, out=False, scale=2.0):
    def make(rng, dtype):
        kk = view(np.zeros(shape_x)).shape[-1] // 2
        d = {"x": rng.standard_normal(shape_x) * scale, "w": rng.standard_normal((n, kk)) / np.sqrt(kk)}
        if bias:
            d["bias"] = rng.standard_normal(n)
        return d

    def run(t, d, dev):
        x = view(t["x"])
        o = poisoned(tuple(x.shape[:-1]) + (n,), d, dev) if out else None
        return tallow.ops.gated_linear(x, t["w"], t.get("bias"), activation=act, out=o)

    def ref(r):
        y = gated_ref(view(r["x"]), _ACT[act]) @ r["w"].T
        return y + r["bias"] if bias else y

    name = f"gated_linear[{act},{'x'.join(map(str, shape_x))}->{n}{'' if bias else ',no-bias'}]"
    return OpCase(name, make, run, ref)


register(
    _case("silu", (1, 2 * 256), 96, out=True),                    # decode: one row
    _case("silu", (5, 2 * 72), 33, bias=False),                    # odd N, partial GEMV step
    _case("silu", (16, 2 * 136), 40, out=True),                    # 16 rows: two 8-token fragments
    _case("gelu_tanh", (9, 2 * 264), 17),
    _case("gelu", (2, 2 * 64), 130, bias=False),
    _case("gelu_tanh", (1, 3, 2 * 64), 24),                        # 3-D x
    _case("silu", (2 * 64,), 10),                                  # 1-D x
    _case("silu", (64, 2 * 128), 48, out=True),                    # many rows: silu_and_mul, then linear
    _case("gelu", (4, 2 * 20), 7),                                 # K % 8 != 0: the composition
    _case("silu", (6, 2 * 64), 36, view=lambda t: t[::2]),         # row-strided x (3 rows)
    _case("silu", (3, 2 * 512), 64, scale=8.0),                    # saturating gates
)
