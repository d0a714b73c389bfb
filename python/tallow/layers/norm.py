"""Normalisation layers over the last dimension, with the residual add folded in where a kernel allows.

`norm(x)` normalises; `norm.add_norm(x, residual)` does residual += x and returns
(norm(residual), residual) — the pre-norm decoder's "add the sublayer output, normalise for the next
sublayer" step. RMSNorm does it in one kernel (residual updated in place); LayerNorm adds first.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

import tallow
from tallow import ops
from tallow.layers.weights import as_dtype


class RMSNorm:
    """x / rms(x) * w, or * (1 + w) with gemma_offset (Gemma's norms; checkpoints store w)."""

    def __init__(self, w: tallow.Tensor, eps: float, gemma_offset: bool = False):
        self.w = w
        self.eps = float(eps)
        self.gemma_offset = gemma_offset

    def __call__(self, x: tallow.Tensor) -> tallow.Tensor:
        return ops.rms_norm(x, self.w, self.eps, self.gemma_offset)

    def add_norm(self, x: tallow.Tensor, residual: tallow.Tensor) -> tuple[tallow.Tensor, tallow.Tensor]:
        return ops.fused_add_rms_norm(x, residual, self.w, self.eps, self.gemma_offset), residual

    def linear(self, x: tallow.Tensor, w: tallow.Tensor, bias: Optional[tallow.Tensor] = None) -> tallow.Tensor:
        """linear(self(x), w, bias): one GEMV on CUDA for decode shapes (ops.rms_norm_linear)."""
        return ops.rms_norm_linear(x, self.w, self.eps, self.gemma_offset, w, bias)


class LayerNorm:
    """(x - mean) / sqrt(var + eps) * w + b (w and b optional). A 2-D w [H, D] is a per-head norm of
    x [T, H, D] (StableLM's qk_layernorm): normalised without weight, then multiplied by w."""

    def __init__(self, w: Optional[tallow.Tensor], b: Optional[tallow.Tensor], eps: float):
        self.per_head = w is not None and w.ndim == 2
        self.w = w
        self.b = b
        self.eps = float(eps)

    def __call__(self, x: tallow.Tensor) -> tallow.Tensor:
        if self.per_head:
            y = ops.layer_norm(x, None, None, self.eps)
            y = ops.mul(y, self.w)
            return y if self.b is None else ops.add(y, self.b)
        return ops.layer_norm(x, self.w, self.b, self.eps)

    def add_norm(self, x: tallow.Tensor, residual: tallow.Tensor) -> tuple[tallow.Tensor, tallow.Tensor]:
        residual = ops.add(residual, x)
        return self(residual), residual


def make_norm(kind: str, w: tallow.Tensor, eps: float, dtype, b: Optional[tallow.Tensor] = None):
    """kind: "rms_norm", "gemma_rms_norm" ((1 + w)) or "layer_norm" (with optional bias b)."""
    w = as_dtype(w, dtype)
    if kind == "layer_norm":
        return LayerNorm(w, None if b is None else as_dtype(b, dtype), eps)
    if kind in ("rms_norm", "gemma_rms_norm"):
        return RMSNorm(w, eps, gemma_offset=kind == "gemma_rms_norm")
    raise ValueError(f"unknown norm kind {kind!r}")


def stack_rows(tensors: list[tallow.Tensor], dtype) -> tallow.Tensor:
    """1-D tensors [D] stacked into [len, D] in `dtype` (per-head norm weights)."""
    arrs = [np.asarray(as_dtype(t, tallow.float32).numpy(), dtype=np.float32) for t in tensors]
    return as_dtype(tallow.from_numpy(np.ascontiguousarray(np.stack(arrs))), dtype)
