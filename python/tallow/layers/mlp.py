"""Gated MLP: down(act(gate(x)) * up(x)), with gate and up as one fused GEMM ([gate; up] rows) and the
activation folded into the down projection (ops.gated_linear: one kernel for decode shapes on CUDA)."""
from __future__ import annotations

from typing import Optional

import tallow
from tallow import ops
from tallow.layers.names import require
from tallow.layers.weights import as_dtype, concat_rows

# Hugging Face hidden_act -> (kernel, approximate)
_ACTS = {
    "silu": ("silu", None), "swish": ("silu", None),
    "gelu_pytorch_tanh": ("gelu", "tanh"), "gelu_tanh": ("gelu", "tanh"), "gelu_new": ("gelu", "tanh"),
    "gelu_fast": ("gelu", "tanh"), "gelu": ("gelu", "none"),
}


# (kernel, approximate) -> ops.gated_linear's activation
_GATED = {("silu", None): "silu", ("gelu", "tanh"): "gelu_tanh", ("gelu", "none"): "gelu"}


def supported_activations() -> list[str]:
    return sorted(_ACTS)


class GatedMLP:
    def __init__(self, gate_up: tallow.Tensor, down: tallow.Tensor, act: str = "silu",
                 gate_up_bias: Optional[tallow.Tensor] = None, down_bias: Optional[tallow.Tensor] = None):
        if act not in _ACTS:
            raise ValueError(f"unsupported activation {act!r}; supported: {', '.join(supported_activations())}")
        self.kind, self.approximate = _ACTS[act]
        self.gated_activation = _GATED[(self.kind, self.approximate)]
        self.gate_up, self.down = gate_up, down
        self.gate_up_bias, self.down_bias = gate_up_bias, down_bias

    @classmethod
    def from_weights(cls, w: dict, prefix: str, dtype, act: str) -> "GatedMLP":
        """From `prefix`gate_up_proj (fused, Phi-3 / GLM-4) or `prefix`{gate,up}_proj, and `prefix`down_proj;
        biases where the checkpoint has them."""
        def get(name):
            t = w.get(prefix + name)
            return None if t is None else as_dtype(t, dtype)

        def need(name):
            return as_dtype(require(w, prefix + name), dtype)

        if prefix + "gate_up_proj.weight" in w:
            gate_up, gate_up_bias = get("gate_up_proj.weight"), get("gate_up_proj.bias")
        else:
            gate_up = concat_rows([need("gate_proj.weight"), need("up_proj.weight")])
            gb, ub = get("gate_proj.bias"), get("up_proj.bias")
            gate_up_bias = concat_rows([gb, ub]) if gb is not None and ub is not None else None
        return cls(gate_up, need("down_proj.weight"), act, gate_up_bias, get("down_proj.bias"))

    def __call__(self, x: tallow.Tensor, norm=None, residual: Optional[tallow.Tensor] = None) -> tallow.Tensor:
        """mlp(x). With `norm` (an RMSNorm), x is normalised first (folded into gate_up); with
        `residual`, the output is added to it in place (folded into down) and residual is returned."""
        y = norm.linear(x, self.gate_up, self.gate_up_bias) if norm is not None else \
            ops.linear(x, self.gate_up, self.gate_up_bias)
        if residual is not None:
            return ops.gated_linear_add(y, self.down, self.down_bias, self.gated_activation, residual)
        return ops.gated_linear(y, self.down, self.down_bias, activation=self.gated_activation)
