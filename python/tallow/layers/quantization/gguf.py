"""GGUF block types (Q4_0 ... Q8_0, K-quants, IQ4_NL / IQ4_XS) kept as stored: the weights stay in their
block dtype in memory (an 8B Q4_K_M stays ~5 GB instead of ~15 GB bf16), and every product is
`tallow.ops.quant_linear(x, w, bias, out=...)` on every device: the op reads the blocks as they are
(CPU: quantized-activation dot products or tiles dequantized in cache; CUDA: its own kernels), so no
path here materializes a dequantized weight.

On an accelerator, a fused layer (qkv, gate_up) whose parts share one block type holds one weight of all
its rows (rows are whole blocks: the copy to the device is made anyway) and runs one quant_linear. On
the CPU every weight is the GGUF file's own tensor, a zero-copy view of its memory map (llama-arch q/k,
whose rows are permuted back on load, are the loader's copies), so a fused layer keeps its parts apart
there. When the parts differ (Q4_K_M stores attn_v as Q6_K beside Q4_K q/k) each part keeps its own
tensor on every device. A layer of several tensors runs one `ops.quant_linear_parts` on the CPU (x
quantized once, one parallel region over all the parts' rows: the pool wakes once per layer, not once
per part); on other devices one quant_linear per part, each writing its columns of the output: straight
into `out` where that slice is contiguous (one row of x: decode of one sequence), else into a scratch
tensor copied into the slice (quant_linear wants a contiguous out; the copy is M x N floats beside an
M x N x K product).

The lm head (its own block-typed output.weight, or tied to a block-typed token table) and MoE experts
(GatedMLPs of these linear layers) take the same path. Float tensors of the same file (norms, F32/F16
matrices) take the unquantized methods in the model's dtype; GGUFConfig decides per layer from the
file's tensor dtypes."""
from __future__ import annotations

from typing import Optional

import tallow
from tallow import ops
from tallow.layers.quantization.base import QuantizationConfig, QuantizeMethodBase, copy_into
from tallow.layers.quantization.unquantized import (
    UnquantizedEmbeddingMethod,
    UnquantizedLinearMethod,
)


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


def _adoptable(dst: tallow.Tensor, src: tallow.Tensor) -> bool:
    """Whether the parameter `dst` can be `src` itself: a CPU tensor of the same dtype and shape (a
    zero-copy view of the mapped GGUF file, or the loader's own copy of a permuted tensor) whose rows are
    contiguous. Keeping it instead of copying leaves the file's pages to the page cache: RSS grows only
    with what a step reads, and the weights are not held twice."""
    return (src.device == "cpu" and dst.device == "cpu" and src.dtype == dst.dtype
            and list(src.shape) == list(dst.shape) and src.is_contiguous())


class GGUFLinearMethod(QuantizeMethodBase):
    def __init__(self, part_dtypes: list):
        self.part_dtypes = list(part_dtypes)

    @property
    def fused(self) -> bool:
        return all(d == self.part_dtypes[0] for d in self.part_dtypes)

    def create_weights(self, layer, dtype, device: str) -> None:
        k = layer.input_size_per_partition
        sizes = layer.output_partition_sizes
        # One weight of all rows where the parts share a type and live on an accelerator (one product);
        # on the CPU each part keeps the file's tensor as it is (no copy), one product per part.
        if self.fused and (device != "cpu" or len(sizes) == 1):
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
            if not off and _adoptable(dst, src):
                layer.weight_parts[part] = src
                return
            if off or src.shape[0] != dst.shape[0]:
                dst = dst.narrow(0, off, src.shape[0])
            copy_into(dst, src)
            return
        if param == "weight" and not row_offset and _adoptable(layer.weight, src):
            layer.weight = src
            return
        super().load(layer, param, src, row_offset, part)

    def apply(self, layer, x: tallow.Tensor, out=None) -> tallow.Tensor:
        if layer.weight_parts is None:
            return ops.quant_linear(x, layer.weight, layer.bias, out=out)
        parts = layer.weight_parts
        if x.device == "cpu":
            # One op for all parts: x quantized once, one parallel region over every part's rows.
            return ops.quant_linear_parts(x, parts, layer.bias, out=out)
        n_total = sum(p.shape[0] for p in parts)
        if out is None:
            out = tallow.empty(list(x.shape[:-1]) + [n_total], x.dtype, x.device)
        start = 0
        for p in parts:
            n = p.shape[0]
            dst = out.narrow(out.ndim - 1, start, n)
            bias = None if layer.bias is None else layer.bias.narrow(0, start, n)
            if dst.is_contiguous():
                ops.quant_linear(x, p, bias, out=dst)
            else:
                dst.copy_(ops.quant_linear(x, p, bias))
            start += n
        return out

    def apply_gated(self, layer, x: tallow.Tensor, activation: str, out=None) -> tallow.Tensor:
        """layer(act(x[..., :K]) * x[..., K:]): the activation, then the same products as apply."""
        if activation == "silu":
            y = ops.silu_and_mul(x)
        else:
            y = ops.gelu_and_mul(x, "tanh" if activation == "gelu_tanh" else "none")
        return self.apply(layer, y, out=out)


class GGUFEmbeddingMethod(QuantizeMethodBase):
    """The token table stays in its block type: ops.embedding dequantizes the rows it reads. On the CPU
    the table is the file's tensor itself (a tied lm head follows it: ParallelLMHead re-ties after
    loading)."""

    def __init__(self, dtype):
        self.storage_dtype = dtype

    def create_weights(self, layer, dtype, device: str) -> None:
        layer.weight = tallow.empty([layer.num_embeddings_per_partition, layer.embedding_dim], self.storage_dtype,
                                    device)

    def load(self, layer, param: str, src: tallow.Tensor, row_offset: int = 0, part: Optional[int] = None) -> None:
        if param == "weight" and not row_offset and _adoptable(layer.weight, src):
            layer.weight = src
            return
        super().load(layer, param, src, row_offset, part)

    def apply(self, layer, ids: tallow.Tensor, vocab_start: Optional[int] = None) -> tallow.Tensor:
        return ops.embedding(ids, layer.weight, layer.dtype, vocab_start)
