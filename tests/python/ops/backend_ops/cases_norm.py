"""rms_norm, fused_add_rms_norm and layer_norm against float64 references.

Tolerances: the DEFAULT_TOL bounds (f32 1e-5, f16 1e-3, bf16 8e-3 relative L2) hold for every row
here because the kernels compute in f32 (sums in f32 vector lanes: relative error ~1e-7 for rows of a
few thousand) and round each output once; the f16/bf16 bounds are about 2x the output rounding
(2^-11, 2^-8 worst case per element, less in L2).
"""
import numpy as np

from backend_ops import Keep, OpCase, poisoned, register
import tallow

EPS = 1e-5


def round_to(a, dtype):
    """Round float64 values to f32, then to `dtype` (RNE), back to float64 — as a kernel stores them."""
    a32 = np.asarray(a, dtype=np.float64).astype(np.float32)
    if dtype == "float32":
        return a32.astype(np.float64)
    if dtype == "float16":
        return a32.astype(np.float16).astype(np.float64)
    assert dtype == "bfloat16", dtype
    b = a32.view(np.uint32).astype(np.uint64)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return b.astype(np.uint32).view(np.float32).astype(np.float64)


def rms_ref(x, w, eps=EPS, gemma=False):
    w = (1.0 + w) if gemma else w
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)) * w


def ln_ref(x, w=None, b=None, eps=EPS):
    mu = x.mean(-1, keepdims=True)
    y = (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + np.float32(eps))
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return y


def _xw(shape, w_len=None, scale=2.0):
    def make(rng, dtype):
        return {"x": rng.standard_normal(shape) * scale, "w": rng.standard_normal(w_len or shape[-1]) * 0.5 + 1.0}
    return make


def _rms(name, shape, gemma=False, view=lambda t: t, wview=lambda t: t, w_len=None, out=True):
    def run(t, d, dev):
        x, w = view(t["x"]), wview(t["w"])
        o = poisoned(tuple(x.shape), d, dev) if out else None
        return tallow.ops.rms_norm(x, w, eps=EPS, gemma_offset=gemma, out=o)

    def ref(r):
        return rms_ref(view(r["x"]), wview(r["w"]), gemma=gemma)

    return OpCase(name, _xw(shape, w_len), run, ref)


register(
    _rms("rms_norm", (7, 33)),
    _rms("rms_norm[1x1]", (1, 1)),
    _rms("rms_norm[3d]", (2, 3, 128), out=False),
    _rms("rms_norm[long-odd]", (3, 5003)),
    _rms("rms_norm[gemma]", (5, 64), gemma=True),
    _rms("rms_norm[row-strided]", (10, 48), view=lambda t: t[::3]),             # rows strided, last dim contiguous
    _rms("rms_norm[transposed]", (40, 24), view=lambda t: t.T, w_len=40),      # last dim stride != 1
    _rms("rms_norm[strided-w]", (6, 20), wview=lambda t: t[::2], w_len=40),
    # decode batch sizes: past one CTA an SM CUDA's norms take the 4-pack launch
    _rms("rms_norm[300-rows]", (300, 256)),
    _rms("rms_norm[600-rows]", (600, 128)),
)


# ---- fused_add_rms_norm ------------------------------------------------------------------------
def _fused(name, shape, gemma=False, res_dtype=None, pad=0):
    """residual += x (in residual's dtype), out = rms_norm(residual); `pad` makes residual a row-strided
    view res_full[:, :H] of a wider buffer (the padding columns must stay untouched)."""
    h = shape[-1]

    def make(rng, dtype):
        res = rng.standard_normal(shape[:-1] + (h + pad,)) * 3.0
        return {"x": rng.standard_normal(shape), "res": Keep(res.astype(np.float32), res_dtype) if res_dtype else res,
                "w": rng.standard_normal(h) * 0.5 + 1.0, "dtype": dtype}

    def run(t, d, dev):
        res_full = t["res"]
        res = res_full[..., :h] if pad else res_full
        o = tallow.ops.fused_add_rms_norm(t["x"], res, t["w"], eps=EPS, gemma_offset=gemma)
        return o, res_full

    def ref(r):
        rd = res_dtype or r["dtype"]
        res_full = r["res"].copy()
        s = round_to(r["x"] + res_full[..., :h], rd)   # the stored (rounded) residual ...
        res_full[..., :h] = s
        return rms_ref(s, r["w"], gemma=gemma), res_full  # ... is what gets normed

    return OpCase(name, make, run, ref)


register(
    _fused("fused_add_rms_norm", (9, 40)),
    _fused("fused_add_rms_norm[3d-gemma]", (2, 5, 96), gemma=True),
    _fused("fused_add_rms_norm[f32-residual]", (4, 70), res_dtype="float32"),
    _fused("fused_add_rms_norm[strided-residual]", (6, 33), pad=7),
    _fused("fused_add_rms_norm[256-rows]", (256, 1024)),
    _fused("fused_add_rms_norm[520-rows]", (520, 64)),
)


# ---- layer_norm ----------------------------------------------------------------------------------
def _ln(name, shape, with_w=True, with_b=True, offset=0.0, view=lambda t: t, out=True):
    def make(rng, dtype):
        return {"x": rng.standard_normal(shape) * 2.0 + offset, "w": rng.standard_normal(shape[-1]) * 0.5 + 1.0,
                "b": rng.standard_normal(shape[-1])}

    def run(t, d, dev):
        x = view(t["x"])
        o = poisoned(tuple(x.shape), d, dev) if out else None
        return tallow.ops.layer_norm(x, t["w"] if with_w else None, t["b"] if with_b else None, eps=EPS, out=o)

    def ref(r):
        return ln_ref(view(r["x"]), r["w"] if with_w else None, r["b"] if with_b else None)

    return OpCase(name, make, run, ref)


register(
    _ln("layer_norm", (7, 33)),
    _ln("layer_norm[offset-mean]", (5, 257), offset=3.0),   # two-pass variance keeps this at the default bound
    _ln("layer_norm[w-only]", (3, 4, 64), with_b=False, out=False),
    _ln("layer_norm[no-affine]", (6, 1000), with_w=False, with_b=False),
    _ln("layer_norm[row-strided]", (12, 31), view=lambda t: t[1::2]),
    _ln("layer_norm[200-rows]", (200, 512)),
)
