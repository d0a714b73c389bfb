"""Preparing checkpoint tensors for the kernels: dtype conversion (dequantizing GGUF blocks where
a kernel has no quantized path yet) and fusing projections that read the same input."""
from __future__ import annotations

import numpy as np

import tallow
from tallow import _core


def as_dtype(t: tallow.Tensor, dtype: tallow.DType) -> tallow.Tensor:
    """t in `dtype` (a block-typed t is dequantized), contiguous."""
    if t.dtype != dtype:
        t = t.to(dtype)
    return t.contiguous()


def concat_rows(tensors: list[tallow.Tensor]) -> tallow.Tensor:
    """Concatenate 2-D (or 1-D) tensors of one dtype along dim 0, byte-wise (any dtype, block
    types included: rows are whole blocks)."""
    dt = tensors[0].dtype
    if any(t.dtype != dt for t in tensors):
        raise TypeError(f"concat_rows: dtypes differ: {[str(t.dtype) for t in tensors]}")
    if len(tensors) == 1:
        return tensors[0].contiguous()
    inner = tensors[0].shape[1:]
    if any(t.shape[1:] != inner for t in tensors):
        raise ValueError(f"concat_rows: trailing shapes differ: {[t.shape for t in tensors]}")
    raw = np.concatenate([np.ascontiguousarray(t.contiguous().numpy(raw=True)).reshape(-1) for t in tensors])
    rows = sum(t.shape[0] for t in tensors)
    return _core.from_buffer(raw, dt, [rows, *inner])


def split_last(x: tallow.Tensor, sizes: list[int]) -> list[tallow.Tensor]:
    """Views of x [..., sum(sizes)] split along the last dim (no copy)."""
    out, start = [], 0
    for n in sizes:
        out.append(x.narrow(-1, start, n))
        start += n
    return out


def heads_view(x: tallow.Tensor, num_heads: int, head_dim: int) -> tallow.Tensor:
    """A [T, num_heads * head_dim] view whose last dim is contiguous, seen as [T, num_heads, head_dim]."""
    t = x.shape[0]
    return x.as_strided([t, num_heads, head_dim], [x.stride(0), head_dim, 1], x.offset)
