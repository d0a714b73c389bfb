"""rope_and_cache (per-head q/k RMSNorm + rotary embedding in place + KV-cache write) against a
float64 reference: rms_norm per head, then rope_ref (cases_rope), then scatter_ref (cases_paged_attention).

q, k and v are views of one fused qkv buffer [T, Hq + 2 Hk, D] (strided rows, as the engine passes
them); the whole buffer is compared, so v and any element a kernel must not touch come back too.
Slot maps include padding tokens (slot -1) and the caches are random everywhere, so a row written to
the wrong slot, or a padding token written at all, shows up as a large error.

Tolerances: DEFAULT_TOL. With a norm, the normed value is rounded to the dtype before the rotation
(as the composition does), so rotated elements carry two roundings instead of one: relative L2
~1.5e-3 in bf16 (< 8e-3), ~2e-4 in f16 (< 1e-3). The caches hold the in-place k (same dtype: exact
copy). fp8 rows compare the caches only (stored values, i.e. x / scale, decoded): e4m3 keeps 3
mantissa bits, relative L2 ~0.027 on normal data, so their bound is 0.04.
"""
import numpy as np

from backend_ops import Keep, OpCase, register
from backend_ops.cases_paged_attention import scatter_ref
from backend_ops.cases_rope import _positions, make_cache, rope_ref
import tallow

FP8_TOL = {"float32": 0.04, "float16": 0.04, "bfloat16": 0.04}


def rms_norm_heads_ref(x, w, eps, gemma):
    """x [T, H, D] float64, w [D]: per-head RMSNorm over D."""
    inv = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * inv * ((1.0 + w) if gemma else w)


def _slots(rng, t_len, num_blocks, bs, pad, dtype=np.int64):
    s = rng.permutation(num_blocks * bs)[:t_len].astype(dtype)
    s[rng.permutation(t_len)[:pad]] = -1
    return s


def _case(name, t_len, hq, hk, d, rot, neox, norm=None, bs=16, num_blocks=None, pad=2, max_pos=97,
          pos_dtype=np.int64, slot_dtype=np.int64, cache_dtype=None, k_scale=1.0, v_scale=1.0, dv=None, eps=1e-6):
    """norm: None, "rms" or "gemma". cache_dtype: None (the case's dtype) or a dtype name (incl. fp8).
    dv: a separate v [T, Hk, dv] (not part of qkv) when given."""
    num_blocks = num_blocks or -(-t_len // bs) + 2
    fp8 = cache_dtype == "float8_e4m3"
    vd = d if dv is None else dv

    def make(rng, dtype):
        inp = {"qkv": rng.standard_normal((t_len, hq + 2 * hk, d)),
               "pos": _positions(rng, (t_len,), max_pos, pos_dtype),
               "cs": Keep(make_cache(max_pos, rot)),
               "k_cache": rng.standard_normal((num_blocks, bs, hk, d)),
               "v_cache": rng.standard_normal((num_blocks, bs, hk, vd)),
               "slots": _slots(rng, t_len, num_blocks, bs, pad, slot_dtype)}
        if dv is not None:
            inp["v"] = rng.standard_normal((t_len, hk, dv))
        if cache_dtype:
            for key in ("k_cache", "v_cache"):
                inp[key] = Keep(inp[key].astype(np.float32), cache_dtype)
        if norm:
            inp["qw"] = 1.0 + 0.3 * rng.standard_normal(d) if norm == "rms" else 0.3 * rng.standard_normal(d)
            inp["kw"] = 1.0 + 0.3 * rng.standard_normal(d) if norm == "rms" else 0.3 * rng.standard_normal(d)
        return inp

    def run(t, dt, dev):
        qkv = t["qkv"]
        q, k = qkv[:, :hq, :], qkv[:, hq:hq + hk, :]
        v = t["v"] if dv is not None else qkv[:, hq + hk:, :]
        tallow.ops.rope_and_cache(t["pos"], q, k, v, t["cs"], neox, t["k_cache"], t["v_cache"], t["slots"],
                                  t.get("qw"), t.get("kw"), eps, norm == "gemma", k_scale, v_scale)
        return (t["k_cache"], t["v_cache"]) if fp8 else (qkv, t["k_cache"], t["v_cache"])

    def ref(r):
        qkv = r["qkv"].copy()
        q, k = qkv[:, :hq], qkv[:, hq:hq + hk]
        v = r["v"] if dv is not None else qkv[:, hq + hk:]
        if norm:
            q = rms_norm_heads_ref(q, r["qw"], eps, norm == "gemma")
            k = rms_norm_heads_ref(k, r["kw"], eps, norm == "gemma")
        q, k = rope_ref(q, r["pos"], r["cs"], neox), rope_ref(k, r["pos"], r["cs"], neox)
        qkv[:, :hq], qkv[:, hq:hq + hk] = q, k
        s_k, s_v = (k_scale, v_scale) if fp8 else (1.0, 1.0)
        kc, vc = scatter_ref(k / s_k, v / s_v, r["k_cache"], r["v_cache"], r["slots"])
        return (kc, vc) if fp8 else (qkv, kc, vc)

    case = OpCase(f"rope_and_cache[{name}]", make, run, ref)
    if fp8:
        case.tol = dict(FP8_TOL)
    return case


register(
    _case("llama-neox-gqa", 9, 8, 2, 64, 64, True),
    _case("llama-decode-8b-shape", 1, 32, 8, 128, 128, True, pad=0, max_pos=4096),
    _case("qwen3-qk-norm", 11, 8, 4, 128, 128, True, norm="rms", pos_dtype=np.int32),
    _case("gemma-norm-1+w-d256", 5, 4, 1, 256, 256, True, norm="gemma", bs=8),
    _case("interleaved-gqa", 13, 6, 3, 32, 32, False, slot_dtype=np.int32),
    _case("neox-partial-norm-d80", 7, 3, 1, 80, 32, True, norm="rms"),           # rot_dim < head_dim
    _case("interleaved-partial-odd-half", 7, 2, 2, 48, 10, False, norm="rms"),   # rot/2 = 5
    _case("fp8-cache-scales", 10, 4, 2, 64, 64, True, norm="rms", cache_dtype="float8_e4m3",
          k_scale=0.5, v_scale=2.0),
    _case("f32-cache", 6, 4, 2, 64, 64, True, cache_dtype="float32"),
    _case("dv-ne-d", 5, 4, 2, 64, 64, True, dv=48),                              # separate v, Dv != D
)
