"""Views over projection outputs (splitting a fused qkv / gate_up product without copies)."""
from __future__ import annotations

import tallow


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
