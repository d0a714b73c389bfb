#pragma once
#include <optional>

#include "core/tensor.h"

namespace tallow::ops {

// ids (i32/i64, any shape) index rows of table [V, D] (float or block dtype) -> [..., D] in
// out_dtype (default: the table's dtype; block tables default to f32). Out-of-range ids raise.
Tensor embedding(const Tensor& ids, const Tensor& table, std::optional<DType> out_dtype = std::nullopt);

}  // namespace tallow::ops
