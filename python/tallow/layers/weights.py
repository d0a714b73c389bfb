"""Preparing checkpoint tensors for the kernels: dtype conversion (dequantizing GGUF blocks where
a kernel has no quantized path yet) and fusing projections that read the same input."""
from __future__ import annotations

import tallow


def as_dtype(t: tallow.Tensor, dtype: tallow.DType) -> tallow.Tensor:
    """t in `dtype` (a block-typed t is dequantized), contiguous."""
    if t.dtype != dtype:
        t = t.to(dtype)
    return t.contiguous()


def concat_rows(tensors: list[tallow.Tensor]) -> tallow.Tensor:
    """Concatenate tensors of one dtype and device along dim 0 (any dtype, block types included:
    rows are whole blocks); works on every device through copy_."""
    dt = tensors[0].dtype
    if any(t.dtype != dt for t in tensors):
        raise TypeError(f"concat_rows: dtypes differ: {[str(t.dtype) for t in tensors]}")
    if len(tensors) == 1:
        return tensors[0].contiguous()
    inner = tensors[0].shape[1:]
    if any(t.shape[1:] != inner for t in tensors):
        raise ValueError(f"concat_rows: trailing shapes differ: {[t.shape for t in tensors]}")
    out = tallow.empty([sum(t.shape[0] for t in tensors), *inner], dt, tensors[0].device)
    start = 0
    for t in tensors:
        out.narrow(0, start, t.shape[0]).copy_(t)
        start += t.shape[0]
    return out


def move_to_device(obj, device: str, _seen=None):
    """Move every Tensor reachable from a model object's attributes (and lists/tuples/dicts of them)
    to `device`, in place. Models are built on the host and moved once. A tensor reached twice (a
    RoPE cache shared by layers, tied embeddings) is moved once and shared on the device too;
    attributes that do not change are not reassigned (frozen dataclasses such as RopeConfig)."""
    if _seen is None:
        _seen = {}
    if id(obj) in _seen:
        return _seen[id(obj)]
    _seen[id(obj)] = obj  # cycles: an object under way stands for itself
    if isinstance(obj, tallow.Tensor):
        _seen[id(obj)] = moved = obj.to(device)
        return moved
    if isinstance(obj, list):
        for i, v in enumerate(obj):
            moved = move_to_device(v, device, _seen)
            if moved is not v:
                obj[i] = moved
        return obj
    if isinstance(obj, tuple):
        items = tuple(move_to_device(v, device, _seen) for v in obj)
        if any(a is not b for a, b in zip(items, obj)):
            _seen[id(obj)] = obj = items
        return obj
    if isinstance(obj, dict):
        for k, v in list(obj.items()):
            moved = move_to_device(v, device, _seen)
            if moved is not v:
                obj[k] = moved
        return obj
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith("tallow."):
        for k, v in list(vars(obj).items()):
            new = move_to_device(v, device, _seen)
            if new is not v:
                setattr(obj, k, new)
    return obj


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
