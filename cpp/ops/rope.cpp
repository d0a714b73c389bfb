// Family status: CPU implementation complete and tested (tests/python/backend_ops/cases_rope.py).
// Rotary position embedding (CPU), in place on q and optional k, vLLM's convention.
//
// For token t at position p = positions[t], with c = cache[p, i] and s = cache[p, rot_dim/2 + i],
// each pair (a, b) of a head's first rot_dim dims becomes (a c - b s, b c + a s), computed in f32 and
// rounded once to q's dtype; dims >= rot_dim are left untouched (partial rotary).
// neox: pairs (i, i + rot_dim/2); otherwise interleaved pairs (2i, 2i+1).
//
// Shapes: positions [T] (or any [...]) i32/i64; q [..., Hq, D], k [..., Hk, D] with the leading
// dims equal to positions' shape; Hq and Hk may differ (GQA). q and k need a contiguous last dim;
// their other dims may be strided, e.g. q = qkv[:, :Hq, :] of a fused qkv buffer [T, Hq + 2 Hk, D].
// cos_sin_cache [max_pos, rot_dim] f32 with a contiguous last dim. Every position is checked
// against [0, max_pos) before anything is written (IndexError; q and k are then unchanged).
#include "ops/rope.h"

#include <vector>

#include "core/simd.h"
#include "ops/common.h"
#include "ops/rows.h"

namespace tallow::ops {

namespace {

template <class T>
TALLOW_SIMD_CLONES void rope_row(T* x, const float* TALLOW_RESTRICT cs, int64_t half, bool neox) {
  const float* TALLOW_RESTRICT sn = cs + half;
  if (neox) {
    T* TALLOW_RESTRICT x1 = x;
    T* TALLOW_RESTRICT x2 = x + half;
    TALLOW_PRAGMA_SIMD
    for (int64_t i = 0; i < half; ++i) {
      const float a = to_f32(x1[i]), b = to_f32(x2[i]), c = cs[i], s = sn[i];
      x1[i] = from_f32<T>(a * c - b * s);
      x2[i] = from_f32<T>(b * c + a * s);
    }
  } else {
    T* TALLOW_RESTRICT xi = x;
    TALLOW_PRAGMA_SIMD
    for (int64_t i = 0; i < half; ++i) {
      const float a = to_f32(xi[2 * i]), b = to_f32(xi[2 * i + 1]), c = cs[i], s = sn[i];
      xi[2 * i] = from_f32<T>(a * c - b * s);
      xi[2 * i + 1] = from_f32<T>(b * c + a * s);
    }
  }
}

// q or k: float, leading dims == positions' shape, last dim `d` (or any, when d < 0), contiguous last dim.
void check_heads(const char* op, const Tensor& t, const char* name, const Tensor& positions, int64_t d) {
  check_defined(op, t, name);
  check_float(op, t, name);
  Shape lead(t.shape().begin(), t.shape().end() - std::min<int64_t>(t.dim(), 2));
  TALLOW_CHECK(t.dim() == positions.dim() + 2 && lead == positions.shape(), op, ": ", name,
               " must be [..., heads, head_dim] with leading dims equal to positions' shape ",
               shape_str(positions.shape()), ", got ", name, " of shape ", shape_str(t.shape()));
  TALLOW_CHECK(d < 0 || t.size(-1) == d, op, ": ", name, " has head_dim ", t.size(-1), " (shape ",
               shape_str(t.shape()), "), q has head_dim ", d);
  TALLOW_CHECK(t.stride(-1) == 1 || t.size(-1) <= 1, op, ": ", name, " of shape ", shape_str(t.shape()),
               " and strides ", shape_str(t.strides()), " is rotated in place and needs a contiguous last dim");
}

}  // namespace

void rotary_embedding(const Tensor& positions, Tensor& q, std::optional<Tensor> k, const Tensor& cos_sin_cache,
                      bool neox) {
  const char* op = "rotary_embedding";
  check_defined(op, positions, "positions");
  check_defined(op, cos_sin_cache, "cos_sin_cache");
  check_dtype(op, positions, "positions", {DType::I32, DType::I64});
  TALLOW_CHECK(positions.dim() >= 1, op, ": positions must be [T], got a 0-d tensor");
  check_heads(op, q, "q", positions, -1);
  const bool has_k = k && k->defined();
  const int64_t d = q.size(-1);
  if (has_k) {
    check_heads(op, *k, "k", positions, d);
    check_same_dtype(op, q, "q", *k, "k");
    check_same_device(op, q, *k);
  }
  check_dtype(op, cos_sin_cache, "cos_sin_cache", {DType::F32});
  const char* layout = neox ? "neox" : "interleaved";
  TALLOW_CHECK(cos_sin_cache.dim() == 2, op, ": cos_sin_cache must be [max_pos, rot_dim], got shape ",
               shape_str(cos_sin_cache.shape()));
  const int64_t max_pos = cos_sin_cache.size(0), rot = cos_sin_cache.size(1);
  TALLOW_CHECK(rot > 0 && rot % 2 == 0 && rot <= d, op, ": rot_dim (cos_sin_cache of shape ",
               shape_str(cos_sin_cache.shape()), ") must be even, > 0 and <= head_dim of q of shape ",
               shape_str(q.shape()), " (", layout, ")");
  TALLOW_CHECK(cos_sin_cache.stride(1) == 1, op, ": cos_sin_cache of shape ", shape_str(cos_sin_cache.shape()),
               " and strides ", shape_str(cos_sin_cache.strides()), " needs a contiguous last dim");
  check_same_device(op, q, positions);
  check_same_device(op, q, cos_sin_cache);
  if (!q.device().is_cpu())
    return device_op(&BackendOps::rotary_embedding, op, q, {&positions, &q})(positions, q, k, cos_sin_cache, neox);

  // Positions as i64, all validated before any write.
  const int64_t T = positions.numel();
  std::vector<int64_t> pos((size_t)T);
  {
    const Tensor p = positions.contiguous();
    for (int64_t t = 0; t < T; ++t) {
      pos[(size_t)t] = p.dtype() == DType::I32 ? (int64_t)p.data<int32_t>()[t] : p.data<int64_t>()[t];
      TALLOW_CHECK_INDEX(pos[(size_t)t] >= 0 && pos[(size_t)t] < max_pos, op, ": positions[", t, "] = ",
                         pos[(size_t)t], " is out of range of cos_sin_cache of shape ",
                         shape_str(cos_sin_cache.shape()), " (valid positions are 0 .. ", max_pos - 1, ")");
    }
  }
  const int64_t hq = q.size(-2), hk = has_k ? k->size(-2) : 0;
  const int64_t q_rows = T * hq, rows = q_rows + T * hk, half = rot / 2;
  if (rows == 0) return;
  TALLOW_DISPATCH_FLOAT(op, q.dtype(), [&] {
    parallel_rows(rows, 2 * rot, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const bool is_q = r < q_rows;
        const int64_t rr = is_q ? r : r - q_rows;
        const int64_t t = rr / (is_q ? hq : hk);
        rope_row<scalar_t>(row_ptr<scalar_t>(is_q ? q : *k, rr), row_ptr<const float>(cos_sin_cache, pos[(size_t)t]),
                           half, neox);
      }
    });
  });
}

}  // namespace tallow::ops
