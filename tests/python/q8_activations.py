"""The CPU quantized-dot kernels' 8-bit activation rounding, emulated for tests (cpp/ops/quant_dot.cpp
quantize_rows): for M <= DECODE_MAX_M rows of x, each block of 32 elements (256 for the K-quants and IQ4_XS)
becomes d * q with d = max|x| / 127 and q = nearest-even(x * 127 / max|x|), in f32. Against x quantized this
way the kernels are exact up to f32 accumulation."""
import numpy as np

DECODE_MAX_M = 4  # kDecodeMaxM in cpp/ops/quant_linear.cpp
UNQUANTIZED_ACT = ("q8_1", "q8_k")  # weight types that always take the dequantized-tile path
K_BLOCK_TYPES = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs")


def act_block(name: str, M: int) -> int:
    """Elements per 8-bit activation block when quant_linear on weights of type `name` takes its decode
    path for M rows, else 0 (x used as is)."""
    if M > DECODE_MAX_M or name in UNQUANTIZED_ACT:
        return 0
    return 256 if name in K_BLOCK_TYPES else 32


def quantize_act(x64: np.ndarray, blk: int):
    """(d per element [M, K], dequantized x [M, K]) both float64, as the kernel rounds x."""
    x = x64.astype(np.float32).reshape(x64.shape[0], -1, blk)
    amax = np.abs(x).max(axis=-1, keepdims=True)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(x * inv)
    return (np.broadcast_to(d, x.shape).reshape(x64.shape).astype(np.float64),
            (q.astype(np.float64) * d.astype(np.float64)).reshape(x64.shape))


def as_kernel_sees(x: np.ndarray, name: str) -> np.ndarray:
    """x (float64) as the CPU kernel for weights of type `name` uses it."""
    x64 = np.asarray(x, np.float64)
    blk = act_block(name, x64.shape[0])
    return quantize_act(x64, blk)[1] if blk else x64
