"""RoPE inverse frequencies and cos/sin caches, computed in float64 with numpy exactly as
transformers' ROPE_INIT_FUNCTIONS (transformers.modeling_rope_utils) do, then cast.

Cache layout (what tallow's `rotary_embedding` op consumes, cpp/ops/rope.h): float32
[max_positions, rotary_dim], cos(pos * inv_freq) in the first rotary_dim/2 columns and
sin(pos * inv_freq) in the rest.

The attention factor (yarn's mscale, longrope's sqrt(1 + log(s)/log(L))) is FOLDED INTO the cache:
both cos and sin are multiplied by it, as transformers' rotary modules (`cos = emb.cos() *
attention_scaling`) and vLLM's YaRN / LongRoPE caches do; `rope_inv_freq` returns it separately.

Static caches and the two length-dependent types: transformers recomputes `dynamic` (NTK) and picks
`longrope`'s long or short factors from the current sequence length. A cache is built once, so both
are evaluated at `seq_len` (default: max_positions): dynamic uses the NTK base for that length (the
plain base when it does not exceed max_position_embeddings), longrope the long factors when it
exceeds original_max_position_embeddings, else the short ones.

No torch import: this module is runtime code.
"""
from __future__ import annotations

import math

import numpy as np

from tallow.config import RopeConfig

__all__ = ["rope_inv_freq", "build_cos_sin_cache", "llama4_attn_scale"]


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(rope: RopeConfig, rotary_dim: int, seq_len: int | None = None) -> tuple[np.ndarray, float]:
    """(inv_freq float64 [rotary_dim/2], attention_factor) for `rope`, as transformers'
    ROPE_INIT_FUNCTIONS[rope.type](config, seq_len=seq_len) computes them (in float64)."""
    dim = int(rotary_dim)
    if dim <= 0 or dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    base = float(rope.theta)
    exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
    t = rope.type
    attention_factor = 1.0

    if rope.freq_factors is not None:
        ff = np.asarray(rope.freq_factors, dtype=np.float64)
        if ff.shape != (dim // 2,):
            raise ValueError(f"freq_factors has {ff.size} entries, rotary_dim {dim} needs {dim // 2}")
        if t not in ("default", "llama3", "linear"):
            raise ValueError(f"freq_factors cannot be combined with RoPE type {t!r}")
        inv_freq = 1.0 / (base ** exponents) / ff
        if t == "linear":
            inv_freq = inv_freq / float(rope.factor)
        return inv_freq, attention_factor

    if t == "default":
        inv_freq = 1.0 / (base ** exponents)

    elif t == "linear":
        inv_freq = 1.0 / (base ** exponents) / float(rope.factor)

    elif t == "dynamic":
        mpe = int(rope.max_position_embeddings)
        n = mpe if seq_len is None else max(int(seq_len), mpe)
        factor = float(rope.factor)
        base = base * ((factor * n / mpe) - (factor - 1)) ** (dim / (dim - 2))
        inv_freq = 1.0 / (base ** exponents)

    elif t == "llama3":
        inv_freq = 1.0 / (base ** exponents)
        factor = float(rope.factor)
        low_freq_factor = float(rope.low_freq_factor)
        high_freq_factor = float(rope.high_freq_factor)
        old_context_len = float(rope.original_max_position_embeddings)
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        inv_freq = np.where(is_medium, smoothed, inv_freq_llama)

    elif t == "yarn":
        orig = int(rope.original_max_position_embeddings)
        factor = rope.factor
        if factor is None:
            factor = rope.max_position_embeddings / orig
        factor = float(factor)
        if rope.attention_factor is not None:
            attention_factor = float(rope.attention_factor)
        elif rope.mscale and rope.mscale_all_dim:
            attention_factor = _yarn_get_mscale(factor, rope.mscale) / _yarn_get_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = _yarn_get_mscale(factor)
        beta_fast = rope.beta_fast or 32
        beta_slow = rope.beta_slow or 1

        def correction_dim(num_rotations):
            return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

        low = correction_dim(beta_fast)
        high = correction_dim(beta_slow)
        if rope.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # transformers: prevent singularity
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
        extrapolation_factor = 1.0 - ramp
        pos_freqs = base ** exponents
        inv_freq_extrapolation = 1.0 / pos_freqs
        inv_freq_interpolation = 1.0 / (factor * pos_freqs)
        inv_freq = (inv_freq_interpolation * (1 - extrapolation_factor)
                    + inv_freq_extrapolation * extrapolation_factor)

    elif t == "longrope":
        orig = int(rope.original_max_position_embeddings)
        factor = rope.factor
        if factor is None:
            factor = rope.max_position_embeddings / orig
        factor = float(factor)
        if rope.attention_factor is not None:
            attention_factor = float(rope.attention_factor)
        elif factor <= 1.0:
            attention_factor = 1.0
        else:
            attention_factor = math.sqrt(1 + math.log(factor) / math.log(orig))
        use_long = seq_len is not None and int(seq_len) > orig
        ext = np.asarray(rope.long_factor if use_long else rope.short_factor, dtype=np.float64)
        if ext.shape != (dim // 2,):
            raise ValueError(f"longrope {'long' if use_long else 'short'}_factor has {ext.size} entries, "
                             f"rotary_dim {dim} needs {dim // 2}")
        inv_freq = 1.0 / (ext * base ** exponents)

    else:  # RopeConfig validates its type; keep the error for hand-made objects
        raise ValueError(f"unsupported RoPE type {t!r}")

    return np.asarray(inv_freq, dtype=np.float64), float(attention_factor)


def build_cos_sin_cache(rope: RopeConfig, rotary_dim: int, max_positions: int, *, seq_len: int | None = None,
                        dtype=np.float32) -> np.ndarray:
    """[max_positions, rotary_dim] cache: cos in the first rotary_dim/2 columns, sin in the rest, both
    multiplied by the attention factor (see the module docstring). `seq_len` (default max_positions)
    is the length dynamic/longrope are evaluated at. Computed in float64, returned as `dtype`."""
    n = int(max_positions)
    if n <= 0:
        raise ValueError(f"max_positions must be positive, got {max_positions}")
    inv_freq, attention_factor = rope_inv_freq(rope, rotary_dim, n if seq_len is None else seq_len)
    freqs = np.outer(np.arange(n, dtype=np.float64), inv_freq)
    cache = np.concatenate([np.cos(freqs), np.sin(freqs)], axis=1)
    if attention_factor != 1.0:
        cache *= attention_factor
    return np.ascontiguousarray(cache, dtype=dtype)


def llama4_attn_scale(positions, beta: float, original_max_position_embeddings: int) -> np.ndarray:
    """Ministral 3 / Llama 4 query scaling per position (float32 [T]):
    1 + beta * log(1 + floor(pos / original_max_position_embeddings))."""
    pos = np.asarray(positions, dtype=np.float64)
    return (1.0 + beta * np.log1p(np.floor(pos / original_max_position_embeddings))).astype(np.float32)
