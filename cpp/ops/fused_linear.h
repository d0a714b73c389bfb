// A decode step's linear layers with their neighbours folded in: the RMSNorm before a projection and
// the residual add after one. On CUDA, decode shapes (few rows, f16/bf16) run each as one GEMV kernel
// (cuda/gemv.cu: norm mode, residual mode), so a pre-norm decoder layer needs no norm or add kernels;
// elsewhere, and for larger shapes, each op is its composition (and gives the composition's result).
#pragma once
#include <optional>
#include <string>

#include "core/tensor.h"

namespace tallow::ops {

// linear(rms_norm(x, norm_w, eps, gemma_offset), w, bias): x [..., K], norm_w [K], w [N, K] -> [..., N].
// The fused kernel computes 1 / rms in its own order (within an f32 rounding of rms_norm's).
Tensor rms_norm_linear(const Tensor& x, const Tensor& norm_w, float eps, bool gemma_offset, const Tensor& w,
                       const std::optional<Tensor>& bias = std::nullopt);

// residual += linear(x, w, bias), in place (residual [..., N], contiguous, x's dtype); returns
// residual. The product is rounded to the dtype before the add, as add(residual, linear(...)) rounds.
Tensor linear_add(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias, const Tensor& residual);

// residual += gated_linear(x, w, bias, activation), in place; returns residual.
Tensor gated_linear_add(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias,
                        const std::string& activation, const Tensor& residual);

}  // namespace tallow::ops
