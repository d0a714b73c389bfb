"""Reference attention (tallow.ops.attention) against a float64 numpy softmax(QK^T)V.

Tolerance: the DEFAULT_TOL bounds. Inputs are rounded to the case's dtype before the reference
sees them, so the only differences are f32 arithmetic (dot products of length D and sums over at
most Tk keys, f32 accumulation: ~1e-7 relative, well under 1e-5) and the single final rounding of
each output to f16 (unit roundoff 2^-11, relative L2 error ~2^-11/sqrt(3) ~ 3e-4 < 1e-3) or bf16
(2^-8/sqrt(3) ~ 2.3e-3 < 8e-3). Outputs are averages of N(0, 1) values, far from f16 subnormals.
"""
import numpy as np

from backend_ops import OpCase, register
import tallow


def attention_ref(q, k, v, scale, causal=True, window=0, softcap=0.0):
    """float64 attention over [T, H, D] or [B, T, H, D]; fully-masked query rows are zeros."""
    if q.ndim == 4:
        return np.stack([attention_ref(q[b], k[b], v[b], scale, causal, window, softcap) for b in range(q.shape[0])])
    tq, hq, _ = q.shape
    tk, hk, dv = v.shape
    group = hq // hk
    kk = np.repeat(k, group, axis=1)  # query head h reads kv head h // group
    vv = np.repeat(v, group, axis=1)
    s = np.einsum("qhd,khd->hqk", q, kk) * scale
    if softcap > 0:
        s = softcap * np.tanh(s / softcap)
    pos = tk - tq + np.arange(tq)[:, None]  # query i sits at position Tk - Tq + i
    key = np.arange(tk)[None, :]
    visible = np.ones((tq, tk), dtype=bool)
    if causal or window > 0:
        visible &= key <= pos
    if window > 0:
        visible &= key > pos - window  # the last `window` keys, the query's own included
    s = np.where(visible[None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    l = e.sum(axis=-1, keepdims=True)
    p = np.divide(e, l, out=np.zeros_like(e), where=l > 0)
    return np.einsum("hqk,khd->qhd", p, vv)


def _case(name, tq, tk, hq, hk, d, dv=None, batch=None, causal=True, window=0, softcap=0.0, qmul=1.0):
    dv = d if dv is None else dv
    lead = () if batch is None else (batch,)
    scale = d**-0.5

    def make(rng, dtype):
        # qmul > 1 sharpens the softmax (scores of a few units) so masking and softcap matter.
        return {"q": qmul * rng.standard_normal(lead + (tq, hq, d)), "k": rng.standard_normal(lead + (tk, hk, d)),
                "v": rng.standard_normal(lead + (tk, hk, dv))}

    def run(t, dtype, dev):
        return tallow.ops.attention(t["q"], t["k"], t["v"], scale, causal=causal, sliding_window=window,
                                    softcap=softcap)

    def ref(r):
        return attention_ref(r["q"], r["k"], r["v"], scale, causal, window, softcap)

    return OpCase(f"attention[{name}]", make, run, ref)


def _strided_case():
    # q, k, v as head slices of one packed [T, Hq + 2 Hk, D] projection output (non-contiguous views).
    tq, hq, hk, d = 21, 4, 2, 64

    def make(rng, dtype):
        return {"qkv": rng.standard_normal((tq, hq + 2 * hk, d))}

    def run(t, dtype, dev):
        qkv = t["qkv"]
        return tallow.ops.attention(qkv.narrow(1, 0, hq), qkv.narrow(1, hq, hk), qkv.narrow(1, hq + hk, hk), d**-0.5)

    def ref(r):
        qkv = r["qkv"]
        return attention_ref(qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:], d**-0.5)

    return OpCase("attention[strided-qkv]", make, run, ref)


register(
    _case("prefill-mha", tq=37, tk=37, hq=4, hk=4, d=64, qmul=2.0),
    _case("cached-prefix-gqa8:2", tq=5, tk=40, hq=8, hk=2, d=128, qmul=2.0),
    _case("decode-mqa", tq=1, tk=53, hq=6, hk=1, d=80),
    _case("prefill-gqa-d80", tq=33, tk=33, hq=8, hk=2, d=80),
    _case("sliding-window", tq=40, tk=40, hq=4, hk=2, d=64, window=9, qmul=2.0),
    _case("sliding-window-prefix", tq=6, tk=30, hq=4, hk=1, d=64, window=8, qmul=2.0),
    _case("softcap", tq=24, tk=24, hq=4, hk=2, d=64, softcap=3.0, qmul=4.0),
    _case("batch4d", tq=19, tk=19, hq=4, hk=2, d=64, batch=3),
    _case("batch4d-prefix-window", tq=7, tk=25, hq=8, hk=2, d=128, batch=2, window=10, qmul=2.0),
    _case("dv-ne-d", tq=17, tk=17, hq=4, hk=2, d=80, dv=48),
    _case("non-causal", tq=12, tk=20, hq=4, hk=4, d=64, causal=False, qmul=2.0),
    _case("tq-gt-tk-masked-rows", tq=10, tk=6, hq=2, hk=1, d=64),  # first 4 queries see nothing -> zeros
    _strided_case(),
)
