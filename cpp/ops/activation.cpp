// Family status: CPU implementation complete and tested (tests/python/backend_ops/cases_activation.py).
// Gated activations (CPU): out[..., i] = act(x[..., i]) * x[..., d + i] for x [..., 2d].
//
// Computed in f32 with one rounding of each output to x's dtype. exp, tanh and erf are branch-free
// f32 approximations (a few ulp; see below) so the loops vectorise under `omp simd` without
// -ffast-math. x may have any strides (a non-unit last-dim stride is copied to contiguous first);
// `out`, when given, must be contiguous [..., d] of x's dtype.
#include "ops/activation.h"

#include <cmath>
#include <cstdint>

#include "core/simd.h"
#include "ops/common.h"
#include "ops/rows.h"
#include "ops/vec_math.h"

#if defined(__GNUC__) || defined(__clang__)
#define TALLOW_ACT_INLINE inline __attribute__((always_inline))
#else
#define TALLOW_ACT_INLINE __forceinline
#endif

namespace tallow::ops {

namespace {

using vecmath::vexp;
using vecmath::vtanh;

// erf: rational approximation on [-4, 4] (Eigen's generic_fast_erf_float), |error| < 5e-7.
TALLOW_ACT_INLINE float verf(float x) {
  const float xc = x < -4.0f ? -4.0f : (x > 4.0f ? 4.0f : x);
  const float z = xc * xc;
  float p = -2.72614225801306e-10f;
  p = p * z + 2.77068142495902e-08f;
  p = p * z - 2.10102402082508e-06f;
  p = p * z - 5.69250639462346e-05f;
  p = p * z - 7.34990630326855e-04f;
  p = p * z - 2.95459980854025e-03f;
  p = p * z - 1.60960333262415e-02f;
  float q = -1.45660718464996e-05f;
  q = q * z - 2.13374055278905e-04f;
  q = q * z - 1.68282697438203e-03f;
  q = q * z - 7.37332916720468e-03f;
  q = q * z - 1.42647390514189e-02f;
  return xc * p / q;
}

enum class Act { Silu, GeluTanh, GeluErf };

template <Act kAct>
TALLOW_ACT_INLINE float act(float a) {
  if constexpr (kAct == Act::Silu) {
    return a / (1.0f + vexp(-a));
  } else if constexpr (kAct == Act::GeluTanh) {
    return 0.5f * a * (1.0f + vtanh(0.7978845608028654f * (a + 0.044715f * a * a * a)));
  } else {
    return 0.5f * a * (1.0f + verf(a * 0.7071067811865476f));
  }
}

template <class T, Act kAct>
TALLOW_SIMD_CLONES void gated_row(const T* TALLOW_RESTRICT x, T* TALLOW_RESTRICT o, int64_t d) {
  const T* TALLOW_RESTRICT y = x + d;
  TALLOW_PRAGMA_SIMD
  for (int64_t i = 0; i < d; ++i) o[i] = from_f32<T>(act<kAct>(to_f32(x[i])) * to_f32(y[i]));
}

template <Act kAct>
Tensor gated(const char* op, const Tensor& x_in, const std::optional<Tensor>& out) {
  check_defined(op, x_in, "x");
  check_float(op, x_in, "x");
  TALLOW_CHECK(x_in.dim() >= 1 && x_in.size(-1) % 2 == 0, op, ": x must be [..., 2d] with an even last dimension, got ",
               shape_str(x_in.shape()));
  Shape shape = x_in.shape();
  const int64_t d = shape.back() / 2;
  shape.back() = d;
  Tensor o = make_out(op, out, shape, x_in.dtype(), x_in.device());
  if (!x_in.device().is_cpu()) {
    if constexpr (kAct == Act::Silu) return device_op(&BackendOps::silu_and_mul, op, x_in)(x_in, o);
    else return device_op(&BackendOps::gelu_and_mul, op, x_in)(x_in, kAct == Act::GeluTanh ? "tanh" : "none", o);
  }
  const Tensor x = x_in.stride(-1) != 1 ? x_in.contiguous() : x_in;
  TALLOW_DISPATCH_FLOAT(op, x.dtype(), [&] {
    parallel_rows(num_rows(o), 8 * d, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) gated_row<scalar_t, kAct>(row_ptr<const scalar_t>(x, r), row_ptr<scalar_t>(o, r), d);
    });
  });
  return o;
}

}  // namespace

Tensor silu_and_mul(const Tensor& x, const std::optional<Tensor>& out) {
  return gated<Act::Silu>("silu_and_mul", x, out);
}

Tensor gelu_and_mul(const Tensor& x, const std::string& approximate, const std::optional<Tensor>& out) {
  if (approximate == "tanh") return gated<Act::GeluTanh>("gelu_and_mul", x, out);
  if (approximate == "none") return gated<Act::GeluErf>("gelu_and_mul", x, out);
  throw ValueError(str_cat("gelu_and_mul: approximate must be \"tanh\" or \"none\", got \"", approximate,
                           "\" (x of shape ", x.defined() ? shape_str(x.shape()) : "undefined", ")"));
}

}  // namespace tallow::ops
