// The gated MLP's down projection in one op: linear(act(x[..., :K]) * x[..., K:], w, bias).
#pragma once
#include <optional>
#include <string>

#include "core/tensor.h"

namespace tallow::ops {

// x [..., 2K] (the gate_up output: gate, then up), w [N, K], bias [N] -> [..., N]. activation: "silu"
// (silu_and_mul), "gelu_tanh" (gelu_and_mul, approximate "tanh") or "gelu" (approximate "none"). The
// activated product is rounded to x's dtype before the product, as the composition
// linear(silu_and_mul(x), w, bias) rounds it; on the CPU it is that composition. On CUDA, decode shapes
// (rows <= skinny_max_m, f16/bf16) run as one GEMV kernel that applies the activation to x as it
// loads it; the result is bitwise the composition's through the same GEMV.
Tensor gated_linear(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias = std::nullopt,
                    const std::string& activation = "silu", const std::optional<Tensor>& out = std::nullopt);

}  // namespace tallow::ops
