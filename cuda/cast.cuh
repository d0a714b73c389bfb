// Scalar conversions for casts, bit-exact with cpp/core/half.h (RNE; f8e4m3 "fn": saturating, no Inf).
#pragma once
#include "common.cuh"

namespace tallow::cuda {

__device__ __forceinline__ float f8e4m3_to_float(uint8_t v) {
  const uint32_t sign = (uint32_t)(v & 0x80u) << 24;
  const uint32_t e = (v >> 3) & 0xfu, m = v & 0x7u;
  if (e == 0xfu && m == 0x7u) return __uint_as_float(sign | 0x7fc00000u);
  if (e == 0) {
    const float r = (float)m * (1.0f / 512.0f);
    return sign ? -r : r;
  }
  return __uint_as_float(sign | ((e + 120u) << 23) | (m << 20));
}

__device__ __forceinline__ uint8_t float_to_f8e4m3(float f) {
  uint32_t x = __float_as_uint(f);
  const uint8_t sign = (uint8_t)((x >> 24) & 0x80u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return (uint8_t)(sign | 0x7fu);
  if (x >= 0x43e80000u) return (uint8_t)(sign | 0x7eu);
  if (x < 0x3c800000u) {
    const float r = rintf(__uint_as_float(x) * 512.0f);
    return (uint8_t)(sign | (uint8_t)r);
  }
  const uint32_t mant_odd = (x >> 20) & 1u;
  x += 0x7ffffu + mant_odd;
  x -= 120u << 23;
  return (uint8_t)(sign | (uint8_t)(x >> 20));
}

}  // namespace tallow::cuda
