// Selection over the last dimension.
#pragma once
#include <utility>

#include "core/tensor.h"

namespace tallow::ops {

// Index of the largest element (first one on ties), i64 [...]. NaN counts as largest.
Tensor argmax(const Tensor& x);
// The k largest values (descending, ties by lower index) and their i64 indices, each [..., k].
std::pair<Tensor, Tensor> topk(const Tensor& x, int64_t k);

}  // namespace tallow::ops
