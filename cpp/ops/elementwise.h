// Elementwise binary ops with numpy broadcasting; float dtypes, both inputs the same dtype.
#pragma once
#include <optional>

#include "core/tensor.h"

namespace tallow::ops {

Tensor add(const Tensor& a, const Tensor& b, const std::optional<Tensor>& out = std::nullopt);
Tensor mul(const Tensor& a, const Tensor& b, const std::optional<Tensor>& out = std::nullopt);
Tensor scale(const Tensor& a, float s, const std::optional<Tensor>& out = std::nullopt);  // a * s

}  // namespace tallow::ops
