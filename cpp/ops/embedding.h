#pragma once
#include <optional>

#include "core/tensor.h"

namespace tallow::ops {

// ids (i32/i64, any shape) index rows of table [V, D] (float or block dtype) -> [..., D] in
// out_dtype (default: the table's dtype; block tables default to f32). Out-of-range ids raise.
// vocab_start (a vocabulary-parallel rank's slice of the table): id selects row id - vocab_start,
// and ids outside [vocab_start, vocab_start + V) give zero rows instead of raising (the all-reduce
// of the ranks' outputs then adds the one non-zero row per token), all on the device.
Tensor embedding(const Tensor& ids, const Tensor& table, std::optional<DType> out_dtype = std::nullopt,
                 std::optional<int64_t> vocab_start = std::nullopt);

}  // namespace tallow::ops
