"""FP8 (e4m3) checkpoints, dequantized with their scales to the compute dtype after loading
(quant_config.py): on the CPU, and on GPUs until an FP8 GEMM path exists, with one log line saying so.

Layouts, per linear layer W [N, K] stored as `weight` float8_e4m3 [N, K] (W = fp8 value * scale):
    per-tensor   weight_scale  f32 [] or [1]                 quant_method "fp8" (no block size), or
                                                             compressed-tensors strategy "tensor"
    per-channel  weight_scale  f32 [N, 1] or [N]             fbgemm_fp8, compressed-tensors "channel"
    block-wise   weight_scale_inv f32 [ceil(N/bn), ceil(K/bk)]  quant_method "fp8" with weight_block_size
                                                             [bn, bk] (DeepSeek-V3, Qwen3-FP8; "inv" is
                                                             historical: it multiplies), or
                 weight_scale (same shape)                   compressed-tensors strategy "block"
`input_scale` (static activation scales of W8A8 checkpoints) loads and is unused: activations stay in
the compute dtype. e4m3 here is the "fn" variant: bias 7, no infinities, S.1111.111 is NaN (refused).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from tallow.layers.quantization.quant_config import (
    CheckpointQuantConfig,
    DequantizingLinearMethod,
    QuantizationConfigError,
    check_shape,
    field,
    host_array,
    reject,
)

STRATEGIES = ("tensor", "channel", "block")


def e4m3_table() -> np.ndarray:
    """float32 value of each of the 256 float8_e4m3fn bytes (NaN for the two NaN codes)."""
    b = np.arange(256)
    exp, man = (b >> 3) & 0xF, (b & 7).astype(np.float64)
    mag = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    val = np.where(b & 0x80, -mag, mag)
    val[(b & 0x7F) == 0x7F] = np.nan
    return val.astype(np.float32)


E4M3 = e4m3_table()


def decode_e4m3(raw: np.ndarray) -> np.ndarray:
    """uint8 bytes of float8_e4m3fn values -> float32 (exact)."""
    return E4M3[raw]


class FP8Config(CheckpointQuantConfig):
    name = "fp8"

    def __init__(self, strategy: str = "tensor", block: Optional[tuple] = None, scale_name: str = "weight_scale",
                 skip_patterns=(), source: str = "fp8", tensor_dtypes: Optional[dict] = None):
        super().__init__(tensor_dtypes)
        if strategy not in STRATEGIES:
            reject(source, "weight strategy", strategy, STRATEGIES)
        if strategy == "block":
            if (not isinstance(block, (list, tuple)) or len(block) != 2 or
                    not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
                reject(source, "weight_block_size", block, ("[rows, cols] of positive integers, e.g. [128, 128]",))
            block = tuple(block)
        self.strategy, self.block, self.scale_name, self.source = strategy, block, scale_name, source
        self.skip_patterns = tuple(skip_patterns)

    @classmethod
    def from_config(cls, raw: dict, tensor_dtypes: Optional[dict] = None) -> "FP8Config":
        method = str(raw.get("quant_method")).lower().replace("_", "-")
        if method == "fp8":
            fmt = str(field(raw, "fmt", "e4m3")).lower()
            if fmt != "e4m3":
                reject("fp8", "fmt", fmt, ("e4m3",))
            scheme = str(field(raw, "activation_scheme", "dynamic")).lower()
            if scheme not in ("dynamic", "static"):
                reject("fp8", "activation_scheme", scheme, ("dynamic", "static"))
            block = field(raw, "weight_block_size")
            skips = list(field(raw, "ignored_layers", []) or []) + list(field(raw, "modules_to_not_convert", []) or [])
            if block is None:
                return cls("tensor", None, "weight_scale", skips, "fp8", tensor_dtypes)
            return cls("block", block, "weight_scale_inv", skips, "fp8", tensor_dtypes)
        if method == "fbgemm-fp8":
            return cls("channel", None, "weight_scale", list(field(raw, "modules_to_not_convert", []) or []),
                       "fbgemm_fp8", tensor_dtypes)
        return cls._from_compressed_tensors(raw, tensor_dtypes)

    @classmethod
    def _from_compressed_tensors(cls, raw: dict, tensor_dtypes: Optional[dict]) -> "FP8Config":
        src = "compressed-tensors"
        fmt = raw.get("format")
        if fmt is not None and fmt != "float-quantized":
            reject(src, "format", fmt, ("float-quantized",))
        sparsity = raw.get("sparsity_config") or {}
        if sparsity.get("format") not in (None, "dense"):  # 2:4 sparse layouts store other tensors
            reject(src, "sparsity_config.format", sparsity.get("format"), ("dense",))
        groups = raw.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise QuantizationConfigError(f"{src} quantization_config: no config_groups")
        schemes = set()
        for gname, group in groups.items():
            w = (group or {}).get("weights") or {}
            gfmt = (group or {}).get("format")
            if gfmt is not None and gfmt != "float-quantized":
                reject(src, f"config_groups.{gname}.format", gfmt, ("float-quantized",))
            if w.get("type") != "float" or w.get("num_bits") != 8:
                raise QuantizationConfigError(
                    f"{src} quantization_config: config_groups.{gname}.weights type={w.get('type')!r} "
                    f"num_bits={w.get('num_bits')!r} is not supported (only FP8 weights: type 'float', num_bits 8)")
            if w.get("symmetric", True) is not True:
                reject(src, f"config_groups.{gname}.weights.symmetric", w.get("symmetric"), (True,))
            if w.get("dynamic", False):
                reject(src, f"config_groups.{gname}.weights.dynamic", w.get("dynamic"), (False,))
            strategy = w.get("strategy", "tensor")
            block = w.get("block_structure")
            schemes.add((strategy, tuple(block) if isinstance(block, list) else block))
        if len(schemes) != 1:
            raise QuantizationConfigError(f"{src} quantization_config: config groups with different weight schemes "
                                          f"{sorted(map(str, schemes))} are not supported")
        strategy, block = schemes.pop()
        if strategy not in STRATEGIES:
            reject(src, "weights.strategy", strategy, STRATEGIES)
        return cls(strategy, block, "weight_scale", list(raw.get("ignore") or []), src, tensor_dtypes)

    def is_quantized_in_checkpoint(self, module: str) -> bool:
        return self.tensor_dtypes.get(module + ".weight") == "F8_E4M3"

    def describe(self) -> str:
        how = f"block {self.block[0]}x{self.block[1]}" if self.strategy == "block" else f"per-{self.strategy}"
        return f"FP8 e4m3 checkpoint ({self.source}, {how} scales)"

    @property
    def method_cls(self):
        return FP8LinearMethod


class FP8LinearMethod(DequantizingLinearMethod):
    optional_params = ("input_scale",)

    def __init__(self, config: FP8Config):
        super().__init__(config)
        self.checkpoint_params = ("weight", config.scale_name, "input_scale")

    def collect(self, layer, param: str, loaded, part) -> None:
        if param == "input_scale":
            return  # activations stay in the compute dtype
        super().collect(layer, param, loaded, part)

    def dequantize(self, layer, module: str, tensors: dict, rows: int, cols: int) -> np.ndarray:
        c: FP8Config = self.config
        n, k = rows, cols
        wname, sname = module + ".weight", module + "." + c.scale_name
        raw = host_array(tensors["weight"], wname, ("float8_e4m3",), "an FP8 weight")
        check_shape(wname, raw, (n, k), f"{n} outputs x {k} inputs")
        if ((raw & 0x7F) == 0x7F).any():
            raise ValueError(f"{wname}: holds float8_e4m3 NaN values (a corrupt checkpoint?)")
        scale = host_array(tensors[c.scale_name], sname, ("float32", "bfloat16", "float16"), "an FP8 scale")
        w = decode_e4m3(raw)
        if c.strategy == "tensor":
            if scale.size != 1:
                raise ValueError(f"{sname}: shape {list(scale.shape)}, expected one per-tensor scale ([] or [1])")
            return w * scale.reshape(()).astype(np.float32)
        if c.strategy == "channel":
            if scale.shape not in ((n,), (n, 1)):
                raise ValueError(f"{sname}: shape {list(scale.shape)}, expected [{n}, 1] (one scale per output)")
            return w * scale.reshape(n, 1)
        bn, bk = c.block
        check_shape(sname, scale, (-(-n // bn), -(-k // bk)), f"one scale per {bn}x{bk} block of [{n}, {k}]")
        full = np.repeat(np.repeat(scale, bn, axis=0), bk, axis=1)[:n, :k]
        return w * full
