"""GPTQ checkpoints (AutoGPTQ, GPTQModel, optimum): 4- or 8-bit integers with a scale and a zero per
group of input channels, dequantized to the compute dtype after loading (quant_config.py).

The on-disk format, per linear layer of N outputs and K inputs (W is [N, K]; GPTQ stores it as [K, N]):
    qweight  int32 [K * bits / 32, N]   32 / bits values of consecutive input channels per int32, the
                                        first in the lowest bits (packed along K)
    qzeros   int32 [G, N * bits / 32]   the zero of each group and output, packed the same way along N
    scales   f16   [G, N]               the scale of each group and output
    g_idx    int32 [K]                  the group of each input channel: k // group_size, or (desc_act,
                                        "act order") a permutation's groups
G = ceil(K / group_size), or 1 for group_size -1 (one group over all of K). Then
    W[n, k] = scales[g, n] * (q[k, n] - zero[g, n]),  g = g_idx[k]
where zero is the stored value + 1 in the original ("gptq", v1) format: AutoGPTQ stored zero - 1, an
off-by-one its kernels undo; GPTQModel's "gptq_v2" stores the zero itself. Symmetric checkpoints store
2^(bits-1) - 1 (v1) so the zero is the midpoint; asymmetric ones their own zeros: both read qzeros.

With desc_act false the groups are k // group_size whatever g_idx says (what the GPTQ kernels do; g_idx
may be absent); with desc_act true g_idx is required.
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

BITS = (4, 8)
FORMATS = ("gptq", "gptq_v2")


class GPTQConfig(CheckpointQuantConfig):
    name = "gptq"

    def __init__(self, bits: int = 4, group_size: int = 128, desc_act: bool = False, sym: bool = True,
                 checkpoint_format: str = "gptq", lm_head: bool = False, skip_patterns=(),
                 tensor_dtypes: Optional[dict] = None):
        super().__init__(tensor_dtypes)
        if bits not in BITS:
            reject("gptq", "bits", bits, BITS)
        if not isinstance(group_size, int) or isinstance(group_size, bool) or not (group_size > 0 or group_size == -1):
            reject("gptq", "group_size", group_size, ("a positive integer", -1))
        if checkpoint_format not in FORMATS:
            reject("gptq", "checkpoint_format", checkpoint_format, FORMATS)
        self.bits, self.group_size, self.desc_act, self.sym = bits, group_size, bool(desc_act), bool(sym)
        self.checkpoint_format = checkpoint_format
        self.quantize_lm_head = bool(lm_head)
        self.skip_patterns = tuple(skip_patterns)

    @classmethod
    def from_config(cls, raw: dict, tensor_dtypes: Optional[dict] = None) -> "GPTQConfig":
        if raw.get("is_marlin_format"):
            reject("gptq", "is_marlin_format", True, (False,))
        fmt = str(field(raw, ("checkpoint_format", "format"), "gptq")).lower()
        pack = str(field(raw, "pack_dtype", "int32")).replace("torch.", "")
        if pack != "int32":
            reject("gptq", "pack_dtype", pack, ("int32",))
        skips = []
        for key, override in (field(raw, "dynamic", {}) or {}).items():
            if not str(key).startswith("-:"):  # "+:" / plain keys change bits or groups per module
                raise QuantizationConfigError(f"gptq quantization_config: dynamic[{key!r}] (per-module overrides "
                                              f"{override!r}) is not supported; only '-:' skip rules are")
            skips.append(key)
        for flag in ("desc_act", "sym", "lm_head"):
            if not isinstance(field(raw, flag, False), bool):
                reject("gptq", flag, raw[flag], (True, False))
        return cls(bits=field(raw, ("bits", "w_bit"), 4), group_size=field(raw, ("group_size", "q_group_size"), 128),
                   desc_act=field(raw, "desc_act", False), sym=field(raw, "sym", True), checkpoint_format=fmt,
                   lm_head=field(raw, "lm_head", False),
                   skip_patterns=skips + list(field(raw, "modules_to_not_convert", []) or []),
                   tensor_dtypes=tensor_dtypes)

    def is_quantized_in_checkpoint(self, module: str) -> bool:
        return module + ".qweight" in self.tensor_dtypes

    def describe(self) -> str:
        return (f"GPTQ {self.bits}-bit (group {self.group_size}, desc_act {self.desc_act}, "
                f"{self.checkpoint_format})")

    @property
    def method_cls(self):
        return GPTQLinearMethod


def unpack_rows(packed: np.ndarray, bits: int) -> np.ndarray:
    """int32 [R, C] holding 32 / bits values per element along the rows -> uint8 [R * 32 / bits, C]."""
    per = 32 // bits
    u = packed.view(np.uint32)
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, :, None]
    vals = (u[:, None, :] >> shifts) & np.uint32((1 << bits) - 1)  # [R, per, C]
    return vals.reshape(-1, packed.shape[1]).astype(np.uint8)


def unpack_cols(packed: np.ndarray, bits: int) -> np.ndarray:
    """int32 [R, C] holding 32 / bits values per element along the columns -> uint8 [R, C * 32 / bits]."""
    per = 32 // bits
    u = packed.view(np.uint32)
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, None, :]
    vals = (u[:, :, None] >> shifts) & np.uint32((1 << bits) - 1)  # [R, C, per]
    return vals.reshape(packed.shape[0], -1).astype(np.uint8)


class GPTQLinearMethod(DequantizingLinearMethod):
    checkpoint_params = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, config: GPTQConfig):
        super().__init__(config)
        self.optional_params = () if config.desc_act else ("g_idx",)

    def dequantize(self, layer, module: str, tensors: dict, rows: int, cols: int) -> np.ndarray:
        c: GPTQConfig = self.config
        n, k, bits = rows, cols, c.bits
        per = 32 // bits
        if k % per or n % per:
            raise ValueError(f"{module}: {k} inputs x {n} outputs do not pack into int32 at {bits} bits "
                             f"(both must be multiples of {per})")
        group = k if c.group_size == -1 else c.group_size
        groups = -(-k // group)
        qweight = host_array(tensors["qweight"], module + ".qweight", ("int32",), "GPTQ qweight")
        check_shape(module + ".qweight", qweight, (k // per, n), f"{k} inputs packed {per} per int32 x {n} outputs")
        qzeros = host_array(tensors["qzeros"], module + ".qzeros", ("int32",), "GPTQ qzeros")
        check_shape(module + ".qzeros", qzeros, (groups, n // per),
                    f"{groups} groups of {group} inputs x {n} outputs packed {per} per int32")
        scales = host_array(tensors["scales"], module + ".scales", ("float16", "bfloat16", "float32"), "GPTQ scales")
        check_shape(module + ".scales", scales, (groups, n), f"{groups} groups x {n} outputs")
        if c.desc_act:
            g_idx = host_array(tensors["g_idx"], module + ".g_idx", ("int32", "int64"), "GPTQ g_idx")
            check_shape(module + ".g_idx", g_idx, (k,), "one group index per input")
            if g_idx.size and (g_idx.min() < 0 or g_idx.max() >= groups):
                raise ValueError(f"{module}.g_idx: group indices span {g_idx.min()}..{g_idx.max()}, outside "
                                 f"0..{groups - 1}")
        else:
            g_idx = np.arange(k) // group
        q = unpack_rows(qweight, bits).astype(np.float32)  # [K, N]
        zeros = unpack_cols(qzeros, bits).astype(np.float32)  # [G, N]
        if c.checkpoint_format == "gptq":
            zeros += 1.0  # v1 stores zero - 1
        w = (q - zeros[g_idx]) * scales[g_idx]  # [K, N]; exact in float32 (small ints times a f16 scale)
        return np.ascontiguousarray(w.T)
