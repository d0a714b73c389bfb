// Branch-free f32 exp and tanh that vectorise under `omp simd` without -ffast-math, shared by
// the activation and softmax kernels.
#pragma once
#include <cmath>
#include <cstdint>

#include "core/half.h"

#if defined(__GNUC__) || defined(__clang__)
#define TALLOW_VEC_INLINE inline __attribute__((always_inline))
#else
#define TALLOW_VEC_INLINE __forceinline
#endif

namespace tallow::ops::vecmath {

// exp(x) = 2^n * e^r with n = round(x / ln 2), |r| <= ln2 / 2 (Cephes expf polynomial, ~1 ulp).
// Returns 0 below -86 (true value < 5e-38) and +inf above ln(FLT_MAX); NaN stays NaN.
TALLOW_VEC_INLINE float vexp(float x) {
  constexpr float kLo = -86.0f, kHi = 88.7228f;
  float xc = x < kLo ? kLo : x;
  xc = xc > kHi ? kHi : xc;
  const float t = xc * 1.44269504088896341f + 12582912.0f;  // + 1.5 * 2^23 rounds to an integer
  const float n = t - 12582912.0f;
  const int32_t ni = (int32_t)f32_bits(t) - 0x4B400000;
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const float res = y * bits_f32((uint32_t)(ni + 126) << 23) * 2.0f;  // 2^n in two steps: n may be 128
  return x > kHi ? INFINITY : (x < kLo ? 0.0f : res);
}

// tanh: odd polynomial below |x| = 0.625 (Cephes tanhf), 1 - 2 / (e^{2|x|} + 1) above (~2 ulp).
TALLOW_VEC_INLINE float vtanh(float x) {
  const float ax = std::fabs(x), z = x * x;
  float p = -5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const float small = p * z * x + x;
  const float big = 1.0f - 2.0f / (vexp(2.0f * ax) + 1.0f);
  return ax < 0.625f ? small : std::copysign(big, x);
}

}  // namespace tallow::ops::vecmath
