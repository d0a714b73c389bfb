// Family status: CPU reference complete (tests/python/test_rope_cache.py, backend_ops/cases_rope_cache.py).
// rope_and_cache: per-head q/k RMSNorm + rotary embedding + KV-cache write (contract in rope_cache.h).
//
// The CPU path IS the reference: it runs rms_norm, rotary_embedding and reshape_and_cache in order,
// after checking every argument (and every position and slot) under this op's name, so a bad input
// raises before q, k or the caches change. On CUDA the fused kernel runs; layouts it does not take
// run the same composition on the device.
#include "ops/rope_cache.h"

#include <cmath>

#include "ops/common.h"
#include "ops/norm.h"
#include "ops/paged_attention.h"
#include "ops/rope.h"

namespace tallow::ops {

namespace {

// [T, H, D] float with a contiguous last dim (rotated in place).
void check_heads(const char* op, const Tensor& t, const char* name, int64_t T) {
  check_defined(op, t, name);
  check_float(op, t, name);
  TALLOW_CHECK(t.dim() == 3 && t.size(0) == T, op, ": ", name, " must be [T, heads, head_dim] with T = ", T,
               " (positions' length), got shape ", shape_str(t.shape()));
  TALLOW_CHECK(t.stride(2) == 1 || t.size(2) <= 1, op, ": ", name, " of shape ", shape_str(t.shape()), " and strides ",
               shape_str(t.strides()), " is updated in place and needs a contiguous last dim");
}


int64_t index_at(const Tensor& t, int64_t i) {
  return t.dtype() == DType::I32 ? (int64_t)t.data<int32_t>()[i * t.stride(0)] : t.data<int64_t>()[i * t.stride(0)];
}

}  // namespace

void rope_and_cache(const Tensor& positions, const Tensor& q_in, const Tensor& k_in, const Tensor& v,
                    const Tensor& cos_sin_cache, bool neox, const Tensor& k_cache, const Tensor& v_cache,
                    const Tensor& slot_mapping, const std::optional<Tensor>& q_norm_weight,
                    const std::optional<Tensor>& k_norm_weight, float norm_eps, bool gemma_norm, float k_scale,
                    float v_scale) {
  const char* op = "rope_and_cache";
  check_defined(op, positions, "positions");
  check_dtype(op, positions, "positions", {DType::I32, DType::I64});
  check_dim(op, positions, "positions", 1);
  const int64_t T = positions.size(0);
  check_heads(op, q_in, "q", T);
  check_heads(op, k_in, "k", T);
  check_same_dtype(op, q_in, "q", k_in, "k");
  const int64_t Hk = k_in.size(1), D = q_in.size(2);
  TALLOW_CHECK(k_in.size(2) == D, op, ": q", shape_str(q_in.shape()), " and k", shape_str(k_in.shape()),
               " must have the same head_dim");
  check_defined(op, v, "v");
  check_float(op, v, "v");
  TALLOW_CHECK(v.dim() == 3 && v.size(0) == T && v.size(1) == Hk, op, ": v must be [T, num_kv_heads, head_dim_v] = [",
               T, ", ", Hk, ", *] to match k", shape_str(k_in.shape()), ", got v", shape_str(v.shape()));
  const int64_t Dv = v.size(2);

  check_defined(op, cos_sin_cache, "cos_sin_cache");
  check_dtype(op, cos_sin_cache, "cos_sin_cache", {DType::F32});
  TALLOW_CHECK(cos_sin_cache.dim() == 2, op, ": cos_sin_cache must be [max_pos, rot_dim], got shape ",
               shape_str(cos_sin_cache.shape()));
  const int64_t max_pos = cos_sin_cache.size(0), rot = cos_sin_cache.size(1);
  TALLOW_CHECK(rot > 0 && rot % 2 == 0 && rot <= D, op, ": rot_dim (cos_sin_cache of shape ",
               shape_str(cos_sin_cache.shape()), ") must be even, > 0 and <= head_dim of q of shape ",
               shape_str(q_in.shape()));
  TALLOW_CHECK(cos_sin_cache.stride(1) == 1, op, ": cos_sin_cache of shape ", shape_str(cos_sin_cache.shape()),
               " and strides ", shape_str(cos_sin_cache.strides()), " needs a contiguous last dim");

  const bool has_qw = q_norm_weight && q_norm_weight->defined(), has_kw = k_norm_weight && k_norm_weight->defined();
  TALLOW_CHECK(has_qw == has_kw, op, ": q_norm_weight and k_norm_weight must be given together (got ",
               has_qw ? "q_norm_weight only" : "k_norm_weight only", ")");
  if (has_qw) {
    for (const auto* p : {&*q_norm_weight, &*k_norm_weight}) {
      const char* name = p == &*q_norm_weight ? "q_norm_weight" : "k_norm_weight";
      check_float(op, *p, name);
      check_same_dtype(op, q_in, "q", *p, name);
      TALLOW_CHECK(p->dim() == 1 && p->size(0) == D, op, ": ", name, " must have shape [", D, "] (head_dim of q",
                   shape_str(q_in.shape()), "), got ", shape_str(p->shape()));
      check_same_device(op, q_in, *p);
    }
    TALLOW_CHECK(std::isfinite(norm_eps) && norm_eps >= 0.0f, op, ": norm_eps must be finite and >= 0, got ", norm_eps);
  }

  check_kv_cache(op, k_cache, "k_cache");
  check_kv_cache(op, v_cache, "v_cache");
  TALLOW_CHECK(k_cache.size(2) == Hk && k_cache.size(3) == D, op, ": k", shape_str(k_in.shape()),
               " does not match k_cache", shape_str(k_cache.shape()), " (num_kv_heads and head_dim must agree)");
  TALLOW_CHECK(v_cache.size(0) == k_cache.size(0) && v_cache.size(1) == k_cache.size(1) && v_cache.size(2) == Hk &&
                   v_cache.size(3) == Dv,
               op, ": v", shape_str(v.shape()), " and v_cache", shape_str(v_cache.shape()), " do not match k_cache",
               shape_str(k_cache.shape()));
  check_defined(op, slot_mapping, "slot_mapping");
  check_dtype(op, slot_mapping, "slot_mapping", {DType::I32, DType::I64});
  TALLOW_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == T, op, ": slot_mapping",
               shape_str(slot_mapping.shape()), " must be [T] with one slot per token of q", shape_str(q_in.shape()));
  TALLOW_CHECK(std::isfinite(k_scale) && k_scale > 0.0f, op, ": k_scale must be finite and > 0, got ", k_scale);
  TALLOW_CHECK(std::isfinite(v_scale) && v_scale > 0.0f, op, ": v_scale must be finite and > 0, got ", v_scale);
  for (const Tensor* t : {&positions, &k_in, &v, &cos_sin_cache, &k_cache, &v_cache, &slot_mapping})
    check_same_device(op, q_in, *t);

  Tensor q = q_in, k = k_in;  // handles: the ops below update the caller's storage in place
  const std::optional<Tensor> qw = has_qw ? q_norm_weight : std::nullopt, kw = has_kw ? k_norm_weight : std::nullopt;
  // The backend's fused kernel (after its own device-side position/slot checks) where it has one; it
  // returns false for layouts it does not take: then the composition runs.
  if (const auto fused = find_device_op(&BackendOps::rope_and_cache, q.device());
      fused && fused(positions, q, k, v, cos_sin_cache, neox, k_cache, v_cache, slot_mapping, qw, kw, norm_eps,
                     gemma_norm, k_scale, v_scale))
    return;
  if (q.device().is_cpu()) {
    // Everything the ops below would reject, rejected before the first of them writes.
    const int64_t nslots = k_cache.size(0) * k_cache.size(1);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t p = index_at(positions, t), s = index_at(slot_mapping, t);
      TALLOW_CHECK_INDEX(p >= 0 && p < max_pos, op, ": positions[", t, "] = ", p,
                         " is out of range of cos_sin_cache of shape ", shape_str(cos_sin_cache.shape()),
                         " (valid positions are 0 .. ", max_pos - 1, ")");
      TALLOW_CHECK(s < nslots, op, ": slot_mapping[", t, "] = ", s, " is out of range for k_cache",
                   shape_str(k_cache.shape()), " (", nslots, " slots; negative slots are skipped)");
    }
  } else if (!find_backend(q.device().type)) {
    unsupported_device(op, q, {&q, &k, &v});  // else the backend's ops below run (or name what it lacks)
  }
  if (T == 0) return;
  if (has_qw) {
    q.copy_(rms_norm(q, *qw, norm_eps, gemma_norm));
    k.copy_(rms_norm(k, *kw, norm_eps, gemma_norm));
  }
  rotary_embedding(positions, q, k, cos_sin_cache, neox);
  reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale);
}

}  // namespace tallow::ops
