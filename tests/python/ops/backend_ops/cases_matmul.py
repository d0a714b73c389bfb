"""matmul and linear against float64 references.

Tolerances: the DEFAULT_TOL bounds (relative L2: f32 1e-5, f16 1e-3, bf16 8e-3) hold for every row.
The kernels multiply exact f32 copies of the (already rounded) inputs and sum the K products in f32,
sequentially per output or in vector lanes. For random inputs the rounding errors of a running sum of
k terms (size ~sqrt(k)) are independent, so the sum's error is ~u*K/sqrt(6) against a result of size
~sqrt(K): a relative error of about u*sqrt(K/6) with u = 2^-24 (a worst case of K*u ~ 3e-5 at K = 513
is never approached on random data). Here K <= 513: ~6e-7 expected, 1e-5 leaves >10x margin.
f16/bf16 outputs add one rounding of each output (relative RMS u/sqrt(3) with u = 2^-11 / 2^-8:
2.8e-4 / 2.3e-3), which the 1e-3 / 8e-3 bounds cover about 3x.
"""
import numpy as np

from backend_ops import OpCase, poisoned, register
import tallow


def _swap(t):
    """Swap the last two dims (a transposed view) of a tallow Tensor or a numpy array."""
    if isinstance(t, tallow.Tensor):
        return t.transpose(t.ndim - 2, t.ndim - 1)
    return np.swapaxes(t, -1, -2)


def _ident(t):
    return t


def _mm(name, shape_a, shape_b, view_a=_ident, view_b=_ident, out=False):
    """matmul(view_a(a), view_b(b)); out=True passes a NaN-filled out= buffer."""

    def make(rng, dtype):
        return {"a": rng.standard_normal(shape_a), "b": rng.standard_normal(shape_b)}

    def run(t, d, dev):
        a, b = view_a(t["a"]), view_b(t["b"])
        o = None
        if out:
            oshape = np.broadcast_shapes(tuple(a.shape[:-2]), tuple(b.shape[:-2])) + (a.shape[-2], b.shape[-1])
            o = poisoned(oshape, d, dev)
        return tallow.ops.matmul(a, b, out=o)

    return OpCase(name, make, run, lambda r: np.matmul(view_a(r["a"]), view_b(r["b"])))


def _lin(name, shape_x, n, bias=True, view_x=_ident, w_transposed=False, out=False):
    """linear(view_x(x), w [n, K], bias [n]); w_transposed stores w as [K, n] and passes its .T view."""

    def make(rng, dtype):
        x = rng.standard_normal(shape_x)
        kk = view_x(x).shape[-1]
        w = rng.standard_normal((kk, n) if w_transposed else (n, kk)) / np.sqrt(kk)
        d = {"x": x, "w": w}
        if bias:
            d["bias"] = rng.standard_normal(n)
        return d

    def wv(w):
        return w.T if w_transposed else w

    def run(t, d, dev):
        x = view_x(t["x"])
        o = poisoned(tuple(x.shape[:-1]) + (n,), d, dev) if out else None
        return tallow.ops.linear(x, wv(t["w"]), t.get("bias"), out=o)

    def ref(r):
        y = view_x(r["x"]) @ wv(r["w"]).T
        return y + r["bias"] if bias else y

    return OpCase(name, make, run, ref)


register(
    # matmul: 2-D shapes on each kernel path (GEMV for few rows or columns, packed GEMM otherwise)
    _mm("matmul[37x61x29]", (37, 61), (61, 29), out=True),
    _mm("matmul[130x257x100]", (130, 257), (257, 100)),
    _mm("matmul[M=1]", (1, 300), (300, 77)),
    _mm("matmul[N=1]", (40, 64), (64, 1)),
    _mm("matmul[M=5,N=3]", (5, 33), (33, 3)),
    # batched, with broadcast batch dims (per-batch GEMMs, and one tall GEMM when b is shared)
    _mm("matmul[batched-broadcast]", (2, 3, 17, 40), (3, 40, 23), out=True),
    _mm("matmul[shared-b]", (4, 33, 50), (50, 70)),
    _mm("matmul[batched-M=1]", (8, 1, 64), (8, 64, 40)),
    _mm("matmul[many-batches]", (16, 20, 24), (16, 24, 36)),
    # transposed and strided inputs
    _mm("matmul[a^T,b^T]", (61, 37), (29, 61), view_a=_swap, view_b=_swap),
    _mm("matmul[a^T-large]", (200, 150), (200, 90), view_a=_swap),
    _mm("matmul[strided]", (30, 80), (40, 90), view_a=lambda t: t[:, ::2], view_b=lambda t: t[:, 1::2]),
    _mm("matmul[batched-transposed]", (3, 48, 20), (3, 31, 48), view_a=_swap, view_b=_swap),
    # linear: decode (M=1), prefill (M < N and M > N), 3-D x, bias or none, poisoned out=
    _lin("linear[M=1]", (1, 512), 300, out=True),
    _lin("linear[M=8]", (8, 200), 96),
    _lin("linear[70x256x200]", (70, 256), 200, out=True),
    _lin("linear[300x128x50]", (300, 128), 50),
    _lin("linear[3-D,no-bias]", (3, 7, 130), 65, bias=False, out=True),
    _lin("linear[1-D x]", (96,), 40),
    _lin("linear[N=1]", (33, 64), 1),
    _lin("linear[strided-x]", (20, 258), 70, view_x=lambda t: t[:, ::2]),
    _lin("linear[x^T]", (90, 45), 60, view_x=_swap),
    _lin("linear[w^T]", (50, 96), 120, w_transposed=True),
    _lin("linear[w^T,M=2]", (2, 96), 120, w_transposed=True, bias=False),
)
