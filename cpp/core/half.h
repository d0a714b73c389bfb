// 16- and 8-bit float storage types and their exact conversions to and from f32
// (round to nearest even, NaN and Inf preserved; f8e4m3 is the "fn" variant: no Inf, saturating).
#pragma once
#include <cstdint>
#include <cmath>
#include <cstring>

namespace tallow {

inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline float f16_to_f32(uint16_t h) {
  // Integer rebias for normals; subnormals as an exact int->float times 2^-24 (never an f32
  // denormal operand, which costs a microcode assist on x86).
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  if (em >= 0x7c00u) return bits_f32(sign | 0x7f800000u | ((uint32_t)(em & 0x3ffu) << 13));
  if (em >= 0x0400u) return bits_f32(sign | ((em << 13) + ((uint32_t)(127 - 15) << 23)));
  const float r = (float)em * 5.9604644775390625e-08f;
  return sign ? -r : r;
}

inline uint16_t f32_to_f16(float f) {
  uint32_t x = f32_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (x > 0x7f800000u ? 0x200u | ((x >> 13) & 0x3ffu) : 0));
  if (x >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // rounds to >= 65520 -> Inf
  if (x < 0x38800000u) {  // result is subnormal or zero: let the FPU round
    const float v = bits_f32(x) + 0.5f;  // 0.5 = 2^-1: subnormal f16 ulp is 2^-24; shift so mantissa bits line up
    return (uint16_t)(sign | (uint16_t)(f32_bits(v) - 0x3f000000u));
  }
  const uint32_t mant_odd = (x >> 13) & 1u;
  x += 0xc8000fffu + mant_odd;  // rebias exponent (-112 << 23) and round to nearest even
  return (uint16_t)(sign | (x >> 13));
}

inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

inline uint16_t f32_to_bf16(float f) {
  uint32_t x = f32_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);  // quiet NaN
  x += 0x7fffu + ((x >> 16) & 1u);
  return (uint16_t)(x >> 16);
}

// FP8 E4M3 (fn): bias 7, max 448, 0x7f/0xff are NaN, no infinities.
inline float f8e4m3_to_f32(uint8_t v) {
  const uint32_t sign = (uint32_t)(v & 0x80u) << 24;
  const uint32_t e = (v >> 3) & 0xfu, m = v & 0x7u;
  if (e == 0xfu && m == 0x7u) return bits_f32(sign | 0x7fc00000u);
  if (e == 0) {  // subnormal: m * 2^-9
    const float r = (float)m * (1.0f / 512.0f);
    return sign ? -r : r;
  }
  return bits_f32(sign | ((e + 120u) << 23) | (m << 20));
}

inline uint8_t f32_to_f8e4m3(float f) {
  uint32_t x = f32_bits(f);
  const uint8_t sign = (uint8_t)((x >> 24) & 0x80u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return (uint8_t)(sign | 0x7fu);  // NaN
  if (x >= 0x43e80000u) return (uint8_t)(sign | 0x7eu);  // >= 464 (halfway to 480) saturates to 448
  if (x < 0x3c800000u) {  // below 2^-6: subnormal range, step 2^-9; round half to even by the FPU
    const float v = bits_f32(x) * 512.0f;
    const float r = std::nearbyint(v);
    return (uint8_t)(sign | (uint8_t)r);
  }
  const uint32_t mant_odd = (x >> 20) & 1u;
  x += 0x7ffffu + mant_odd;
  x -= 120u << 23;
  return (uint8_t)(sign | (uint8_t)(x >> 20));
}

// Storage types: distinct C++ types so kernels can be templated on them.
struct f16_t { uint16_t bits; };
struct bf16_t { uint16_t bits; };
struct f8e4m3_t { uint8_t bits; };

inline float to_f32(float v) { return v; }
inline float to_f32(f16_t v) { return f16_to_f32(v.bits); }
inline float to_f32(bf16_t v) { return bf16_to_f32(v.bits); }
inline float to_f32(f8e4m3_t v) { return f8e4m3_to_f32(v.bits); }

template <class T> inline T from_f32(float v);
template <> inline float from_f32<float>(float v) { return v; }
template <> inline f16_t from_f32<f16_t>(float v) { return f16_t{f32_to_f16(v)}; }
template <> inline bf16_t from_f32<bf16_t>(float v) { return bf16_t{f32_to_bf16(v)}; }
template <> inline f8e4m3_t from_f32<f8e4m3_t>(float v) { return f8e4m3_t{f32_to_f8e4m3(v)}; }

}  // namespace tallow
