// Reference attention over contiguous K/V (the baseline paged and GPU kernels are checked against).
#pragma once
#include <optional>

#include "core/tensor.h"

namespace tallow::ops {

// q [Tq, Hq, D], k [Tk, Hk, D], v [Tk, Hk, Dv] (or with a leading batch dim B on all three);
// Hq % Hk == 0 (GQA/MQA). Query i sits at position Tk - Tq + i, so a prefix of Tk - Tq cached
// tokens is attended by every query. causal masks keys after the query; sliding_window > 0 keeps
// only the last `sliding_window` keys up to and including the query; softcap > 0 applies
// softcap * tanh(s / softcap) to the scaled scores. Output [.., Tq, Hq, Dv] in q's dtype.
Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, float scale, bool causal = true,
                 int64_t sliding_window = 0, float softcap = 0.0f);

}  // namespace tallow::ops
