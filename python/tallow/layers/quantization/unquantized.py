"""Weights in the model's dtype: the existing fast paths (ops.linear, ops.gated_linear with the activation
folded into the down projection, fused qkv / gate_up GEMMs; the runner's CUDA graphs capture them as
before)."""
from __future__ import annotations

from typing import Optional

import tallow
from tallow import ops
from tallow.layers.quantization.base import QuantizeMethodBase


class UnquantizedLinearMethod(QuantizeMethodBase):
    def create_weights(self, layer, dtype, device: str) -> None:
        rows = sum(layer.output_partition_sizes)
        layer.weight = tallow.empty([rows, layer.input_size_per_partition], dtype, device)
        layer.bias = tallow.empty([rows], dtype, device) if layer.has_bias else None

    def apply(self, layer, x: tallow.Tensor, out=None) -> tallow.Tensor:
        return ops.linear(x, layer.weight, layer.bias, out=out)

    def apply_gated(self, layer, x: tallow.Tensor, activation: str, out=None) -> tallow.Tensor:
        """linear(act(x[:, :K]) * x[:, K:]) in one op (one kernel for decode shapes on CUDA)."""
        return ops.gated_linear(x, layer.weight, layer.bias, activation=activation, out=out)


class UnquantizedEmbeddingMethod(QuantizeMethodBase):
    def create_weights(self, layer, dtype, device: str) -> None:
        layer.weight = tallow.empty([layer.num_embeddings_per_partition, layer.embedding_dim], dtype, device)

    def apply(self, layer, ids: tallow.Tensor, vocab_start: Optional[int] = None) -> tallow.Tensor:
        return ops.embedding(ids, layer.weight, layer.dtype, vocab_start)
