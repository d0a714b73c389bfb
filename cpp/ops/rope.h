// Rotary position embedding, in place, vLLM's convention.
#pragma once
#include <optional>

#include "core/tensor.h"

namespace tallow::ops {

// positions [T] (i32/i64); q [T, Hq, D] and optional k [T, Hk, D] (float, last dim contiguous);
// cos_sin_cache [max_pos, rot_dim] f32: cos in the first rot_dim/2 columns, sin in the rest.
// Rotates the first rot_dim dims of each head (partial rotary when rot_dim < D).
// neox: pairs (i, i + rot_dim/2); otherwise interleaved pairs (2i, 2i+1) (GPT-J / Meta layout).
void rotary_embedding(const Tensor& positions, Tensor& q, std::optional<Tensor> k, const Tensor& cos_sin_cache,
                      bool neox);

}  // namespace tallow::ops
