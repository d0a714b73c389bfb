// Gated activations: x [..., 2d] -> [..., d] = act(x[..., :d]) * x[..., d:].
#pragma once
#include <optional>
#include <string>

#include "core/tensor.h"

namespace tallow::ops {

Tensor silu_and_mul(const Tensor& x, const std::optional<Tensor>& out = std::nullopt);
// approximate: "tanh" (gelu_pytorch_tanh, Gemma) or "none" (exact erf).
Tensor gelu_and_mul(const Tensor& x, const std::string& approximate = "tanh",
                    const std::optional<Tensor>& out = std::nullopt);

}  // namespace tallow::ops
