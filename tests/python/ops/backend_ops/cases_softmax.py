"""softmax with scale, tanh soft-capping and -inf masking against a float64 reference.

Tolerances: DEFAULT_TOL. Computed in f32 with max subtraction: the error of p is ~|z| * 2^-24 for
logits z (|z| <= ~40 here) plus a few ulps from the polynomial exp/tanh, well inside f32's 1e-5;
f16/bf16 outputs add one rounding each.

Masking (defined in cpp/ops/softmax.cpp): an input of -inf gets probability 0 whatever scale and
softcap are, and a fully masked row is all zeros.
"""
import numpy as np

from backend_ops import OpCase, poisoned, register
import tallow


def softmax_ref(x, scale=1.0, softcap=0.0):
    masked = np.isneginf(x)
    with np.errstate(invalid="ignore"):
        z = x * np.float64(np.float32(scale))
        if softcap > 0:
            c = np.float64(np.float32(softcap))
            z = c * np.tanh(z / c)
    z = np.where(masked, -np.inf, z)
    m = z.max(axis=-1, keepdims=True)
    full = np.isneginf(m)
    e = np.exp(z - np.where(full, 0.0, m))
    s = e.sum(axis=-1, keepdims=True)
    return np.where(full, 0.0, e / np.where(full, 1.0, s))


def _case(name, shape, scale=1.0, softcap=0.0, amp=3.0, mask=0.0, full_rows=(), view=lambda t: t, out=True):
    def make(rng, dtype):
        x = rng.standard_normal(shape) * amp
        if mask:
            x[rng.random(shape) < mask] = -np.inf
        for r in full_rows:
            x[..., r, :] = -np.inf
        return {"x": x}

    def run(t, d, dev):
        x = view(t["x"])
        o = poisoned(tuple(x.shape), d, dev) if out else None
        return tallow.ops.softmax(x, scale=scale, softcap=softcap, out=o)

    return OpCase(name, make, run, lambda r: softmax_ref(view(r["x"]), scale, softcap))


register(
    _case("softmax", (7, 33), scale=0.7),
    _case("softmax[3d]", (2, 3, 17), out=False),
    _case("softmax[n=1]", (5, 1)),
    _case("softmax[long-odd]", (3, 5001), scale=1.3),
    _case("softmax[large-logits]", (4, 300), amp=15.0),                       # |z| ~ 40: max subtraction matters
    _case("softmax[softcap]", (6, 130), scale=0.5, softcap=20.0, amp=30.0),   # tanh saturates for some entries
    _case("softmax[softcap-small]", (6, 77), scale=1.0, softcap=2.0),
    _case("softmax[masked]", (8, 65), mask=0.5, full_rows=(3,)),
    _case("softmax[masked-softcap]", (8, 65), scale=0.3, softcap=5.0, mask=0.3, full_rows=(0, 7)),
    _case("softmax[row-strided]", (12, 40), view=lambda t: t[::3]),
    _case("softmax[transposed]", (40, 12), view=lambda t: t.T, out=False),   # last dim stride != 1
)
