// Family status: CPU implementation complete and tested (tests/python/test_dequant.py).
// GGUF block dequantization, bit-exact with ggml's dequantize_row_* (and the gguf package's numpy
// dequantizers). Block layouts follow ggml-common.h (all little-endian, byte offsets below):
//   Q4_0 (18 B / 32):  f16 d | u8 qs[16]                     y = d * ((q & 15) - 8)
//   Q4_1 (20 B / 32):  f16 d | f16 m | u8 qs[16]             y = d * q + m
//   Q5_0 (22 B / 32):  f16 d | u32 qh | u8 qs[16]            y = d * (q5 - 16)
//   Q5_1 (24 B / 32):  f16 d | f16 m | u32 qh | u8 qs[16]    y = d * q5 + m
//   Q8_0 (34 B / 32):  f16 d | i8 qs[32]                     y = d * q
//   Q8_1 (36 B / 32):  f16 d | f16 s | i8 qs[32]             y = d * q
//   Q2_K (84 B / 256): u8 scales[16] | u8 qs[64] | f16 d | f16 dmin
//   Q3_K (110 B / 256): u8 hmask[32] | u8 qs[64] | u8 scales[12] | f16 d
//   Q4_K (144 B / 256): f16 d | f16 dmin | u8 scales[12] | u8 qs[128]
//   Q5_K (176 B / 256): f16 d | f16 dmin | u8 scales[12] | u8 qh[32] | u8 qs[128]
//   Q6_K (210 B / 256): u8 ql[128] | u8 qh[64] | i8 scales[16] | f16 d
//   Q8_K (292 B / 256): f32 d | i8 qs[256] | i16 bsums[16]   y = d * q
//   IQ4_NL (18 B / 32): f16 d | u8 qs[16]                    y = d * kvalues_iq4nl[q]
//   IQ4_XS (136 B / 256): f16 d | u16 scales_h | u8 scales_l[4] | u8 qs[128]
//                       sub-block s (32 elements): ls = (4 bits of scales_l | 2 of scales_h << 4) - 32,
//                       y = (d * ls) * kvalues_iq4nl[q]  (nibble order as Q4_0: low 16 then high 16)
//
// Bit-exactness: every formula above is (f16 scale) x (sub-scale of <= 8 bits) x (quant of <= 6 bits),
// optionally minus (f16 min) x (<= 6-bit sub-min). Where a subtraction or addition follows (Q4_1, Q5_1,
// Q2_K, Q4_K, Q5_K), the products have at most 11 + 6 + 5 = 22 significant bits and no underflow, so
// they are exact in f32 and a compiler-fused multiply-add rounds exactly like ggml's separate ops.

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "core/simd.h"
#include "ops/cast.h"
#include "ops/common.h"
#include "ops/dequant_row.h"
#include "ops/rows.h"
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include "ops/gemm_kernel.h"  // gemm::isa_name(): the row routines follow the GEMM's kernel-set choice
#define TALLOW_DEQ_AVX2 1
#else
#define TALLOW_DEQ_AVX2 0
#endif

namespace tallow::ops {

namespace {

// f16 -> f32, exact like core/half.h's f16_to_f32, but without arithmetic on f32 denormals: f16
// subnormals are m * 2^-24 (an exact product of normal floats), so tiny scales cost no microcode assist.
inline float load_f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  uint32_t bits;
  if (e == 0) bits = f32_bits((float)m * 0x1p-24f);                  // zero or subnormal
  else if (e == 31) bits = 0x7f800000u | (m << 13);                    // Inf / NaN (payload kept)
  else bits = ((e + 112u) << 23) | (m << 13);                          // normal: rebias 15 -> 127
  return bits_f32(sign | bits);
}

inline float load_f32(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t u;
  std::memcpy(&u, p, 4);
  return u;
}

// ---- 32-element blocks -------------------------------------------------------------------------

TALLOW_SIMD_CLONES void deq_q4_0(const uint8_t* TALLOW_RESTRICT x, float* TALLOW_RESTRICT y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 18, y += 32) {
    const float d = load_f16(x);
    const uint8_t* qs = x + 2;
    TALLOW_PRAGMA_SIMD
    for (int j = 0; j < 16; ++j) {
      y[j] = (float)((int)(qs[j] & 0x0F) - 8) * d;
      y[j + 16] = (float)((int)(qs[j] >> 4) - 8) * d;
    }
  }
}

TALLOW_SIMD_CLONES void deq_q4_1(const uint8_t* TALLOW_RESTRICT x, float* TALLOW_RESTRICT y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 20, y += 32) {
    const float d = load_f16(x), m = load_f16(x + 2);
    const uint8_t* qs = x + 4;
    TALLOW_PRAGMA_SIMD
    for (int j = 0; j < 16; ++j) {
      y[j] = (float)(qs[j] & 0x0F) * d + m;
      y[j + 16] = (float)(qs[j] >> 4) * d + m;
    }
  }
}

TALLOW_SIMD_CLONES void deq_q5_0(const uint8_t* TALLOW_RESTRICT x, float* TALLOW_RESTRICT y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 22, y += 32) {
    const float d = load_f16(x);
    const uint32_t qh = load_u32(x + 2);
    const uint8_t* qs = x + 6;
    TALLOW_PRAGMA_SIMD
    for (int j = 0; j < 16; ++j) {
      const int h0 = (int)((qh >> j) << 4) & 0x10;
      const int h1 = (int)(qh >> (j + 12)) & 0x10;
      y[j] = (float)(((int)(qs[j] & 0x0F) | h0) - 16) * d;
      y[j + 16] = (float)(((int)(qs[j] >> 4) | h1) - 16) * d;
    }
  }
}

TALLOW_SIMD_CLONES void deq_q5_1(const uint8_t* TALLOW_RESTRICT x, float* TALLOW_RESTRICT y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 24, y += 32) {
    const float d = load_f16(x), m = load_f16(x + 2);
    const uint32_t qh = load_u32(x + 4);
    const uint8_t* qs = x + 8;
    TALLOW_PRAGMA_SIMD
    for (int j = 0; j < 16; ++j) {
      const int h0 = (int)((qh >> j) << 4) & 0x10;
      const int h1 = (int)(qh >> (j + 12)) & 0x10;
      y[j] = (float)((int)(qs[j] & 0x0F) | h0) * d + m;
      y[j + 16] = (float)((int)(qs[j] >> 4) | h1) * d + m;
    }
  }
}

// Q8_0 (type_size 34) and Q8_1 (36: d, then the s = d * sum(q) field that dequantization ignores).
template <int kTypeSize, int kQsOffset>
TALLOW_SIMD_CLONES void deq_q8_x(const uint8_t* TALLOW_RESTRICT x, float* TALLOW_RESTRICT y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += kTypeSize, y += 32) {
    const float d = load_f16(x);
    const int8_t* qs = reinterpret_cast<const int8_t*>(x + kQsOffset);
    TALLOW_PRAGMA_SIMD
    for (int j = 0; j < 32; ++j) y[j] = (float)qs[j] * d;
  }
}

// ---- 256-element super-blocks (k-quants) ------------------------------------------------------

TALLOW_SIMD_CLONES void deq_q2_k(const uint8_t* TALLOW_RESTRICT x, float* TALLOW_RESTRICT y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 84, y += 256) {
    const uint8_t* sc = x;
    const uint8_t* qs = x + 16;
    const float d = load_f16(x + 80), dmin = load_f16(x + 82);
    for (int h = 0; h < 2; ++h) {          // two halves of 128 share 32 bytes of qs
      const uint8_t* q = qs + 32 * h;
      for (int s = 0; s < 4; ++s) {        // 2-bit field `s` of each byte
        for (int k = 0; k < 2; ++k) {      // 16 elements per scale
          const uint8_t scb = sc[8 * h + 2 * s + k];
          const float dl = d * (float)(scb & 0x0F), ml = dmin * (float)(scb >> 4);
          float* out = y + 128 * h + 32 * s + 16 * k;
          const uint8_t* qq = q + 16 * k;
          TALLOW_PRAGMA_SIMD
          for (int l = 0; l < 16; ++l) out[l] = dl * (float)((qq[l] >> (2 * s)) & 3) - ml;
        }
      }
    }
  }
}

TALLOW_SIMD_CLONES void deq_q3_k(const uint8_t* TALLOW_RESTRICT x, float* TALLOW_RESTRICT y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 110, y += 256) {
    const uint8_t* hm = x;
    const uint8_t* qs = x + 32;
    const uint8_t* sb = x + 96;
    const float d_all = load_f16(x + 108);
    // 16 six-bit scales: low nibbles from bytes 0..7, high 2 bits from bytes 8..11.
    int sc[16];
    for (int i = 0; i < 16; ++i) {
      const int lo = (i < 8 ? sb[i] : sb[i - 8] >> 4) & 0x0F;
      const int hi = (sb[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
      sc[i] = (lo | (hi << 4)) - 32;
    }
    for (int h = 0; h < 2; ++h) {
      const uint8_t* q = qs + 32 * h;
      for (int s = 0; s < 4; ++s) {
        const int bit = 4 * h + s;  // hmask bit of this group of 32
        for (int k = 0; k < 2; ++k) {
          const float dl = d_all * (float)sc[8 * h + 2 * s + k];
          float* out = y + 128 * h + 32 * s + 16 * k;
          const uint8_t* qq = q + 16 * k;
          const uint8_t* hh = hm + 16 * k;
          TALLOW_PRAGMA_SIMD
          for (int l = 0; l < 16; ++l) {
            const int v = (int)((qq[l] >> (2 * s)) & 3) - (((hh[l] >> bit) & 1) ? 0 : 4);
            out[l] = dl * (float)v;
          }
        }
      }
    }
  }
}

// The 8 six-bit (scale, min) pairs of Q4_K/Q5_K (ggml's get_scale_min_k4).
inline void scale_min_k4(const uint8_t* q, int j, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

TALLOW_SIMD_CLONES void deq_q4_k(const uint8_t* TALLOW_RESTRICT x, float* TALLOW_RESTRICT y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 144, y += 256) {
    const float d = load_f16(x), dmin = load_f16(x + 2);
    const uint8_t* scales = x + 4;
    const uint8_t* qs = x + 16;
    for (int g = 0; g < 4; ++g) {  // 64 elements: low nibbles then high nibbles of 32 bytes
      int sc1, m1, sc2, m2;
      scale_min_k4(scales, 2 * g, sc1, m1);
      scale_min_k4(scales, 2 * g + 1, sc2, m2);
      const float d1 = d * (float)sc1, dm1 = dmin * (float)m1;
      const float d2 = d * (float)sc2, dm2 = dmin * (float)m2;
      const uint8_t* q = qs + 32 * g;
      float* out = y + 64 * g;
      TALLOW_PRAGMA_SIMD
      for (int l = 0; l < 32; ++l) {
        out[l] = d1 * (float)(q[l] & 0x0F) - dm1;
        out[l + 32] = d2 * (float)(q[l] >> 4) - dm2;
      }
    }
  }
}

TALLOW_SIMD_CLONES void deq_q5_k(const uint8_t* TALLOW_RESTRICT x, float* TALLOW_RESTRICT y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 176, y += 256) {
    const float d = load_f16(x), dmin = load_f16(x + 2);
    const uint8_t* scales = x + 4;
    const uint8_t* qh = x + 16;
    const uint8_t* qs = x + 48;
    for (int g = 0; g < 4; ++g) {
      int sc1, m1, sc2, m2;
      scale_min_k4(scales, 2 * g, sc1, m1);
      scale_min_k4(scales, 2 * g + 1, sc2, m2);
      const float d1 = d * (float)sc1, dm1 = dmin * (float)m1;
      const float d2 = d * (float)sc2, dm2 = dmin * (float)m2;
      const uint8_t* q = qs + 32 * g;
      float* out = y + 64 * g;
      TALLOW_PRAGMA_SIMD
      for (int l = 0; l < 32; ++l) {
        const int v1 = (int)(q[l] & 0x0F) | (((qh[l] >> (2 * g)) & 1) << 4);
        const int v2 = (int)(q[l] >> 4) | (((qh[l] >> (2 * g + 1)) & 1) << 4);
        out[l] = d1 * (float)v1 - dm1;
        out[l + 32] = d2 * (float)v2 - dm2;
      }
    }
  }
}

TALLOW_SIMD_CLONES void deq_q6_k(const uint8_t* TALLOW_RESTRICT x, float* TALLOW_RESTRICT y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 210, y += 256) {
    const float d = load_f16(x + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(x + 192);
    for (int h = 0; h < 2; ++h) {  // 128 elements from 64 bytes of ql and 32 of qh
      const uint8_t* ql = x + 64 * h;
      const uint8_t* qh = x + 128 + 32 * h;
      float* out = y + 128 * h;
      for (int k = 0; k < 2; ++k) {  // l in [16k, 16k + 16) uses scales 8h + k + {0, 2, 4, 6}
        const float s1 = d * (float)sc[8 * h + k], s2 = d * (float)sc[8 * h + k + 2];
        const float s3 = d * (float)sc[8 * h + k + 4], s4 = d * (float)sc[8 * h + k + 6];
        TALLOW_PRAGMA_SIMD
        for (int l = 16 * k; l < 16 * k + 16; ++l) {
          const int q1 = ((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32;
          const int q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
          const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
          const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
          out[l] = s1 * (float)q1;
          out[l + 32] = s2 * (float)q2;
          out[l + 64] = s3 * (float)q3;
          out[l + 96] = s4 * (float)q4;
        }
      }
    }
  }
}

TALLOW_SIMD_CLONES void deq_q8_k(const uint8_t* TALLOW_RESTRICT x, float* TALLOW_RESTRICT y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 292, y += 256) {
    const float d = load_f32(x);
    const int8_t* qs = reinterpret_cast<const int8_t*>(x + 4);
    TALLOW_PRAGMA_SIMD
    for (int j = 0; j < 256; ++j) y[j] = (float)qs[j] * d;
  }
}

// ---- non-linear 4-bit types (IQ4_NL, IQ4_XS): a nibble indexes ggml's kvalues_iq4nl ---------------
// d (11 bits) x ls (6 bits) x kvalue (8 bits) keeps each product exact up to the one final rounding,
// the same as ggml's d * ls then * kvalue.
alignas(16) constexpr int8_t kIq4nlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                 1,    13,   25,  38,  53,  69,  89,  113};

// 16 bytes of nibbles -> 32 values of one 32-element sub-block scaled by dl.
inline void deq_iq4_sub(const uint8_t* TALLOW_RESTRICT qs, float dl, float* TALLOW_RESTRICT y) {
  TALLOW_PRAGMA_SIMD
  for (int j = 0; j < 16; ++j) {
    y[j] = dl * (float)kIq4nlValues[qs[j] & 0x0F];
    y[j + 16] = dl * (float)kIq4nlValues[qs[j] >> 4];
  }
}

inline int iq4_xs_scale(const uint8_t* x, int ib) {  // sub-block ib's 6-bit scale minus 32
  const int h = (int)(x[2] | (x[3] << 8));
  return (((x[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F) | (((h >> (2 * ib)) & 3) << 4)) - 32;
}

void deq_iq4_nl(const uint8_t* TALLOW_RESTRICT x, float* TALLOW_RESTRICT y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 18, y += 32) deq_iq4_sub(x + 2, load_f16(x), y);
}

void deq_iq4_xs(const uint8_t* TALLOW_RESTRICT x, float* TALLOW_RESTRICT y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 136, y += 256) {
    const float d = load_f16(x);
    for (int ib = 0; ib < 8; ++ib) deq_iq4_sub(x + 8 + 16 * ib, d * (float)iq4_xs_scale(x, ib), y + 32 * ib);
  }
}

using RowFn = void (*)(const uint8_t*, float*, int64_t);

// ---- AVX2 and AVX-512 row routines ------------------------------------------------------------------
// The same formulas as the reference routines above, 8 (AVX2) or 16 (AVX-512) lanes at a time: bytes
// widened to i32 lanes (vpmovzxbd / vpmovsxbd), nibbles split with and/shift (Q5 high bits: shifts, or
// mask registers on AVX-512), converted exactly to f32, then the same multiplies in the same order. Where
// the reference adds or subtracts after a product (Q4_1, Q5_1, Q4_K, Q5_K), that product is exact (see
// the top of this file), so the fused multiply-add used here rounds identically. Q2_K / Q3_K keep the
// compiler-vectorized reference routines.
// The f16 scales are converted with F16C, exact for every f16 (subnormals included).
// Chosen like the GEMM's kernel set (gemm::isa_name(): avx512, avx2, or portable = the reference routines).
#if TALLOW_DEQ_AVX2
#define TALLOW_AVX2_FN __attribute__((target("avx2,fma,f16c")))

TALLOW_AVX2_FN static inline float f16_avx2(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
TALLOW_AVX2_FN static inline __m256i u8x8(const uint8_t* p) {  // 8 bytes -> 8 x i32 (zero-extended)
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
TALLOW_AVX2_FN static inline __m256i i8x8(const uint8_t* p) {  // 8 bytes -> 8 x i32 (sign-extended)
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

TALLOW_AVX2_FN void deq_q4_0_avx2(const uint8_t* TALLOW_RESTRICT x, float* TALLOW_RESTRICT y, int64_t nb) {
  const __m256i m4 = _mm256_set1_epi32(0x0F), k8 = _mm256_set1_epi32(8);
  for (int64_t b = 0; b < nb; ++b, x += 18, y += 32) {
    const __m256 d = _mm256_set1_ps(f16_avx2(x));
    const __m256i a = u8x8(x + 2), c = u8x8(x + 10);  // qs[0..7], qs[8..15]
    _mm256_storeu_ps(y, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(a, m4), k8)), d));
    _mm256_storeu_ps(y + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(c, m4), k8)), d));
    _mm256_storeu_ps(y + 16, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(a, 4), k8)), d));
    _mm256_storeu_ps(y + 24, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(c, 4), k8)), d));
  }
}

TALLOW_AVX2_FN void deq_q4_1_avx2(const uint8_t* TALLOW_RESTRICT x, float* TALLOW_RESTRICT y, int64_t nb) {
  const __m256i m4 = _mm256_set1_epi32(0x0F);
  for (int64_t b = 0; b < nb; ++b, x += 20, y += 32) {
    const __m256 d = _mm256_set1_ps(f16_avx2(x)), m = _mm256_set1_ps(f16_avx2(x + 2));
    const __m256i a = u8x8(x + 4), c = u8x8(x + 12);
    _mm256_storeu_ps(y, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(a, m4)), d, m));
    _mm256_storeu_ps(y + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(c, m4)), d, m));
    _mm256_storeu_ps(y + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), d, m));
    _mm256_storeu_ps(y + 24, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4)), d, m));
  }
}

// Q5_0 / Q5_1: bit j of qh is the 5th bit of element j (j < 16 low nibbles, j >= 16 high nibbles).
template <bool kMin>
TALLOW_AVX2_FN void deq_q5_x_avx2(const uint8_t* TALLOW_RESTRICT x, float* TALLOW_RESTRICT y, int64_t nb) {
  constexpr int kTs = kMin ? 24 : 22, kQh = kMin ? 4 : 2;
  const __m256i m4 = _mm256_set1_epi32(0x0F), k16 = _mm256_set1_epi32(16);
  const __m256i sh = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i one = _mm256_set1_epi32(1);
  for (int64_t b = 0; b < nb; ++b, x += kTs, y += 32) {
    const __m256 d = _mm256_set1_ps(f16_avx2(x));
    const __m256 m = kMin ? _mm256_set1_ps(f16_avx2(x + 2)) : _mm256_setzero_ps();
    uint32_t qh;
    std::memcpy(&qh, x + kQh, 4);
    const uint8_t* qs = x + kQh + 4;
    const __m256i a = u8x8(qs), c = u8x8(qs + 8);
    const __m256i q[4] = {_mm256_and_si256(a, m4), _mm256_and_si256(c, m4), _mm256_srli_epi32(a, 4),
                          _mm256_srli_epi32(c, 4)};
    for (int v = 0; v < 4; ++v) {
      const __m256i h = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)(qh >> (8 * v))), sh), one);
      const __m256i qi = _mm256_or_si256(q[v], _mm256_slli_epi32(h, 4));
      const __m256 f = _mm256_cvtepi32_ps(kMin ? qi : _mm256_sub_epi32(qi, k16));
      _mm256_storeu_ps(y + 8 * v, kMin ? _mm256_fmadd_ps(f, d, m) : _mm256_mul_ps(f, d));
    }
  }
}

template <int kTypeSize, int kQsOffset>
TALLOW_AVX2_FN void deq_q8_x_avx2(const uint8_t* TALLOW_RESTRICT x, float* TALLOW_RESTRICT y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += kTypeSize, y += 32) {
    const __m256 d = _mm256_set1_ps(f16_avx2(x));
    const uint8_t* qs = x + kQsOffset;
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(y + 8 * v, _mm256_mul_ps(_mm256_cvtepi32_ps(i8x8(qs + 8 * v)), d));
  }
}

TALLOW_AVX2_FN void deq_q8_k_avx2(const uint8_t* TALLOW_RESTRICT x, float* TALLOW_RESTRICT y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 292, y += 256) {
    const __m256 d = _mm256_set1_ps(load_f32(x));
    for (int v = 0; v < 32; ++v) _mm256_storeu_ps(y + 8 * v, _mm256_mul_ps(_mm256_cvtepi32_ps(i8x8(x + 4 + 8 * v)), d));
  }
}

// Q4_K / Q5_K: per 64 elements two (scale, min) pairs; y = (d * sc) * q - dmin * m, the product exact.
template <bool kQ5>
TALLOW_AVX2_FN void deq_q45_k_avx2(const uint8_t* TALLOW_RESTRICT x, float* TALLOW_RESTRICT y, int64_t nb) {
  constexpr int kTs = kQ5 ? 176 : 144, kQs = kQ5 ? 48 : 16;
  const __m256i m4 = _mm256_set1_epi32(0x0F), one = _mm256_set1_epi32(1);
  for (int64_t b = 0; b < nb; ++b, x += kTs, y += 256) {
    const float d = f16_avx2(x), dmin = f16_avx2(x + 2);
    const uint8_t* scales = x + 4;
    const uint8_t* qh = x + 16;
    const uint8_t* qs = x + kQs;
    for (int g = 0; g < 4; ++g) {
      int sc1, m1, sc2, m2;
      scale_min_k4(scales, 2 * g, sc1, m1);
      scale_min_k4(scales, 2 * g + 1, sc2, m2);
      const __m256 d1 = _mm256_set1_ps(d * (float)sc1), dm1 = _mm256_set1_ps(dmin * (float)m1);
      const __m256 d2 = _mm256_set1_ps(d * (float)sc2), dm2 = _mm256_set1_ps(dmin * (float)m2);
      const uint8_t* q = qs + 32 * g;
      float* out = y + 64 * g;
      for (int l = 0; l < 32; l += 8) {
        const __m256i a = u8x8(q + l);
        __m256i lo = _mm256_and_si256(a, m4), hi = _mm256_srli_epi32(a, 4);
        if constexpr (kQ5) {
          const __m256i h = u8x8(qh + l);
          lo = _mm256_or_si256(lo, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 2 * g), one), 4));
          hi = _mm256_or_si256(hi, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 2 * g + 1), one), 4));
        }
        _mm256_storeu_ps(out + l, _mm256_fmsub_ps(d1, _mm256_cvtepi32_ps(lo), dm1));
        _mm256_storeu_ps(out + l + 32, _mm256_fmsub_ps(d2, _mm256_cvtepi32_ps(hi), dm2));
      }
    }
  }
}

TALLOW_AVX2_FN void deq_q6_k_avx2(const uint8_t* TALLOW_RESTRICT x, float* TALLOW_RESTRICT y, int64_t nb) {
  const __m256i m4 = _mm256_set1_epi32(0x0F), m30 = _mm256_set1_epi32(0x30), k32 = _mm256_set1_epi32(32);
  for (int64_t b = 0; b < nb; ++b, x += 210, y += 256) {
    const float d = f16_avx2(x + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(x + 192);
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = x + 64 * h;
      const uint8_t* qh = x + 128 + 32 * h;
      float* out = y + 128 * h;
      for (int l = 0; l < 32; l += 8) {
        const int k = l / 16;
        const __m256 s1 = _mm256_set1_ps(d * (float)sc[8 * h + k]), s2 = _mm256_set1_ps(d * (float)sc[8 * h + k + 2]);
        const __m256 s3 = _mm256_set1_ps(d * (float)sc[8 * h + k + 4]), s4 = _mm256_set1_ps(d * (float)sc[8 * h + k + 6]);
        const __m256i a = u8x8(ql + l), c = u8x8(ql + l + 32), hb = u8x8(qh + l);
        const __m256i q1 = _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_and_si256(_mm256_slli_epi32(hb, 4), m30));
        const __m256i q2 = _mm256_or_si256(_mm256_and_si256(c, m4), _mm256_and_si256(_mm256_slli_epi32(hb, 2), m30));
        const __m256i q3 = _mm256_or_si256(_mm256_srli_epi32(a, 4), _mm256_and_si256(hb, m30));
        const __m256i q4 = _mm256_or_si256(_mm256_srli_epi32(c, 4), _mm256_and_si256(_mm256_srli_epi32(hb, 2), m30));
        _mm256_storeu_ps(out + l, _mm256_mul_ps(s1, _mm256_cvtepi32_ps(_mm256_sub_epi32(q1, k32))));
        _mm256_storeu_ps(out + l + 32, _mm256_mul_ps(s2, _mm256_cvtepi32_ps(_mm256_sub_epi32(q2, k32))));
        _mm256_storeu_ps(out + l + 64, _mm256_mul_ps(s3, _mm256_cvtepi32_ps(_mm256_sub_epi32(q3, k32))));
        _mm256_storeu_ps(out + l + 96, _mm256_mul_ps(s4, _mm256_cvtepi32_ps(_mm256_sub_epi32(q4, k32))));
      }
    }
  }
}

// IQ4: the 16-entry kvalues table looked up with pshufb on the nibbles, then the same products.
TALLOW_AVX2_FN static inline void iq4_sub_avx2(const uint8_t* qs, float dl, float* y) {
  const __m128i tbl = _mm_load_si128(reinterpret_cast<const __m128i*>(kIq4nlValues)), m4 = _mm_set1_epi8(0x0F);
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i lo = _mm_shuffle_epi8(tbl, _mm_and_si128(q, m4));
  const __m128i hi = _mm_shuffle_epi8(tbl, _mm_and_si128(_mm_srli_epi16(q, 4), m4));
  const __m256 d = _mm256_set1_ps(dl);
  _mm256_storeu_ps(y, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo))));
  _mm256_storeu_ps(y + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)))));
  _mm256_storeu_ps(y + 16, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi))));
  _mm256_storeu_ps(y + 24, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)))));
}

TALLOW_AVX2_FN void deq_iq4_nl_avx2(const uint8_t* TALLOW_RESTRICT x, float* TALLOW_RESTRICT y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 18, y += 32) iq4_sub_avx2(x + 2, f16_avx2(x), y);
}

TALLOW_AVX2_FN void deq_iq4_xs_avx2(const uint8_t* TALLOW_RESTRICT x, float* TALLOW_RESTRICT y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 136, y += 256) {
    const float d = f16_avx2(x);
    for (int ib = 0; ib < 8; ++ib) iq4_sub_avx2(x + 8 + 16 * ib, d * (float)iq4_xs_scale(x, ib), y + 32 * ib);
  }
}

RowFn avx2_row_fn(DType t) {
  switch (t) {
    case DType::IQ4_NL: return deq_iq4_nl_avx2;
    case DType::IQ4_XS: return deq_iq4_xs_avx2;
    case DType::Q4_0: return deq_q4_0_avx2;
    case DType::Q4_1: return deq_q4_1_avx2;
    case DType::Q5_0: return deq_q5_x_avx2<false>;
    case DType::Q5_1: return deq_q5_x_avx2<true>;
    case DType::Q8_0: return deq_q8_x_avx2<34, 2>;
    case DType::Q8_1: return deq_q8_x_avx2<36, 4>;
    case DType::Q4_K: return deq_q45_k_avx2<false>;
    case DType::Q5_K: return deq_q45_k_avx2<true>;
    case DType::Q6_K: return deq_q6_k_avx2;
    case DType::Q8_K: return deq_q8_k_avx2;
    default: return nullptr;  // Q2_K, Q3_K: the reference routines (compiler-vectorized)
  }
}
#undef TALLOW_AVX2_FN

// ---- AVX-512 row routines: the AVX2 ones 16 lanes at a time (one xmm of bytes widens to one zmm) -------
#define TALLOW_AVX512_FN __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")))

TALLOW_AVX512_FN static inline __m512i u8x16(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
TALLOW_AVX512_FN static inline __m512i i8x16(const uint8_t* p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

TALLOW_AVX512_FN void deq_q4_0_avx512(const uint8_t* TALLOW_RESTRICT x, float* TALLOW_RESTRICT y, int64_t nb) {
  const __m512i m4 = _mm512_set1_epi32(0x0F), k8 = _mm512_set1_epi32(8);
  for (int64_t b = 0; b < nb; ++b, x += 18, y += 32) {
    const __m512 d = _mm512_set1_ps(f16_avx2(x));
    const __m512i a = u8x16(x + 2);
    _mm512_storeu_ps(y, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(a, m4), k8)), d));
    _mm512_storeu_ps(y + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(a, 4), k8)), d));
  }
}

TALLOW_AVX512_FN void deq_q4_1_avx512(const uint8_t* TALLOW_RESTRICT x, float* TALLOW_RESTRICT y, int64_t nb) {
  const __m512i m4 = _mm512_set1_epi32(0x0F);
  for (int64_t b = 0; b < nb; ++b, x += 20, y += 32) {
    const __m512 d = _mm512_set1_ps(f16_avx2(x)), m = _mm512_set1_ps(f16_avx2(x + 2));
    const __m512i a = u8x16(x + 4);
    _mm512_storeu_ps(y, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(a, m4)), d, m));
    _mm512_storeu_ps(y + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(a, 4)), d, m));
  }
}

template <bool kMin>
TALLOW_AVX512_FN void deq_q5_x_avx512(const uint8_t* TALLOW_RESTRICT x, float* TALLOW_RESTRICT y, int64_t nb) {
  constexpr int kTs = kMin ? 24 : 22, kQh = kMin ? 4 : 2;
  const __m512i m4 = _mm512_set1_epi32(0x0F), k16 = _mm512_set1_epi32(16);
  for (int64_t b = 0; b < nb; ++b, x += kTs, y += 32) {
    const __m512 d = _mm512_set1_ps(f16_avx2(x));
    const __m512 m = kMin ? _mm512_set1_ps(f16_avx2(x + 2)) : _mm512_setzero_ps();
    uint32_t qh;
    std::memcpy(&qh, x + kQh, 4);
    const __m512i a = u8x16(x + kQh + 4);
    // Bit j of qh sets bit 4 of element j: lanes of the low nibbles take bits 0-15, the high ones 16-31.
    const __m512i lo = _mm512_mask_or_epi32(_mm512_and_si512(a, m4), (__mmask16)(qh & 0xFFFF), _mm512_and_si512(a, m4), k16);
    const __m512i hi = _mm512_mask_or_epi32(_mm512_srli_epi32(a, 4), (__mmask16)(qh >> 16), _mm512_srli_epi32(a, 4), k16);
    if constexpr (kMin) {
      _mm512_storeu_ps(y, _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), d, m));
      _mm512_storeu_ps(y + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), d, m));
    } else {
      _mm512_storeu_ps(y, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(lo, k16)), d));
      _mm512_storeu_ps(y + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(hi, k16)), d));
    }
  }
}

template <int kTypeSize, int kQsOffset>
TALLOW_AVX512_FN void deq_q8_x_avx512(const uint8_t* TALLOW_RESTRICT x, float* TALLOW_RESTRICT y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += kTypeSize, y += 32) {
    const __m512 d = _mm512_set1_ps(f16_avx2(x));
    _mm512_storeu_ps(y, _mm512_mul_ps(_mm512_cvtepi32_ps(i8x16(x + kQsOffset)), d));
    _mm512_storeu_ps(y + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(i8x16(x + kQsOffset + 16)), d));
  }
}

TALLOW_AVX512_FN void deq_q8_k_avx512(const uint8_t* TALLOW_RESTRICT x, float* TALLOW_RESTRICT y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 292, y += 256) {
    const __m512 d = _mm512_set1_ps(load_f32(x));
    for (int v = 0; v < 16; ++v)
      _mm512_storeu_ps(y + 16 * v, _mm512_mul_ps(_mm512_cvtepi32_ps(i8x16(x + 4 + 16 * v)), d));
  }
}

template <bool kQ5>
TALLOW_AVX512_FN void deq_q45_k_avx512(const uint8_t* TALLOW_RESTRICT x, float* TALLOW_RESTRICT y, int64_t nb) {
  constexpr int kTs = kQ5 ? 176 : 144, kQs = kQ5 ? 48 : 16;
  const __m512i m4 = _mm512_set1_epi32(0x0F), one = _mm512_set1_epi32(1);
  for (int64_t b = 0; b < nb; ++b, x += kTs, y += 256) {
    const float d = f16_avx2(x), dmin = f16_avx2(x + 2);
    const uint8_t* scales = x + 4;
    const uint8_t* qh = x + 16;
    const uint8_t* qs = x + kQs;
    for (int g = 0; g < 4; ++g) {
      int sc1, m1, sc2, m2;
      scale_min_k4(scales, 2 * g, sc1, m1);
      scale_min_k4(scales, 2 * g + 1, sc2, m2);
      const __m512 d1 = _mm512_set1_ps(d * (float)sc1), dm1 = _mm512_set1_ps(dmin * (float)m1);
      const __m512 d2 = _mm512_set1_ps(d * (float)sc2), dm2 = _mm512_set1_ps(dmin * (float)m2);
      const uint8_t* q = qs + 32 * g;
      float* out = y + 64 * g;
      for (int l = 0; l < 32; l += 16) {
        const __m512i a = u8x16(q + l);
        __m512i lo = _mm512_and_si512(a, m4), hi = _mm512_srli_epi32(a, 4);
        if constexpr (kQ5) {
          const __m512i h = u8x16(qh + l);
          lo = _mm512_or_si512(lo, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 2 * g), one), 4));
          hi = _mm512_or_si512(hi, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 2 * g + 1), one), 4));
        }
        _mm512_storeu_ps(out + l, _mm512_fmsub_ps(d1, _mm512_cvtepi32_ps(lo), dm1));
        _mm512_storeu_ps(out + l + 32, _mm512_fmsub_ps(d2, _mm512_cvtepi32_ps(hi), dm2));
      }
    }
  }
}

TALLOW_AVX512_FN void deq_q6_k_avx512(const uint8_t* TALLOW_RESTRICT x, float* TALLOW_RESTRICT y, int64_t nb) {
  const __m512i m4 = _mm512_set1_epi32(0x0F), m30 = _mm512_set1_epi32(0x30), k32 = _mm512_set1_epi32(32);
  for (int64_t b = 0; b < nb; ++b, x += 210, y += 256) {
    const float d = f16_avx2(x + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(x + 192);
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = x + 64 * h;
      const uint8_t* qh = x + 128 + 32 * h;
      float* out = y + 128 * h;
      for (int k = 0; k < 2; ++k) {  // l in [16k, 16k + 16): one zmm, one scale per output group
        const int l = 16 * k;
        const __m512 s1 = _mm512_set1_ps(d * (float)sc[8 * h + k]), s2 = _mm512_set1_ps(d * (float)sc[8 * h + k + 2]);
        const __m512 s3 = _mm512_set1_ps(d * (float)sc[8 * h + k + 4]), s4 = _mm512_set1_ps(d * (float)sc[8 * h + k + 6]);
        const __m512i a = u8x16(ql + l), c = u8x16(ql + l + 32), hb = u8x16(qh + l);
        const __m512i q1 = _mm512_or_si512(_mm512_and_si512(a, m4), _mm512_and_si512(_mm512_slli_epi32(hb, 4), m30));
        const __m512i q2 = _mm512_or_si512(_mm512_and_si512(c, m4), _mm512_and_si512(_mm512_slli_epi32(hb, 2), m30));
        const __m512i q3 = _mm512_or_si512(_mm512_srli_epi32(a, 4), _mm512_and_si512(hb, m30));
        const __m512i q4 = _mm512_or_si512(_mm512_srli_epi32(c, 4), _mm512_and_si512(_mm512_srli_epi32(hb, 2), m30));
        _mm512_storeu_ps(out + l, _mm512_mul_ps(s1, _mm512_cvtepi32_ps(_mm512_sub_epi32(q1, k32))));
        _mm512_storeu_ps(out + l + 32, _mm512_mul_ps(s2, _mm512_cvtepi32_ps(_mm512_sub_epi32(q2, k32))));
        _mm512_storeu_ps(out + l + 64, _mm512_mul_ps(s3, _mm512_cvtepi32_ps(_mm512_sub_epi32(q3, k32))));
        _mm512_storeu_ps(out + l + 96, _mm512_mul_ps(s4, _mm512_cvtepi32_ps(_mm512_sub_epi32(q4, k32))));
      }
    }
  }
}

TALLOW_AVX512_FN static inline void iq4_sub_avx512(const uint8_t* qs, float dl, float* y) {
  const __m128i tbl = _mm_load_si128(reinterpret_cast<const __m128i*>(kIq4nlValues)), m4 = _mm_set1_epi8(0x0F);
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i lo = _mm_shuffle_epi8(tbl, _mm_and_si128(q, m4));
  const __m128i hi = _mm_shuffle_epi8(tbl, _mm_and_si128(_mm_srli_epi16(q, 4), m4));
  const __m512 d = _mm512_set1_ps(dl);
  _mm512_storeu_ps(y, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo))));
  _mm512_storeu_ps(y + 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi))));
}

TALLOW_AVX512_FN void deq_iq4_nl_avx512(const uint8_t* TALLOW_RESTRICT x, float* TALLOW_RESTRICT y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 18, y += 32) iq4_sub_avx512(x + 2, f16_avx2(x), y);
}

TALLOW_AVX512_FN void deq_iq4_xs_avx512(const uint8_t* TALLOW_RESTRICT x, float* TALLOW_RESTRICT y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += 136, y += 256) {
    const float d = f16_avx2(x);
    for (int ib = 0; ib < 8; ++ib) iq4_sub_avx512(x + 8 + 16 * ib, d * (float)iq4_xs_scale(x, ib), y + 32 * ib);
  }
}

RowFn avx512_row_fn(DType t) {
  switch (t) {
    case DType::IQ4_NL: return deq_iq4_nl_avx512;
    case DType::IQ4_XS: return deq_iq4_xs_avx512;
    case DType::Q4_0: return deq_q4_0_avx512;
    case DType::Q4_1: return deq_q4_1_avx512;
    case DType::Q5_0: return deq_q5_x_avx512<false>;
    case DType::Q5_1: return deq_q5_x_avx512<true>;
    case DType::Q8_0: return deq_q8_x_avx512<34, 2>;
    case DType::Q8_1: return deq_q8_x_avx512<36, 4>;
    case DType::Q4_K: return deq_q45_k_avx512<false>;
    case DType::Q5_K: return deq_q45_k_avx512<true>;
    case DType::Q6_K: return deq_q6_k_avx512;
    case DType::Q8_K: return deq_q8_k_avx512;
    default: return nullptr;
  }
}
#undef TALLOW_AVX512_FN
#endif  // TALLOW_DEQ_AVX2

RowFn reference_row_fn(DType t);

// The row routine for dtype t: the AVX-512 or AVX2 one when the GEMM runs that kernel set (its run-time
// choice for this CPU, or gemm::set_isa), else (portable, or Q2_K / Q3_K) the reference.
RowFn row_fn(DType t) {
#if TALLOW_DEQ_AVX2
  const char* isa = gemm::isa_name();
  if (isa[0] == 'a') {  // "avx512" or "avx2"
    if (const RowFn f = std::strcmp(isa, "avx512") == 0 ? avx512_row_fn(t) : avx2_row_fn(t)) return f;
  }
#endif
  return reference_row_fn(t);
}

RowFn reference_row_fn(DType t) {
  switch (t) {
    case DType::Q4_0: return deq_q4_0;
    case DType::Q4_1: return deq_q4_1;
    case DType::Q5_0: return deq_q5_0;
    case DType::Q5_1: return deq_q5_1;
    case DType::Q8_0: return deq_q8_x<34, 2>;
    case DType::Q8_1: return deq_q8_x<36, 4>;
    case DType::Q2_K: return deq_q2_k;
    case DType::Q3_K: return deq_q3_k;
    case DType::Q4_K: return deq_q4_k;
    case DType::Q5_K: return deq_q5_k;
    case DType::Q6_K: return deq_q6_k;
    case DType::Q8_K: return deq_q8_k;
    case DType::IQ4_NL: return deq_iq4_nl;
    case DType::IQ4_XS: return deq_iq4_xs;
    default: return nullptr;
  }
}

template <class T>
TALLOW_SIMD_CLONES void store_row(const float* TALLOW_RESTRICT s, T* TALLOW_RESTRICT d, int64_t n) {
  TALLOW_PRAGMA_SIMD
  for (int64_t i = 0; i < n; ++i) d[i] = from_f32<T>(s[i]);
}

constexpr int64_t kSeg = 4096;  // elements per work item (whole 256-element super-blocks)

// nb blocks of bs elements at src -> dst in T (f32 directly; f16/bf16 through an f32 buffer).
template <class T>
void write_segment(RowFn fn, const uint8_t* src, T* dst, int64_t nb, int64_t bs) {
  if constexpr (std::is_same_v<T, float>) {
    fn(src, dst, nb);
  } else {
    alignas(64) float buf[kSeg];
    fn(src, buf, nb);
    store_row<T>(buf, dst, nb * bs);
  }
}

}  // namespace

void dequantize_row_f32(DType dtype, const void* src, float* dst, int64_t n) {
  const RowFn fn = row_fn(dtype);
  TALLOW_CHECK_TYPE(fn, "dequantize_row_f32: ", dtype_name(dtype), " is not a GGUF block dtype");
  const int64_t bs = dtype_block_size(dtype);
  TALLOW_CHECK(n % bs == 0, "dequantize_row_f32: ", n, " elements is not a whole number of ", dtype_name(dtype),
               " blocks of ", bs);
  fn(static_cast<const uint8_t*>(src), dst, n / bs);
}

Tensor dequantize(const Tensor& q, DType dtype) {
  check_defined("dequantize", q, "q");
  TALLOW_CHECK_TYPE(is_block_dtype(q.dtype()), "dequantize: q must be a GGUF block dtype (q4_0 ... q8_k), got ",
                    dtype_name(q.dtype()), " tensor of shape ", shape_str(q.shape()));
  TALLOW_CHECK_TYPE(dtype == DType::F32 || dtype == DType::F16 || dtype == DType::BF16,
                    "dequantize: output dtype must be float32, float16 or bfloat16, got ", dtype_name(dtype), " (for ",
                    dtype_name(q.dtype()), " tensor of shape ", shape_str(q.shape()), ")");
  const int64_t bs = dtype_block_size(q.dtype()), ts = dtype_type_size(q.dtype());
  TALLOW_CHECK(q.dim() >= 1 && q.size(-1) % bs == 0, "dequantize: last dimension of ", dtype_name(q.dtype()),
               " tensor of shape ", shape_str(q.shape()), " must be a multiple of its block size ", bs);
  TALLOW_CHECK(q.size(-1) <= 1 || q.stride(-1) == 1, "dequantize: ", dtype_name(q.dtype()), " tensor of shape ",
               shape_str(q.shape()), " and strides ", shape_str(q.strides()),
               " must be contiguous along the last dimension");
  if (!q.device().is_cpu()) return device_op(&BackendOps::dequantize, "dequantize", q)(q, dtype);

  Tensor o = Tensor::empty(q.shape(), dtype, q.device());
  const int64_t rows = num_rows(q), K = q.size(-1);
  if (rows == 0 || K == 0) return o;

  // Work items: segments of up to kSeg elements (whole 256-element super-blocks) of each row, so
  // a few long rows still spread over all threads.
  const int64_t segs = (K + kSeg - 1) / kSeg;
  const RowFn fn = row_fn(q.dtype());
  const uint8_t* base = static_cast<const uint8_t*>(q.storage()->data());
  const int64_t grain = std::max<int64_t>(1, 32768 / std::min(K, kSeg));

  TALLOW_DISPATCH_FLOAT("dequantize", dtype, [&] {
    scalar_t* out = o.data<scalar_t>();
    parallel_for(0, rows * segs, grain, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t r = i / segs, c0 = (i % segs) * kSeg, n = std::min(kSeg, K - c0);
        write_segment<scalar_t>(fn, base + (row_offset(q, r) + c0) / bs * ts, out + r * K + c0, n / bs, bs);
      }
    });
  });
  return o;
}

}  // namespace tallow::ops
