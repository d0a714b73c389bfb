"""Quantization methods: how a layer's weights are created, loaded (this rank's shard) and applied.

A QuantizationConfig is picked once per model from the checkpoint (`config_for_checkpoint`) and asked,
per layer, for the method that layer's parameters use (vLLM's QuantizationConfig.get_quant_method):

    unquantized  UnquantizedLinearMethod / UnquantizedEmbeddingMethod (layers/quantization/unquantized.py)
    gguf         GGUFLinearMethod / GGUFEmbeddingMethod for block-typed tensors, the unquantized ones
                 for float tensors of the same file (layers/quantization/gguf.py)
    isq          in-situ quantization of float checkpoints to GGUF block types while loading (--isq q4k;
                 layers/quantization/isq.py): ISQConfig, built by `isq_config(name, model_config)`
    gptq / awq / fp8   checkpoints quantized by other tools, read from config.json's quantization_config
                 (layers/quantization/quant_config.py; gptq.py, awq.py, fp8.py), dequantized to the compute
                 dtype after loading

A new format (GPTQ, AWQ, FP8, ...) is one more module here with its config class and methods, registered
with `register_quantization("name", ConfigClass)`; `config_for_checkpoint` picks it from the checkpoint.
"""
from __future__ import annotations

from typing import Optional

from tallow.layers.quantization.base import (  # noqa: F401
    QuantizationConfig,
    QuantizeMethodBase,
    UnquantizedConfig,
)

_FORMATS: dict[str, type] = {}


def register_quantization(name: str, config_cls: type) -> None:
    """Make a quantization format available by name (its config class builds the per-layer methods)."""
    _FORMATS[name] = config_cls


def quantization_formats() -> list[str]:
    _load_builtin()
    return sorted(_FORMATS)


def _load_builtin() -> None:
    if "unquantized" not in _FORMATS:
        from tallow.layers.quantization.awq import AWQConfig
        from tallow.layers.quantization.fp8 import FP8Config
        from tallow.layers.quantization.gguf import GGUFConfig
        from tallow.layers.quantization.gptq import GPTQConfig

        _FORMATS["unquantized"] = UnquantizedConfig
        _FORMATS["gguf"] = GGUFConfig
        _FORMATS["gptq"] = GPTQConfig
        _FORMATS["awq"] = AWQConfig
        _FORMATS["fp8"] = FP8Config


def get_quantization_config(name: str, **kwargs) -> QuantizationConfig:
    _load_builtin()
    try:
        cls = _FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown quantization {name!r}; known: {', '.join(sorted(_FORMATS))}") from None
    return cls(**kwargs)


def isq_config(name: str, model_config) -> QuantizationConfig:
    """The config that quantizes a float checkpoint to `name` (an --isq value: q4_0 ... q8_0, q2k ... q6k)
    while it loads; ValueError listing the valid names for an unknown one."""
    from tallow.layers.quantization.isq import isq_config as make

    return make(name, model_config)


def config_for_checkpoint(source=None, weight_dtypes: Optional[dict] = None) -> QuantizationConfig:
    """The quantization config of a checkpoint: GGUF files -> GGUFConfig over their tensor dtypes
    (`weight_dtypes`: {Hugging Face name: tallow dtype}); a safetensors folder whose config.json (or
    quantize_config.json) has a quantization_config -> GPTQConfig / AWQConfig / FP8Config (ValueError
    naming what is not supported); everything else unquantized."""
    _load_builtin()
    if source is not None and getattr(source, "kind", None) == "gguf":
        if weight_dtypes is None:
            from tallow.loader.gguf_weights import GGUFWeights

            weight_dtypes = GGUFWeights(source.gguf).dtypes()
        return get_quantization_config("gguf", weight_dtypes=weight_dtypes)
    if source is not None and getattr(source, "kind", None) == "safetensors":
        from tallow.layers.names import text_name
        from tallow.layers.quantization.quant_config import config_from_checkpoint

        # the checkpoint's names and dtypes from the headers (no tensor data is read)
        ckpt = source.checkpoint()
        dtypes = {text_name(n): info.dtype for n, info in ckpt.infos.items() if text_name(n) is not None}
        ckpt.close()
        config = config_from_checkpoint(source.model_dir, dtypes)
        if config is not None:
            return config
    return get_quantization_config("unquantized")
