"""Normalisation layers over the last dimension, with the residual add folded in where a kernel allows.

`norm(x)` normalises; `norm.add_norm(x, residual)` does residual += x and returns
(norm(residual), residual) — the pre-norm decoder's "add the sublayer output, normalise for the next
sublayer" step. RMSNorm does it in one kernel (residual updated in place); LayerNorm adds first.

Both are built empty (weights allocated on the model's device in its dtype) and loaded by name.
"""
from __future__ import annotations

from typing import Iterator, Optional

import tallow
from tallow import ops
from tallow.layers.module import Module


class RMSNorm(Module):
    """x / rms(x) * w, or * (1 + w) with gemma_offset (Gemma's norms; checkpoints store w)."""

    param_names = ("weight",)

    def __init__(self, size: int, eps: float, gemma_offset: bool = False, *, prefix: str = "", dtype=tallow.float32,
                 device: str = "cpu"):
        super().__init__(prefix)
        self.weight = tallow.empty([int(size)], dtype, device)
        self.eps = float(eps)
        self.gemma_offset = gemma_offset

    @property
    def w(self) -> tallow.Tensor:
        return self.weight

    def __call__(self, x: tallow.Tensor) -> tallow.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, self.gemma_offset)

    def add_norm(self, x: tallow.Tensor, residual: tallow.Tensor) -> tuple[tallow.Tensor, tallow.Tensor]:
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps, self.gemma_offset), residual

    def dummy_parts(self) -> Iterator[tuple]:
        yield self.weight, self.prefix + ".weight", "gemma_norm" if self.gemma_offset else "norm", 0


class LayerNorm(Module):
    """(x - mean) / sqrt(var + eps) * w + b (b optional). With num_heads, a per-head norm of x [T, H, D]
    (StableLM's qk_layernorm: w [H, D], one checkpoint tensor per head under prefix.norms.{h}.weight):
    normalised without weight, then multiplied by w."""

    param_names = ("weight", "bias")

    def __init__(self, size: int, eps: float, bias: bool = True, *, num_heads: Optional[int] = None,
                 prefix: str = "", dtype=tallow.float32, device: str = "cpu"):
        super().__init__(prefix)
        self.num_heads = num_heads
        self.per_head = num_heads is not None
        shape = [int(num_heads), int(size)] if self.per_head else [int(size)]
        self.weight = tallow.empty(shape, dtype, device)
        self.bias = tallow.empty(shape, dtype, device) if bias else None
        self.eps = float(eps)

    @property
    def w(self):
        return self.weight

    @property
    def b(self):
        return self.bias

    def checkpoint_map(self) -> dict:
        if not self.per_head:
            return super().checkpoint_map()
        out = {f"{self.prefix}.norms.{h}.weight": ("weight", h) for h in range(self.num_heads)}
        if self.bias is not None:
            out.update({f"{self.prefix}.norms.{h}.bias": ("bias", h) for h in range(self.num_heads)})
        return out

    def weight_loader(self, param: str, loaded: tallow.Tensor, shard_id=None) -> None:
        from tallow.layers.quantization.base import copy_into

        dst = getattr(self, param)
        if shard_id is not None:
            dst = dst.narrow(0, int(shard_id), 1)
        copy_into(dst, loaded)
        self._loaded.add((param, shard_id))

    def dummy_parts(self) -> Iterator[tuple]:
        if self.per_head:
            for h in range(self.num_heads):
                yield self.weight.narrow(0, h, 1), f"{self.prefix}.norms.{h}.weight", "norm", 0
            return
        yield self.weight, self.prefix + ".weight", "norm", 0
        if self.bias is not None:
            yield self.bias, self.prefix + ".bias", "bias", 0

    def __call__(self, x: tallow.Tensor) -> tallow.Tensor:
        if self.per_head:
            y = ops.layer_norm(x, None, None, self.eps)
            y = ops.mul(y, self.weight)
            return y if self.bias is None else ops.add(y, self.bias)
        return ops.layer_norm(x, self.weight, self.bias, self.eps)

    def add_norm(self, x: tallow.Tensor, residual: tallow.Tensor) -> tuple[tallow.Tensor, tallow.Tensor]:
        residual = ops.add(residual, x)
        return self(residual), residual


def make_norm(kind: str, size: int, eps: float, *, bias: bool = False, prefix: str = "", dtype=tallow.float32,
              device: str = "cpu"):
    """kind: "rms_norm", "gemma_rms_norm" ((1 + w)) or "layer_norm" (with a bias when `bias`)."""
    if kind == "layer_norm":
        return LayerNorm(size, eps, bias, prefix=prefix, dtype=dtype, device=device)
    if kind in ("rms_norm", "gemma_rms_norm"):
        return RMSNorm(size, eps, gemma_offset=kind == "gemma_rms_norm", prefix=prefix, dtype=dtype, device=device)
    raise ValueError(f"unknown norm kind {kind!r}")
