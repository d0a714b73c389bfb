// Family status: CPU implementation complete and tested (tests/python/backend_ops/cases_softmax.py).
// Softmax over the last dimension (CPU), with scale and tanh soft-capping, computed in f32.
//
// Per row: z = x * scale; with softcap > 0, z = softcap * tanh(z / softcap); p = exp(z - max z) / sum.
// Each output is rounded once to x's dtype. Rows of any length; x may have any strides (a
// non-unit last-dim stride is copied to contiguous first); `out` must be contiguous and may be x
// itself (in place) when x is contiguous.
//
// Masking semantics (the header leaves them open; these are the definitions):
//  - An input of exactly -inf is a masked entry: its probability is 0, whatever scale or softcap
//    are (soft-capping does NOT turn a masked -inf into -softcap, and scale 0 does not make it NaN).
//  - A fully masked row (every entry -inf) has no distribution: its output is all zeros (as
//    FlashAttention-style kernels do), never NaN.
//  - NaN anywhere in a row, or +inf without softcap, makes that row NaN (garbage in is not hidden).
#include "ops/softmax.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "core/simd.h"
#include "ops/common.h"
#include "ops/rows.h"
#include "ops/vec_math.h"

#define TALLOW_SM_PRAGMA(x) _Pragma(#x)
#if defined(_MSC_VER) && !defined(__clang__)
#define TALLOW_SIMD_SUM(v) __pragma(omp simd reduction(+ : v))
#define TALLOW_SIMD_MAX(v) __pragma(omp simd reduction(max : v))
#else
#define TALLOW_SIMD_SUM(v) TALLOW_SM_PRAGMA(omp simd reduction(+ : v))
#define TALLOW_SIMD_MAX(v) TALLOW_SM_PRAGMA(omp simd reduction(max : v))
#endif

namespace tallow::ops {

namespace {

using vecmath::vexp;
using vecmath::vtanh;

// One row. `z` is f32 scratch of n floats; for f32 it may be `o` itself (no restrict here:
// `omp simd` already licenses the vectorisation, and o may also alias x for in-place use).
template <class T>
TALLOW_SIMD_CLONES void softmax_row(const T* x, T* o, float* z, int64_t n, float scale, float softcap) {
  float m = -INFINITY;
  if (softcap > 0.0f) {
    const float s = scale / softcap;
    TALLOW_SIMD_MAX(m)
    for (int64_t i = 0; i < n; ++i) {
      const float xi = to_f32(x[i]);
      const float v = xi == -INFINITY ? -INFINITY : softcap * vtanh(xi * s);
      z[i] = v;
      m = v > m ? v : m;
    }
  } else {
    TALLOW_SIMD_MAX(m)
    for (int64_t i = 0; i < n; ++i) {
      const float xi = to_f32(x[i]);
      const float v = xi == -INFINITY ? -INFINITY : xi * scale;
      z[i] = v;
      m = v > m ? v : m;
    }
  }
  if (m == -INFINITY) {  // fully masked row: all zeros
    TALLOW_PRAGMA_SIMD
    for (int64_t i = 0; i < n; ++i) o[i] = from_f32<T>(0.0f);
    return;
  }
  // Blocked sum: f32 vector lanes within a block, blocks added in double, so long rows (vocab-sized)
  // keep the sum's error at a few f32 ulps, also in the unvectorised baseline clone.
  constexpr int64_t kBlock = 128;
  double sum = 0.0;
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t i1 = std::min(n, i0 + kBlock);
    float b = 0.0f;
    TALLOW_SIMD_SUM(b)
    for (int64_t i = i0; i < i1; ++i) {
      const float e = vexp(z[i] - m);
      z[i] = e;
      b += e;
    }
    sum += b;
  }
  const float inv = (float)(1.0 / sum);
  TALLOW_PRAGMA_SIMD
  for (int64_t i = 0; i < n; ++i) o[i] = from_f32<T>(z[i] * inv);
}

}  // namespace

Tensor softmax(const Tensor& x_in, float scale, float softcap, const std::optional<Tensor>& out) {
  const char* op = "softmax";
  check_defined(op, x_in, "x");
  check_float(op, x_in, "x");
  TALLOW_CHECK(x_in.dim() >= 1, op, ": x must have at least 1 dimension, got a 0-d tensor");
  TALLOW_CHECK(std::isfinite(scale), op, ": scale must be finite, got ", scale, " (x of shape ",
               shape_str(x_in.shape()), ")");
  TALLOW_CHECK(std::isfinite(softcap) && softcap >= 0.0f, op, ": softcap must be finite and >= 0 (0 = off), got ",
               softcap, " (x of shape ", shape_str(x_in.shape()), ")");
  Tensor o = make_out(op, out, x_in.shape(), x_in.dtype(), x_in.device());
  if (!x_in.device().is_cpu()) return device_op(&BackendOps::softmax, op, x_in)(x_in, scale, softcap, o);
  const Tensor x = x_in.stride(-1) != 1 && x_in.size(-1) > 1 ? x_in.contiguous() : x_in;
  const int64_t n = x.size(-1);
  TALLOW_DISPATCH_FLOAT(op, x.dtype(), [&] {
    parallel_rows(num_rows(o), (softcap > 0.0f ? 12 : 6) * n, [&](int64_t r0, int64_t r1) {
      std::vector<float> scratch(std::is_same_v<scalar_t, float> ? 0 : (size_t)n);
      for (int64_t r = r0; r < r1; ++r) {
        scalar_t* orow = row_ptr<scalar_t>(o, r);
        // f32 output rows double as the scratch (the cast is only taken when scalar_t is float).
        float* z = std::is_same_v<scalar_t, float> ? reinterpret_cast<float*>(orow) : scratch.data();
        softmax_row<scalar_t>(row_ptr<const scalar_t>(x, r), orow, z, n, scale, softcap);
      }
    });
  });
  return o;
}

}  // namespace tallow::ops
