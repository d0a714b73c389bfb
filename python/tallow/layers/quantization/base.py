"""The quantization-method interface (in the manner of vLLM's QuantizeMethodBase) and the config that
hands a method to each layer."""
from __future__ import annotations

from typing import Optional

import tallow


class QuantizeMethodBase:
    """Owns a layer's parameters. Three duties:

    create_weights(layer, dtype, device)   allocate the parameters (this rank's shard) on the device,
                                           as attributes of the layer named in layer.param_names
    load(layer, param, src, row_offset)    copy one checkpoint tensor (already narrowed to this rank's
                                           shard by the layer) into rows [row_offset, ...) of `param`
    apply(layer, x, ...)                   the product

    process_weights_after_loading(layer) runs once every tensor is in (repacking, for kernels that
    want another layout)."""

    def create_weights(self, layer, dtype, device: str) -> None:
        raise NotImplementedError

    def load(self, layer, param: str, src: tallow.Tensor, row_offset: int = 0, part: Optional[int] = None) -> None:
        """Copy `src` into rows [row_offset, row_offset + rows of src) of the parameter (all of it when
        the shapes agree). `part` is the part index of a fused layer (methods that keep parts apart use it)."""
        dst = getattr(layer, param)
        if row_offset or (src.ndim == dst.ndim and src.shape[0] != dst.shape[0]):
            dst = dst.narrow(0, row_offset, src.shape[0])
        copy_into(dst, src)

    def process_weights_after_loading(self, layer) -> None:
        pass

    def apply(self, layer, x: tallow.Tensor, *args, **kwargs) -> tallow.Tensor:
        raise NotImplementedError


def copy_into(dst: tallow.Tensor, src: tallow.Tensor) -> None:
    """dst[...] = src, converting dtype (dequantizing blocks) and moving devices as needed, one checkpoint
    tensor at a time (the only transient copy is of that tensor)."""
    if list(src.shape) != list(dst.shape):
        if src.numel() == dst.numel() and not src.dtype.is_block:
            src = src.contiguous().view(*dst.shape) if dst.ndim else src.contiguous().view(1)
        else:
            raise ValueError(f"shape {list(src.shape)} does not fit the parameter's {list(dst.shape)}")
    if src.device != dst.device:
        src = (src if src.is_contiguous() else src.contiguous()).to(dst.device)
    if src.dtype != dst.dtype:
        src = src.to(dst.dtype)
    dst.copy_(src)


class QuantizationConfig:
    """Picks each layer's method. `name` is the format's registered name."""

    name = "base"

    def get_linear_method(self, layer) -> QuantizeMethodBase:
        raise NotImplementedError

    def get_embedding_method(self, layer) -> QuantizeMethodBase:
        raise NotImplementedError


class UnquantizedConfig(QuantizationConfig):
    name = "unquantized"

    def get_linear_method(self, layer) -> QuantizeMethodBase:
        from tallow.layers.quantization.unquantized import UnquantizedLinearMethod

        return UnquantizedLinearMethod()

    def get_embedding_method(self, layer) -> QuantizeMethodBase:
        from tallow.layers.quantization.unquantized import UnquantizedEmbeddingMethod

        return UnquantizedEmbeddingMethod()


UNQUANTIZED: Optional[UnquantizedConfig] = UnquantizedConfig()
