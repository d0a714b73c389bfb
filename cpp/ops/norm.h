// Normalisations over the last dimension, f32 accumulation.
#pragma once
#include <optional>
#include <utility>

#include "core/tensor.h"

namespace tallow::ops {

// y = x / rms(x) * w, or * (1 + w) with gemma_offset (Gemma's norms).
Tensor rms_norm(const Tensor& x, const Tensor& w, float eps, bool gemma_offset = false,
                const std::optional<Tensor>& out = std::nullopt);
// residual += x; x_out = rms_norm(residual). Updates `residual` in place and returns the normed tensor.
Tensor fused_add_rms_norm(const Tensor& x, const Tensor& residual, const Tensor& w, float eps,
                          bool gemma_offset = false);
// y = (x - mean) / sqrt(var + eps) * w + b; w and b optional.
Tensor layer_norm(const Tensor& x, const std::optional<Tensor>& w, const std::optional<Tensor>& b, float eps,
                  const std::optional<Tensor>& out = std::nullopt);

}  // namespace tallow::ops
