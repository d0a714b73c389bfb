"""Checkpoints quantized by another tool (GPTQ, AWQ, FP8): their `quantization_config`, read from
config.json (or quantize_config.json / quant_config.json beside it) and validated, and what the three
formats share: a layer method that collects the checkpoint's packed tensors while they stream in and,
once all are in, dequantizes them into an ordinary weight in the compute dtype.

`config_from_checkpoint(model_dir, tensor_dtypes)` gives the format's QuantizationConfig, or None for a
float checkpoint. Any method, bit width or field value this package does not run is one ValueError
naming it, before a weight is read.

Which layers are quantized: where the checkpoint's tensor names are known (always, through
config_for_checkpoint), the checkpoint says so itself: a layer is GPTQ/AWQ when its `qweight` is there,
FP8 when its `weight` is float8_e4m3. That covers `lm_head`, `modules_to_not_convert`, `ignore` and
GPTQModel's per-module skips without guessing. Without names (a config built by hand), those lists
decide. A fused layer (qkv, gate_up) whose parts disagree is an error naming it.
"""
from __future__ import annotations

import json
import logging
import os
import re
from typing import Optional

import numpy as np

import tallow
from tallow.layers.quantization.base import QuantizationConfig, QuantizeMethodBase, copy_into
from tallow.layers.quantization.unquantized import (
    UnquantizedEmbeddingMethod,
    UnquantizedLinearMethod,
)

log = logging.getLogger("tallow.quantization")

# quant_method values of this package's formats (config.json spelling), and others named in errors
SUPPORTED_METHODS = ("gptq", "awq", "fp8", "fbgemm_fp8", "compressed-tensors")
CONFIG_FILES = ("quantize_config.json", "quant_config.json")  # AutoGPTQ / older AutoAWQ beside config.json


class QuantizationConfigError(ValueError):
    """A quantization_config this package cannot run (another method, bit width or field value)."""


def read_quantization_config(model_dir: str) -> Optional[dict]:
    """The raw quantization_config of a Hugging Face folder: config.json's, else quantize_config.json's
    (AutoGPTQ) or quant_config.json's (AutoAWQ); None when there is none."""
    path = os.path.join(model_dir, "config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            try:
                cfg = json.load(f)
            except json.JSONDecodeError:
                cfg = None  # config.py reports a broken config.json with its own message
        qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
        if qc is not None:
            if not isinstance(qc, dict):
                raise QuantizationConfigError(f"{path}: quantization_config is not an object")
            return qc
    for name in CONFIG_FILES:
        p = os.path.join(model_dir, name)
        if os.path.isfile(p):
            try:
                with open(p, encoding="utf-8") as f:
                    qc = json.load(f)
            except json.JSONDecodeError as e:
                raise QuantizationConfigError(f"{p}: not valid JSON ({e})") from None
            if not isinstance(qc, dict):
                raise QuantizationConfigError(f"{p}: not a JSON object")
            if name == "quant_config.json" and "quant_method" not in qc:
                qc = {"quant_method": "awq", **qc}  # AutoAWQ's own file names no method
            if name == "quantize_config.json" and "quant_method" not in qc:
                qc = {"quant_method": "gptq", **qc}
            return qc
    return None


def config_from_checkpoint(model_dir: Optional[str], tensor_dtypes: Optional[dict] = None
                           ) -> Optional[QuantizationConfig]:
    """The QuantizationConfig of a checkpoint folder's quantization_config, None for a float checkpoint.
    tensor_dtypes: {tensor name: safetensors dtype ("I32", "F8_E4M3", ...)} of the checkpoint. A float
    checkpoint holding float8_e4m3 tensors is refused: without its scales they would be upcast wrong."""
    raw = read_quantization_config(model_dir) if model_dir else None
    if raw is None:
        fp8 = [n for n, d in (tensor_dtypes or {}).items() if d == "F8_E4M3"]
        if fp8:
            raise QuantizationConfigError(
                f"tensor {fp8[0]!r} is float8_e4m3 but config.json has no quantization_config to give its scales "
                "(an FP8 checkpoint without its config?); refusing to upcast it without scales")
        return None
    return parse_quantization_config(raw, tensor_dtypes)


def parse_quantization_config(raw: dict, tensor_dtypes: Optional[dict] = None) -> QuantizationConfig:
    """The config of one raw quantization_config dict (ValueError naming what is not supported)."""
    method = str(raw.get("quant_method", "")).lower().replace("_", "-") if raw.get("quant_method") else ""
    if not method:
        raise QuantizationConfigError("quantization_config has no quant_method; supported: "
                                      + ", ".join(SUPPORTED_METHODS))
    if method == "gptq":
        from tallow.layers.quantization.gptq import GPTQConfig

        return GPTQConfig.from_config(raw, tensor_dtypes)
    if method == "awq":
        from tallow.layers.quantization.awq import AWQConfig

        return AWQConfig.from_config(raw, tensor_dtypes)
    if method in ("fp8", "fbgemm-fp8", "compressed-tensors"):
        from tallow.layers.quantization.fp8 import FP8Config

        return FP8Config.from_config(raw, tensor_dtypes)
    raise QuantizationConfigError(f"quantization_config.quant_method {raw.get('quant_method')!r} is not supported; "
                                  f"supported: {', '.join(SUPPORTED_METHODS)} (FP8 only for compressed-tensors)")


def field(raw: dict, names, default=None):
    """The first of `names` present in `raw` (configs spell fields differently: bits / w_bit)."""
    for n in (names if isinstance(names, (list, tuple)) else [names]):
        if n in raw and raw[n] is not None:
            return raw[n]
    return default


def reject(method: str, name: str, value, allowed) -> None:
    raise QuantizationConfigError(f"{method} quantization_config: {name}={value!r} is not supported "
                                  f"(supported: {', '.join(map(repr, allowed))})")


# -- which layers are quantized ------------------------------------------------------------------
def skipped_by(name: str, patterns) -> bool:
    """Whether module `name` (e.g. "model.layers.0.mlp.gate_proj") is named by an exclusion list entry:
    "re:REGEX" (compressed-tensors) matches the name, a plain entry matches whole dotted components
    ("lm_head", "mlp.gate", "model.layers.0.self_attn.q_proj")."""
    for p in patterns or ():
        p = str(p)
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif p.startswith("-:"):  # GPTQModel's `dynamic` skip rule
            if re.match(p[2:], name):
                return True
        elif ("." + p + ".") in ("." + name + "."):
            return True
    return False


class CheckpointQuantConfig(QuantizationConfig):
    """Shared by GPTQConfig, AWQConfig and FP8Config: picks per layer between the format's method and the
    unquantized one (see the module docstring)."""

    method_cls = None  # the format's DequantizingLinearMethod subclass
    skip_patterns: tuple = ()
    quantize_lm_head = False

    def __init__(self, tensor_dtypes: Optional[dict] = None):
        self.tensor_dtypes = dict(tensor_dtypes) if tensor_dtypes is not None else None
        self._told = False

    def is_quantized_in_checkpoint(self, module: str) -> bool:
        """Whether the checkpoint holds module `module` in this format (names known)."""
        raise NotImplementedError

    def is_quantized(self, module: str) -> bool:
        if self.tensor_dtypes is not None:
            return self.is_quantized_in_checkpoint(module)
        if module == "lm_head" or module.endswith(".lm_head"):
            return self.quantize_lm_head
        return not skipped_by(module, self.skip_patterns)

    def get_linear_method(self, layer) -> QuantizeMethodBase:
        fused, parts = layer.checkpoint_weight_names()
        modules = [p[: -len(".weight")] for p in parts]
        if fused is not None and self.tensor_dtypes is not None and any(
                k.startswith(fused[: -len("weight")]) for k in self.tensor_dtypes):
            modules = [fused[: -len(".weight")]]  # all parts in one checkpoint tensor (Phi-3 qkv_proj)
        flags = [self.is_quantized(m) for m in modules]
        if any(flags) and not all(flags):
            raise QuantizationConfigError(
                f"{layer.prefix}: parts {', '.join(m for m, f in zip(modules, flags) if f)} are {self.name}-quantized "
                f"but {', '.join(m for m, f in zip(modules, flags) if not f)} are not; a fused layer needs them alike")
        if not all(flags):
            return UnquantizedLinearMethod()
        if not self._told:
            self._told = True
            log.info("%s: weights dequantized to the compute dtype while loading (no %s kernel in this build: "
                     "correct, slower)", self.describe(), self.name.upper())
        return self.method_cls(self)

    def get_embedding_method(self, layer) -> QuantizeMethodBase:
        name = layer.prefix + ".weight"
        if self.tensor_dtypes is not None and self.tensor_dtypes.get(name) == "F8_E4M3":
            raise QuantizationConfigError(f"{name}: a float8_e4m3 token embedding is not supported")
        return UnquantizedEmbeddingMethod()

    def describe(self) -> str:
        return self.name


# -- the layer method ----------------------------------------------------------------------------
class DequantizingLinearMethod(UnquantizedLinearMethod):
    """A layer of a quantized checkpoint on the CPU path: the layer holds an ordinary weight in the compute
    dtype (so every product, graph and fused op of the unquantized path applies), filled after loading
    from the packed tensors, which are kept (zero-copy views of the mapped files) only until then.

    checkpoint_params: the tensor names each part loads (after the module name); optional_params: those
    a checkpoint may leave out. Subclasses implement `dequantize(layer, module, tensors) -> float32
    [N, K] numpy array` for one checkpoint module (a part, or all parts under the fused name).

    GPU hook: a Marlin (GPTQ/AWQ) or CUTLASS (FP8) path keeps the packed tensors instead, repacked in
    process_weights_after_loading for its kernel, and overrides apply; until those kernels exist every
    device computes with the dequantized weight."""

    checkpoint_params: tuple = ()
    optional_params: tuple = ()

    def __init__(self, config: CheckpointQuantConfig):
        self.config = config

    def create_weights(self, layer, dtype, device: str) -> None:
        super().create_weights(layer, dtype, device)
        layer.packed = {}  # {part index or None (fused tensor): {param: checkpoint tensor}}

    def collect(self, layer, param: str, loaded: tallow.Tensor, part: Optional[int]) -> None:
        """Keep one checkpoint tensor of part `part` (None: all parts in one tensor) until all are in."""
        layer.packed.setdefault(part, {})[param] = loaded

    def module_name(self, layer, part: Optional[int]) -> str:
        return layer.fused_name if part is None and layer.fused_name is not None else layer.part_names[part or 0]

    def process_weights_after_loading(self, layer) -> None:
        packed, layer.packed = layer.packed, {}
        for part, tensors in sorted(packed.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
            module = self.module_name(layer, part)
            rows = sum(layer.output_sizes) if part is None else layer.output_sizes[part]
            w = self.dequantize(layer, module, tensors, rows, layer.input_size)
            if w.shape != (rows, layer.input_size):  # a subclass bug, not a checkpoint's
                raise AssertionError(f"{module}: dequantized to {w.shape}, expected {(rows, layer.input_size)}")
            pieces = [(part, w)] if part is not None else \
                list(enumerate(np.split(w, np.cumsum(layer.output_sizes)[:-1], axis=0)))
            for p, piece in pieces:
                t = tallow.from_numpy(np.ascontiguousarray(piece, dtype=np.float32))
                src, row = layer.shard("weight", t, p)  # this rank's rows (columns, row-parallel)
                copy_into(layer.weight.narrow(0, row, src.shape[0]), src)

    def dequantize(self, layer, module: str, tensors: dict, rows: int, cols: int) -> np.ndarray:
        raise NotImplementedError


def host_array(t: tallow.Tensor, name: str, kinds: tuple, what: str) -> np.ndarray:
    """A checkpoint tensor as a numpy array, its dtype checked against `kinds` (tallow dtype names):
    integers as they are, floats as float32 (bf16 / f16 scales widened exactly)."""
    dt = t.dtype.name
    if dt not in kinds:
        raise ValueError(f"{name}: dtype {dt}, {what} must be {' or '.join(kinds)}")
    if t.device != "cpu":
        t = t.to("cpu")
    if dt in ("bfloat16", "float16"):
        t = t.to(tallow.float32)
    if dt == "float8_e4m3":
        return np.asarray(t.contiguous().numpy(raw=True)).view(np.uint8).reshape(list(t.shape))
    return np.asarray(t.numpy())


def check_shape(name: str, arr: np.ndarray, expected: tuple, why: str) -> None:
    if tuple(arr.shape) != tuple(expected):
        raise ValueError(f"{name}: shape {list(arr.shape)}, expected {list(expected)} ({why})")
