#pragma once
#include <optional>

#include "core/tensor.h"

namespace tallow::ops {

// Softmax over the last dimension of z = x * scale, with optional tanh soft-capping:
// z = softcap * tanh(z / softcap) when softcap > 0. Computed in f32; output in x's dtype.
Tensor softmax(const Tensor& x, float scale = 1.0f, float softcap = 0.0f,
               const std::optional<Tensor>& out = std::nullopt);

}  // namespace tallow::ops
