"""AWQ checkpoints (AutoAWQ / llm-awq, "GEMM" version): 4-bit integers with a scale and a zero per group
of input channels, dequantized to the compute dtype after loading (quant_config.py).

The on-disk format, per linear layer of N outputs and K inputs (W is [N, K]; AWQ stores it as [K, N]):
    qweight  int32 [K, N / 8]   8 values of one input channel per int32, packed along N in the
                                interleaved order 0, 2, 4, 6, 1, 3, 5, 7: the i-th nibble (bits 4i..4i+3)
                                holds output column 8c + ORDER[i]
    qzeros   int32 [G, N / 8]   the zero of each group and output, packed the same way (the zero itself)
    scales   f16   [G, N]
G = K / group_size. Then W[n, k] = scales[k // group, n] * (q[k, n] - zero[k // group, n]).

Only version "gemm" with zero points is this layout; GEMV, Marlin and ExLlama AWQ layouts are refused.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from tallow.layers.quantization.quant_config import (
    CheckpointQuantConfig,
    DequantizingLinearMethod,
    check_shape,
    field,
    host_array,
    reject,
)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds column ORDER[i] of its 8
AWQ_REVERSE_ORDER = tuple(AWQ_ORDER.index(j) for j in range(8))  # column j sits in nibble REVERSE[j]


class AWQConfig(CheckpointQuantConfig):
    name = "awq"

    def __init__(self, bits: int = 4, group_size: int = 128, zero_point: bool = True, version: str = "gemm",
                 skip_patterns=(), tensor_dtypes: Optional[dict] = None):
        super().__init__(tensor_dtypes)
        if bits != 4:
            reject("awq", "bits", bits, (4,))
        if not isinstance(group_size, int) or isinstance(group_size, bool) or not (group_size > 0 or group_size == -1):
            reject("awq", "group_size", group_size, ("a positive integer", -1))
        if zero_point is not True:
            reject("awq", "zero_point", zero_point, (True,))
        if version != "gemm":
            reject("awq", "version", version, ("gemm",))
        self.bits, self.group_size = bits, group_size
        self.skip_patterns = tuple(skip_patterns)

    @classmethod
    def from_config(cls, raw: dict, tensor_dtypes: Optional[dict] = None) -> "AWQConfig":
        return cls(bits=field(raw, ("bits", "w_bit"), 4), group_size=field(raw, ("group_size", "q_group_size"), 128),
                   zero_point=field(raw, "zero_point", True), version=str(field(raw, "version", "gemm")).lower(),
                   skip_patterns=list(field(raw, "modules_to_not_convert", []) or []), tensor_dtypes=tensor_dtypes)

    def is_quantized_in_checkpoint(self, module: str) -> bool:
        return module + ".qweight" in self.tensor_dtypes

    def describe(self) -> str:
        return f"AWQ {self.bits}-bit (group {self.group_size})"

    @property
    def method_cls(self):
        return AWQLinearMethod


def unpack_awq(packed: np.ndarray) -> np.ndarray:
    """int32 [R, C] in AWQ's order -> uint8 [R, 8 C] with the columns in their natural order."""
    u = packed.view(np.uint32)
    shifts = (np.arange(8, dtype=np.uint32) * 4)[None, None, :]
    nibbles = (u[:, :, None] >> shifts) & np.uint32(0xF)  # [R, C, 8] in storage order
    return nibbles[:, :, AWQ_REVERSE_ORDER].reshape(packed.shape[0], -1).astype(np.uint8)


class AWQLinearMethod(DequantizingLinearMethod):
    checkpoint_params = ("qweight", "qzeros", "scales")

    def dequantize(self, layer, module: str, tensors: dict, rows: int, cols: int) -> np.ndarray:
        n, k = rows, cols
        group = k if self.config.group_size == -1 else self.config.group_size
        if n % 8 or k % group:
            raise ValueError(f"{module}: {n} outputs x {k} inputs do not fit AWQ's layout (outputs a multiple of 8, "
                             f"inputs of the group size {group})")
        groups = k // group
        qweight = host_array(tensors["qweight"], module + ".qweight", ("int32",), "AWQ qweight")
        check_shape(module + ".qweight", qweight, (k, n // 8), f"{k} inputs x {n} outputs packed 8 per int32")
        qzeros = host_array(tensors["qzeros"], module + ".qzeros", ("int32",), "AWQ qzeros")
        check_shape(module + ".qzeros", qzeros, (groups, n // 8), f"{groups} groups x {n} outputs packed 8 per int32")
        scales = host_array(tensors["scales"], module + ".scales", ("float16", "bfloat16", "float32"), "AWQ scales")
        check_shape(module + ".scales", scales, (groups, n), f"{groups} groups x {n} outputs")
        g = np.arange(k) // group
        q = unpack_awq(qweight).astype(np.float32)  # [K, N]
        zeros = unpack_awq(qzeros).astype(np.float32)  # [G, N]
        w = (q - zeros[g]) * scales[g]
        return np.ascontiguousarray(w.T)
