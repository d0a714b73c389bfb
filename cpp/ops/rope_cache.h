// One attention layer's per-token prologue in one op: optional per-head q/k RMSNorm, rotary
// embedding in place, and the K/V paged-cache write.
#pragma once
#include <optional>

#include "core/tensor.h"

namespace tallow::ops {

// Exactly the composition of the separate ops (norm.h, rope.h, paged_attention.h):
//   if q_norm_weight:  q = rms_norm(q, q_norm_weight, norm_eps, gemma_norm)   (per head, over D,
//                      k = rms_norm(k, k_norm_weight, norm_eps, gemma_norm)    written back in place)
//   rotary_embedding(positions, q, k, cos_sin_cache, neox)                     (in place)
//   reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
// positions i32/i64 [T]; q [T, Hq, D], k [T, Hk, D] (float, one dtype, contiguous last dim; rows may
// be strided: views into a fused qkv output); v [T, Hk, Dv] float; cos_sin_cache f32 [max_pos,
// rot_dim] (rot_dim even, <= D: partial rotary); caches and slots as reshape_and_cache (f32/f16/bf16
// or float8_e4m3, negative slot = skip). Norm weights: both or neither, [D] of q's dtype; gemma_norm
// multiplies by (1 + w). Every position and slot is checked before anything is written.
//
// Rounding is the composition's: the normed value is rounded to q's dtype before the rotation,
// the rotated value is rounded to q's dtype (and stored in q / k), and the cache gets that value
// converted to its dtype (fp8: e4m3(x / scale)). The CPU runs the separate ops in order. CUDA runs
// one kernel (cuda/rope_cache.cu) that performs the composition's f32 operations in its order, so
// for rows of <= 32 16-byte packs (f16/bf16 D <= 256, f32 D <= 128) the results equal the CUDA
// composition bit for bit, as compiled by nvcc 13 for sm_90 (rotary_embedding's FMA contraction is
// pinned, see the .cu). Bound otherwise (longer rows: rms_norm sums in another order; another
// compiler: rope.cu contracted otherwise): each element within one rounding of the composition's,
// <= 1 ulp of its dtype where the rotation does not cancel. Layouts the kernel does not take
// (rows not 16-byte aligned, D % (16 / sizeof(q)) != 0, Dv != D, q/k/v or k/v caches of different
// dtypes, D > 128 * 16 / sizeof(q)) run the composition on the device instead.
void rope_and_cache(const Tensor& positions, const Tensor& q, const Tensor& k, const Tensor& v,
                    const Tensor& cos_sin_cache, bool neox, const Tensor& k_cache, const Tensor& v_cache,
                    const Tensor& slot_mapping, const std::optional<Tensor>& q_norm_weight = std::nullopt,
                    const std::optional<Tensor>& k_norm_weight = std::nullopt, float norm_eps = 1e-6f,
                    bool gemma_norm = false, float k_scale = 1.0f, float v_scale = 1.0f);

}  // namespace tallow::ops
