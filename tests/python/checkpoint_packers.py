"""Packers for GPTQ, AWQ and FP8 checkpoints, written from the public format descriptions (independent of
tallow's readers), and float64 references of what each stored layer means.

GPTQ (AutoGPTQ / GPTQModel): qweight int32 [K*bits/32, N], consecutive input channels in rising bit
positions; qzeros int32 [G, N*bits/32] packed the same way along N, storing zero - 1 in the v1 ("gptq")
format and the zero itself in "gptq_v2"; scales [G, N]; g_idx int32 [K] (the group of each input).
AWQ (AutoAWQ GEMM): qweight int32 [K, N/8] with nibble i holding column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i];
qzeros the same along N of [G, N]; scales [G, N].
FP8: float8_e4m3fn bytes with per-tensor, per-channel or per-block float32 scales (value = fp8 * scale).
"""
from __future__ import annotations

import numpy as np

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


# -- integer quantization of a float weight -------------------------------------------------------
def group_index(k: int, group: int, rng=None) -> np.ndarray:
    """g_idx of K inputs: k // group, or (rng given: desc_act) the groups of a random permutation."""
    group = k if group == -1 else group
    g = np.arange(k) // group
    if rng is None:
        return g.astype(np.int32)
    perm = rng.permutation(k)
    out = np.empty(k, np.int32)
    out[perm] = g  # input perm[j] is the j-th in activation order
    return out


def quantize_int(w: np.ndarray, bits: int, g_idx: np.ndarray, sym: bool, zero_range=None):
    """w [N, K] float -> (q [N, K] ints, zeros [G, N] ints, scales [G, N] float16) with
    W ~= scales[g] * (q - zeros[g]) per group g of input channels. zero_range (lo, hi) clamps the zeros (GPTQ
    v1 cannot store a zero of 0)."""
    n, k = w.shape
    qmax = (1 << bits) - 1
    groups = int(g_idx.max()) + 1
    zeros = np.zeros((groups, n), np.int64)
    scales = np.zeros((groups, n), np.float16)
    q = np.zeros((n, k), np.int64)
    for g in range(groups):
        cols = np.nonzero(g_idx == g)[0]
        wg = w[:, cols].astype(np.float64)
        if sym:
            s = np.maximum(np.abs(wg).max(axis=1), 1e-8) / ((qmax + 1) / 2 - 0.5)
            z = np.full(n, (qmax + 1) // 2)
        else:
            lo, hi = np.minimum(wg.min(axis=1), 0), np.maximum(wg.max(axis=1), 0)
            s = np.maximum(hi - lo, 1e-8) / qmax
            z = np.round(-lo / s).astype(np.int64)
        if zero_range is not None:
            z = np.clip(z, *zero_range)
        s16 = s.astype(np.float16)
        scales[g] = s16
        zeros[g] = z
        q[:, cols] = np.clip(np.round(wg / s16.astype(np.float64)[:, None]) + z[:, None], 0, qmax)
    return q, zeros, scales


def dequant_int_reference(q, zeros, scales, g_idx) -> np.ndarray:
    """float64 [N, K]: scales[g_idx[k], n] * (q[n, k] - zeros[g_idx[k], n])."""
    s = scales.astype(np.float64)[g_idx].T  # [N, K]
    z = zeros.astype(np.float64)[g_idx].T
    return s * (q.astype(np.float64) - z)


# -- GPTQ -----------------------------------------------------------------------------------------
def _pack_along_rows(vals: np.ndarray, bits: int) -> np.ndarray:
    per = 32 // bits
    r, c = vals.shape
    v = vals.astype(np.uint64).reshape(r // per, per, c)
    out = np.zeros((r // per, c), np.uint64)
    for j in range(per):
        out |= v[:, j, :] << np.uint64(j * bits)
    return out.astype(np.uint32).view(np.int32)


def _pack_along_cols(vals: np.ndarray, bits: int) -> np.ndarray:
    return np.ascontiguousarray(_pack_along_rows(np.ascontiguousarray(vals.T), bits).T)


def pack_gptq(q, zeros, scales, g_idx, bits: int, fmt: str = "gptq") -> dict:
    """{qweight, qzeros, scales, g_idx} numpy arrays of one layer (q [N, K], zeros/scales [G, N])."""
    mask = (1 << bits) - 1
    stored = (zeros - 1) & mask if fmt == "gptq" else zeros
    return {"qweight": _pack_along_rows(np.ascontiguousarray(q.T), bits),
            "qzeros": _pack_along_cols(stored, bits),
            "scales": np.ascontiguousarray(scales),
            "g_idx": np.ascontiguousarray(g_idx.astype(np.int32))}


# -- AWQ ------------------------------------------------------------------------------------------
def _awq_pack(vals_kn: np.ndarray) -> np.ndarray:
    r, c = vals_kn.shape
    v = vals_kn.astype(np.uint64).reshape(r, c // 8, 8)
    out = np.zeros((r, c // 8), np.uint64)
    for i, col in enumerate(AWQ_PACK_ORDER):
        out |= v[:, :, col] << np.uint64(4 * i)
    return out.astype(np.uint32).view(np.int32)


def pack_awq(q, zeros, scales) -> dict:
    """{qweight, qzeros, scales} of one layer (q [N, K], zeros/scales [G, N])."""
    return {"qweight": _awq_pack(np.ascontiguousarray(q.T)), "qzeros": _awq_pack(zeros),
            "scales": np.ascontiguousarray(scales)}


# -- FP8 ------------------------------------------------------------------------------------------
def e4m3_reference(raw: np.ndarray) -> np.ndarray:
    """float64 of float8_e4m3fn bytes from the bit fields: sign, 4 exponent bits (bias 7), 3 mantissa bits."""
    b = raw.astype(np.int64)
    e, m = (b >> 3) & 15, (b & 7).astype(np.float64)
    mag = np.where(e == 0, m * 2.0 ** -9, (8 + m) * 2.0 ** (e - 10.0))
    return np.where(b >> 7, -mag, mag)


def random_e4m3(rng, shape) -> np.ndarray:
    """Random float8_e4m3fn bytes, every code but the two NaNs."""
    raw = rng.integers(0, 256, size=shape, dtype=np.uint8)
    nan = (raw & 0x7F) == 0x7F
    raw[nan] = raw[nan] ^ 0x01
    return raw


def to_e4m3(x: np.ndarray) -> np.ndarray:
    """Round float values (|x| <= 448) to float8_e4m3fn bytes (nearest, by search over all codes)."""
    codes = np.arange(256, dtype=np.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    vals = e4m3_reference(codes)
    order = np.argsort(vals, kind="stable")
    vals, codes = vals[order], codes[order]
    idx = np.clip(np.searchsorted(vals, x), 1, len(vals) - 1)
    pick = np.where(np.abs(x - vals[idx - 1]) <= np.abs(vals[idx] - x), idx - 1, idx)
    return codes[pick].reshape(x.shape)


def quantize_fp8(w: np.ndarray, strategy: str, block=(128, 128)):
    """w [N, K] -> (fp8 bytes [N, K], float32 scale: [1] tensor, [N, 1] channel, [ceil(N/bn), ceil(K/bk)] block)."""
    n, k = w.shape
    if strategy == "tensor":
        scale = np.array([np.abs(w).max() / 448.0], np.float32)
        full = np.full((n, k), scale[0], np.float64)
    elif strategy == "channel":
        scale = (np.abs(w).max(axis=1, keepdims=True) / 448.0).astype(np.float32)
        full = np.broadcast_to(scale.astype(np.float64), (n, k))
    else:
        bn, bk = block
        scale = np.zeros((-(-n // bn), -(-k // bk)), np.float32)
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                scale[i, j] = np.abs(w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]).max() / 448.0
        full = np.repeat(np.repeat(scale.astype(np.float64), bn, 0), bk, 1)[:n, :k]
    return to_e4m3(w / full), scale


def dequant_fp8_reference(raw: np.ndarray, scale: np.ndarray, strategy: str, block=(128, 128)) -> np.ndarray:
    n, k = raw.shape
    v = e4m3_reference(raw)
    s = scale.astype(np.float64)
    if strategy == "tensor":
        return v * s.reshape(())
    if strategy == "channel":
        return v * s.reshape(n, 1)
    bn, bk = block
    return v * np.repeat(np.repeat(s, bn, 0), bk, 1)[:n, :k]
