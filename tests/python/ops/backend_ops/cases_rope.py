"""rotary_embedding (in place on q and k) against a float64 reference.

Tolerances: DEFAULT_TOL. Each rotated element is a*c - b*s computed in f32 (error ~2 f32 ulps of
|(a, b)|) and rounded once to the tensor's dtype; un-rotated dims (partial rotary) and untouched
buffers (v in a fused qkv) are compared too and must come back unchanged.
"""
import numpy as np

from backend_ops import Keep, OpCase, register
import tallow


def make_cache(max_pos, rot_dim, base=10000.0):
    inv_freq = 1.0 / base ** (np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim)
    ang = np.arange(max_pos, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.concatenate([np.cos(ang), np.sin(ang)], axis=-1).astype(np.float32)


def rope_ref(x, pos, cache, neox):
    """x [..., H, D] float64, pos [...] ints, cache [max_pos, rot] -> rotated copy."""
    rot = cache.shape[1]
    half = rot // 2
    cos = cache[pos][..., None, :half]
    sin = cache[pos][..., None, half:]
    out = x.copy()
    if neox:
        a, b = x[..., :half], x[..., half:rot]
        out[..., :half] = a * cos - b * sin
        out[..., half:rot] = b * cos + a * sin
    else:
        a, b = x[..., 0:rot:2], x[..., 1:rot:2]
        out[..., 0:rot:2] = a * cos - b * sin
        out[..., 1:rot:2] = b * cos + a * sin
    return out


def _positions(rng, lead, max_pos, dtype):
    # not in order, with repeats, and (given two or more tokens) including max_pos - 1 first and 0 last
    p = rng.integers(0, max_pos, size=lead)
    flat = p.reshape(-1)
    if flat.size >= 2:
        flat[0], flat[-1] = max_pos - 1, 0
    return p.astype(dtype)


def _rope(name, lead, hq, hk, d, rot, neox, max_pos=97, pos_dtype=np.int64):
    def make(rng, dtype):
        inp = {"q": rng.standard_normal(lead + (hq, d)), "pos": _positions(rng, lead, max_pos, pos_dtype),
               "cache": Keep(make_cache(max_pos, rot))}
        if hk:
            inp["k"] = rng.standard_normal(lead + (hk, d))
        return inp

    def run(t, dt, dev):
        q, k = t["q"], t.get("k")
        tallow.ops.rotary_embedding(t["pos"], q, k, t["cache"], neox=neox)
        return (q, k) if hk else q

    def ref(r):
        q = rope_ref(r["q"], r["pos"], r["cache"], neox)
        return (q, rope_ref(r["k"], r["pos"], r["cache"], neox)) if hk else q

    return OpCase(name, make, run, ref)


def _rope_fused(name, t_len, hq, hk, d, rot, neox, max_pos=64):
    """q and k are strided views qkv[:, :Hq] and qkv[:, Hq:Hq+Hk] of one fused [T, Hq + 2 Hk, D] buffer."""
    def make(rng, dtype):
        return {"qkv": rng.standard_normal((t_len, hq + 2 * hk, d)), "pos": _positions(rng, (t_len,), max_pos, np.int64),
                "cache": Keep(make_cache(max_pos, rot))}

    def run(t, dt, dev):
        qkv = t["qkv"]
        q, k = qkv[:, :hq, :], qkv[:, hq:hq + hk, :]
        tallow.ops.rotary_embedding(t["pos"], q, k, t["cache"], neox=neox)
        return qkv  # v must come back untouched

    def ref(r):
        out = r["qkv"].copy()
        out[:, :hq] = rope_ref(r["qkv"][:, :hq], r["pos"], r["cache"], neox)
        out[:, hq:hq + hk] = rope_ref(r["qkv"][:, hq:hq + hk], r["pos"], r["cache"], neox)
        return out

    return OpCase(name, make, run, ref)


register(
    _rope("rope[neox]", (9,), 4, 4, 64, 64, True),
    _rope("rope[interleaved]", (9,), 4, 4, 64, 64, False),
    _rope("rope[neox-gqa]", (13,), 8, 2, 32, 32, True),
    _rope("rope[interleaved-gqa]", (13,), 6, 3, 16, 16, False, pos_dtype=np.int32),
    _rope("rope[neox-partial]", (7,), 3, 1, 80, 32, True),            # rot_dim < head_dim: dims >= 32 untouched
    _rope("rope[interleaved-partial]", (7,), 2, 2, 40, 10, False),    # odd rot_dim / 2
    _rope("rope[q-only]", (5,), 3, 0, 64, 64, True, pos_dtype=np.int32),
    _rope("rope[batched-lead]", (2, 6), 4, 2, 32, 24, True),          # positions [B, S], q [B, S, H, D]
    _rope("rope[single-token]", (1,), 16, 4, 128, 128, True, max_pos=4096),  # decode: one random position
    _rope_fused("rope[fused-qkv-neox]", 11, 4, 2, 48, 48, True),
    _rope_fused("rope[fused-qkv-interleaved-partial]", 8, 6, 2, 64, 16, False),
)
