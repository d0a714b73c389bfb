"""Gated MLP: down(act(gate(x)) * up(x)), with gate and up as one fused GEMM ([gate; up] rows, a
MergedColumnParallelLinear) and the activation folded into the down projection (ops.gated_linear: one
kernel for decode shapes on CUDA)."""
from __future__ import annotations

from typing import Optional

import tallow
from tallow.layers.linear import MergedColumnParallelLinear, RowParallelLinear

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
    """Layers under `prefix` (e.g. "model.layers.3.mlp."): gate_up_proj (loading gate_proj / up_proj, or a
    fused gate_up_proj as Phi-3 / GLM-4 store it) and down_proj, with biases when `bias`.

    GatedMLP(gate_up, down, act) with two tensors wraps existing weights (tests, tools).
    reduce_results=False (tensor parallelism) returns this rank's partial sum of the down projection."""

    def __init__(self, hidden_size, intermediate_size=None, act: str = "silu", bias=False, *, prefix: str = "",
                 dtype=tallow.float32, device: str = "cpu", quant_config=None, tp_rank: int = 0, tp_size: int = 1,
                 reduce_results: bool = True):
        if isinstance(hidden_size, tallow.Tensor):  # GatedMLP(gate_up, down, act[, gate_up_bias, down_bias])
            gate_up, down = hidden_size, intermediate_size
            gate_up_bias, down_bias = (bias if isinstance(bias, tallow.Tensor) else None), None
            self.__init__(gate_up.shape[1], gate_up.shape[0] // 2, act, gate_up_bias is not None, dtype=gate_up.dtype,
                          device=gate_up.device)
            self.gate_up_proj.weight, self.down_proj.weight = gate_up, down
            self.gate_up_proj.bias, self.down_proj.bias = gate_up_bias, down_bias
            return
        if act not in _ACTS:
            raise ValueError(f"unsupported activation {act!r}; supported: {', '.join(supported_activations())}")
        self.kind, self.approximate = _ACTS[act]
        self.gated_activation = _GATED[(self.kind, self.approximate)]
        common = dict(dtype=dtype, device=device, quant_config=quant_config, tp_rank=tp_rank, tp_size=tp_size)
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bool(bias),
                                                       prefix=prefix + "gate_up_proj",
                                                       part_names=[prefix + "gate_proj", prefix + "up_proj"], **common)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bool(bias), prefix=prefix + "down_proj",
                                           reduce_results=reduce_results, **common)

    def __call__(self, x: tallow.Tensor, out: Optional[tallow.Tensor] = None) -> tallow.Tensor:
        return self.down_proj.apply_gated(self.gate_up_proj(x), self.gated_activation, out=out)
