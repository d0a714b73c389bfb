// Dense products with f32 accumulation.
#pragma once
#include <optional>

#include "core/tensor.h"

namespace tallow::ops {

// a [..., M, K] @ b [..., K, N] -> [..., M, N]; batch dims broadcast; any strides.
Tensor matmul(const Tensor& a, const Tensor& b, const std::optional<Tensor>& out = std::nullopt);
// x [..., K] @ w[N, K]^T (+ bias [N]) -> [..., N]; the weight layout of Hugging Face and GGUF checkpoints.
Tensor linear(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias = std::nullopt,
              const std::optional<Tensor>& out = std::nullopt);

}  // namespace tallow::ops
