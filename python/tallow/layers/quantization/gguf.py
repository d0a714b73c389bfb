"""GGUF block types (Q4_0 ... Q8_0, K-quants) kept as stored: the weights stay in their block dtype in
memory (an 8B Q4_K_M stays ~5 GB instead of ~15 GB bf16), and each product dequantizes them per call
(the fast quantized kernels are the next issue):

- CPU: `tallow.ops.dequant_linear(x, w, bias)` when the build has it (a linear on block weights that
  dequantizes tiles in cache), else ops.dequantize(w, dtype) + ops.linear;
- CUDA: ops.dequantize(w, dtype) + ops.linear.

A fused layer (qkv, gate_up) whose parts share one block type holds one weight of all its rows (rows
are whole blocks); when the parts differ (Q4_K_M stores attn_v as Q6_K beside Q4_K q/k) each part keeps
its own tensor and the product dequantizes them into one weight per call.

Float tensors of the same file (norms, F32/F16 matrices) take the unquantized methods in the model's
dtype; GGUFConfig decides per layer from the file's tensor dtypes."""
from __future__ import annotations

from typing import Optional

import tallow
from tallow import ops
from tallow.layers.quantization.base import QuantizationConfig, QuantizeMethodBase, copy_into
from tallow.layers.quantization.unquantized import (
    UnquantizedEmbeddingMethod,
    UnquantizedLinearMethod,
)


def _dequant_linear_op():
    return getattr(ops, "dequant_linear", None)


class GGUFConfig(QuantizationConfig):
    name = "gguf"

    def __init__(self, weight_dtypes: Optional[dict] = None):
        # {Hugging Face weight name: tallow dtype} of the file's tensors (after the loader's renaming)
        self.weight_dtypes = dict(weight_dtypes or {})

    def _part_dtypes(self, layer) -> Optional[list]:
        """The block dtype of each part of `layer`'s weight, None when no part is block-typed."""
        names = layer.checkpoint_weight_names()  # [fused name, [part names]]
        fused, parts = names
        dt = self.weight_dtypes.get(fused)
        if dt is not None:
            dts = [dt] * len(parts)
        else:
            dts = [self.weight_dtypes.get(p) for p in parts]
        if not any(d is not None and d.is_block for d in dts):
            return None
        return dts

    def get_linear_method(self, layer) -> QuantizeMethodBase:
        dts = self._part_dtypes(layer)
        if dts is None:
            return UnquantizedLinearMethod()
        return GGUFLinearMethod(dts)

    def get_embedding_method(self, layer) -> QuantizeMethodBase:
        dts = self._part_dtypes(layer)
        if dts is None:
            return UnquantizedEmbeddingMethod()
        return GGUFEmbeddingMethod(dts[0])


class GGUFLinearMethod(QuantizeMethodBase):
    def __init__(self, part_dtypes: list):
        self.part_dtypes = list(part_dtypes)

    @property
    def fused(self) -> bool:
        return all(d == self.part_dtypes[0] for d in self.part_dtypes)

    def create_weights(self, layer, dtype, device: str) -> None:
        k = layer.input_size_per_partition
        sizes = layer.output_partition_sizes
        if self.fused:
            layer.weight = tallow.empty([sum(sizes), k], self.part_dtypes[0], device)
            layer.weight_parts = None
        else:  # a float part of a mixed layer is stored in the model's dtype
            layer.weight = None
            layer.weight_parts = [tallow.empty([n, k], dt if dt is not None and dt.is_block else dtype, device)
                                  for n, dt in zip(sizes, self.part_dtypes)]
        layer.bias = tallow.empty([sum(sizes)], dtype, device) if layer.has_bias else None
        layer.compute_dtype = dtype

    def load(self, layer, param: str, src: tallow.Tensor, row_offset: int = 0, part: Optional[int] = None) -> None:
        if param == "weight" and layer.weight_parts is not None:
            if part is None:  # a fused checkpoint tensor over parts stored apart: cannot happen in one file
                raise ValueError(f"{layer.prefix}: a fused tensor for a layer whose parts differ in type")
            start = sum(layer.output_partition_sizes[:part])
            dst = layer.weight_parts[part]
            off = row_offset - start
            if off or src.shape[0] != dst.shape[0]:
                dst = dst.narrow(0, off, src.shape[0])
            copy_into(dst, src)
            return
        super().load(layer, param, src, row_offset, part)

    def dequantized(self, layer, dtype) -> tallow.Tensor:
        """The weight in `dtype` (a transient tensor)."""
        if layer.weight_parts is None:
            return ops.dequantize(layer.weight, dtype)
        parts = layer.weight_parts
        out = tallow.empty([sum(p.shape[0] for p in parts), parts[0].shape[1]], dtype, parts[0].device)
        start = 0
        for p in parts:
            out.narrow(0, start, p.shape[0]).copy_(ops.dequantize(p, dtype) if p.dtype.is_block else
                                                   (p if p.dtype == dtype else p.to(dtype)))
            start += p.shape[0]
        return out

    def apply(self, layer, x: tallow.Tensor, out=None) -> tallow.Tensor:
        if x.device == "cpu" and layer.weight_parts is None:
            dl = _dequant_linear_op()
            if dl is not None:
                return dl(x, layer.weight, layer.bias, out=out)
        return ops.linear(x, self.dequantized(layer, x.dtype), layer.bias, out=out)

    def apply_gated(self, layer, x: tallow.Tensor, activation: str, out=None) -> tallow.Tensor:
        if x.device == "cpu" and layer.weight_parts is None and _dequant_linear_op() is not None:
            k = x.shape[-1] // 2
            if activation == "silu":
                y = ops.silu_and_mul(x)
            else:
                y = ops.gelu_and_mul(x, "tanh" if activation == "gelu_tanh" else "none")
            assert y.shape[-1] == k
            return self.apply(layer, y, out=out)
        return ops.gated_linear(x, self.dequantized(layer, x.dtype), layer.bias, activation=activation, out=out)


class GGUFEmbeddingMethod(QuantizeMethodBase):
    """The token table stays in its block type: ops.embedding dequantizes the rows it reads."""

    def __init__(self, dtype):
        self.storage_dtype = dtype

    def create_weights(self, layer, dtype, device: str) -> None:
        layer.weight = tallow.empty([layer.num_embeddings_per_partition, layer.embedding_dim], self.storage_dtype,
                                    device)

    def apply(self, layer, ids: tallow.Tensor) -> tallow.Tensor:
        return ops.embedding(ids, layer.weight, layer.dtype)
