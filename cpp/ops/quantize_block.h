// Per-block GGUF quantizers: one float block in, one GGUF block out, compiled unchanged by the C++
// compiler (ops/quantize.cpp) and by nvcc (cuda/quantize.cu), so the CPU and CUDA ops write the same bytes.
//
// Algorithms. q4_0, q4_1, q5_0, q5_1, q8_0: gguf-py's numpy `gguf.quants.quantize` (which is llama.cpp's
// quantize_row_*_ref); the scale element is the first of largest magnitude, as numpy's argmax picks it.
// q8_1, q2_k ... q6_k, q8_k: llama.cpp's quantize_row_*_ref without an importance matrix
// (ggml-quants.c: make_qx_quants, make_q3_quants, make_qkx2_quants, nearest_int), reimplemented with the
// same floating-point operations in the same order (the searches run several sub-blocks side by side as
// vector lanes; each lane's operations are still exactly the scalar reference's). iq4_nl, iq4_xs: llama.cpp's
// quantize_iq4_nl / quantize_iq4_xs as ggml_quantize_chunk calls them (ntry 7, no importance matrix).
//
// Bit-identity rules for anything edited here: every float operation is a single IEEE op rounded to
// nearest (both compilers are told not to contract a*b+c into an FMA: -ffp-contract=off for quantize.cpp,
// -fmad=false for quantize.cu; see CMakeLists.txt / cmake/cuda.cmake), no fast-math functions (only
// fabsf, sqrtf, roundf and division, all correctly rounded on both sides), and f16 conversions by the
// integer routines below (round to nearest even, like numpy's astype(float16) and ggml's FP32_TO_FP16).
// Inputs with NaN or Inf give unspecified (but memory-safe) blocks. Where an extreme is a zero of either
// sign, the first one wins, as in llama.cpp (numpy's min/max leave that zero's sign unspecified, so
// gguf-py may store +0 where this stores -0 for q4_1 / q5_1's m; the values are the same).
#pragma once
#include <math.h>

#include <cstdint>
#include <cstring>

#include "core/dtype.h"

// Host code inlines everything into quantize.cpp's per-ISA clones (core/simd.h: target_clones), so the
// lane loops are vectorized for the clone's ISA, not the baseline's (q4_k: 10 -> 29 M weights/s per core
// on an AVX-512 Xeon).
#if defined(__CUDACC__)
#define TALLOW_QBLOCK_FN __host__ __device__ inline
#elif defined(__GNUC__) || defined(__clang__)
#define TALLOW_QBLOCK_FN inline __attribute__((always_inline))
#else
#define TALLOW_QBLOCK_FN inline
#endif

namespace tallow::quant_block {

constexpr int kQK = 256;  // super-block size of the k-quants
constexpr float kGroupMaxEps = 1e-15f;

TALLOW_QBLOCK_FN uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

TALLOW_QBLOCK_FN float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// f32 -> f16 bits, round to nearest even, in integer arithmetic only (no dependence on FTZ modes).
TALLOW_QBLOCK_FN uint16_t fp32_to_fp16(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // NaN stays NaN
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);                         // rounds to >= 65520: Inf
  if (a >= 0x38800000u) {                                                            // normal f16
    a += 0xc8000fffu + ((a >> 13) & 1u);  // rebias the exponent by -112 and round to nearest even
    return (uint16_t)(sign | (a >> 13));
  }
  const uint32_t e = a >> 23;  // subnormal f16 or zero: value = m * 2^(e-150), in units of 2^-24
  if (e < 102) return (uint16_t)sign;  // < 2^-25: rounds to zero (exactly 2^-25 too, to even)
  const uint32_t m = (a & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - e;  // 14 .. 24
  uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return (uint16_t)(sign | q);
}

TALLOW_QBLOCK_FN float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 31) return bits_float(sign | 0x7f800000u | (m << 13));
  if (e != 0) return bits_float(sign | ((e + 112u) << 23) | (m << 13));
  if (m == 0) return bits_float(sign);
  uint32_t mm = m, ee = 113;  // subnormal: normalise (exact)
  while (!(mm & 0x400u)) { mm <<= 1; --ee; }
  return bits_float(sign | (ee << 23) | ((mm & 0x3ffu) << 13));
}

TALLOW_QBLOCK_FN void store_f16(uint8_t* p, float f) {
  const uint16_t h = fp32_to_fp16(f);
  p[0] = (uint8_t)(h & 0xff);
  p[1] = (uint8_t)(h >> 8);
}
// The stored f16 read back as f32 (the k-quants reuse the rounded scale).
TALLOW_QBLOCK_FN float stored_f16(const uint8_t* p) { return fp16_to_fp32((uint16_t)(p[0] | (p[1] << 8))); }
TALLOW_QBLOCK_FN void store_u32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = (uint8_t)(v >> (8 * i));
}

TALLOW_QBLOCK_FN int imin(int a, int b) { return a < b ? a : b; }
TALLOW_QBLOCK_FN int imax(int a, int b) { return a > b ? a : b; }

// ggml's nearest_int: round to nearest even through the f32 mantissa (|fval| <= 2^22 - 1).
TALLOW_QBLOCK_FN int nearest_int(float fval) {
  const float val = fval + 12582912.f;
  return (int)(float_bits(val) & 0x007fffffu) - 0x00400000;
}

// ---- 32-element blocks ------------------------------------------------------------------------

// The first element of largest magnitude (numpy's argmax of |x|).
TALLOW_QBLOCK_FN float signed_absmax(const float* x, int n) {
  float amax = fabsf(x[0]), max = x[0];
  for (int j = 1; j < n; ++j)
    if (amax < fabsf(x[j])) { amax = fabsf(x[j]); max = x[j]; }
  return max;
}

TALLOW_QBLOCK_FN void min_max(const float* x, int n, float* mn, float* mx) {
  float lo = x[0], hi = x[0];
  for (int j = 1; j < n; ++j) {
    if (x[j] < lo) lo = x[j];
    if (x[j] > hi) hi = x[j];
  }
  *mn = lo;
  *mx = hi;
}

// Q4_0 (18 B): f16 d | u8 qs[16]
TALLOW_QBLOCK_FN void quantize_q4_0(const float* x, uint8_t* y) {
  const float max = signed_absmax(x, 32);
  const float d = max / -8.f;
  const float id = d != 0.f ? 1.0f / d : 0.0f;
  store_f16(y, d);
  for (int j = 0; j < 16; ++j) {
    const int q0 = imin(15, (int)(x[j] * id + 8.5f)), q1 = imin(15, (int)(x[j + 16] * id + 8.5f));
    y[2 + j] = (uint8_t)(q0 | (q1 << 4));
  }
}

// Q4_1 (20 B): f16 d | f16 m | u8 qs[16]
TALLOW_QBLOCK_FN void quantize_q4_1(const float* x, uint8_t* y) {
  float min, max;
  min_max(x, 32, &min, &max);
  const float d = (max - min) / 15.f;
  const float id = d != 0.f ? 1.0f / d : 0.0f;
  store_f16(y, d);
  store_f16(y + 2, min);
  for (int j = 0; j < 16; ++j) {
    const int q0 = imin(15, (int)((x[j] - min) * id + 0.5f)), q1 = imin(15, (int)((x[j + 16] - min) * id + 0.5f));
    y[4 + j] = (uint8_t)(q0 | (q1 << 4));
  }
}

// Q5_0 (22 B): f16 d | u32 qh | u8 qs[16]
TALLOW_QBLOCK_FN void quantize_q5_0(const float* x, uint8_t* y) {
  const float max = signed_absmax(x, 32);
  const float d = max / -16.f;
  const float id = d != 0.f ? 1.0f / d : 0.0f;
  store_f16(y, d);
  uint32_t qh = 0;
  for (int j = 0; j < 16; ++j) {
    const int q0 = imin(31, (int)(x[j] * id + 16.5f)), q1 = imin(31, (int)(x[j + 16] * id + 16.5f));
    y[6 + j] = (uint8_t)((q0 & 15) | ((q1 & 15) << 4));
    qh |= (uint32_t)(q0 >> 4) << j;
    qh |= (uint32_t)(q1 >> 4) << (j + 16);
  }
  store_u32(y + 2, qh);
}

// Q5_1 (24 B): f16 d | f16 m | u32 qh | u8 qs[16]
TALLOW_QBLOCK_FN void quantize_q5_1(const float* x, uint8_t* y) {
  float min, max;
  min_max(x, 32, &min, &max);
  const float d = (max - min) / 31.f;
  const float id = d != 0.f ? 1.0f / d : 0.0f;
  store_f16(y, d);
  store_f16(y + 2, min);
  uint32_t qh = 0;
  for (int j = 0; j < 16; ++j) {
    const int q0 = imin(31, (int)((x[j] - min) * id + 0.5f)), q1 = imin(31, (int)((x[j + 16] - min) * id + 0.5f));
    y[8 + j] = (uint8_t)((q0 & 15) | ((q1 & 15) << 4));
    qh |= (uint32_t)(q0 >> 4) << j;
    qh |= (uint32_t)(q1 >> 4) << (j + 16);
  }
  store_u32(y + 4, qh);
}

TALLOW_QBLOCK_FN float absmax(const float* x, int n) {
  float amax = 0.f;
  for (int j = 0; j < n; ++j) amax = amax > fabsf(x[j]) ? amax : fabsf(x[j]);
  return amax;
}

// Q8_0 (34 B): f16 d | i8 qs[32]
TALLOW_QBLOCK_FN void quantize_q8_0(const float* x, uint8_t* y) {
  const float d = absmax(x, 32) / 127.f;
  const float id = d != 0.f ? 1.0f / d : 0.0f;
  store_f16(y, d);
  for (int j = 0; j < 32; ++j) y[2 + j] = (uint8_t)(int8_t)roundf(x[j] * id);
}

// Q8_1 (36 B): f16 d | f16 s (= d * sum of quants) | i8 qs[32]
TALLOW_QBLOCK_FN void quantize_q8_1(const float* x, uint8_t* y) {
  const float d = absmax(x, 32) / 127.f;
  const float id = d != 0.f ? 1.0f / d : 0.0f;
  store_f16(y, d);
  int sum = 0;
  for (int j = 0; j < 32; ++j) {
    const int8_t q = (int8_t)roundf(x[j] * id);
    y[4 + j] = (uint8_t)q;
    sum += q;
  }
  store_f16(y + 2, (float)sum * d);
}

// ---- k-quant helpers (ggml-quants.c, no importance matrix) ------------------------------------

// make_qx_quants with rmse_type 1 and no weights (symmetric levels L in [0, 2*nmax), offset by nmax; the
// scale chosen among 19 candidates by least squares weighted by x^2) for NL sub-blocks of n <= 16 at
// once: lane l is sub-block l, x and L laid out [n][NL]. Each lane runs exactly llama.cpp's scalar
// operations in their order (same bytes); an all-zero lane (where llama.cpp returns early) is
// discarded at the end.
template <int NL>
TALLOW_QBLOCK_FN void make_qx_quants_lanes(int n, int nmax, const float* x, int8_t* L, float* scale_out) {
  float max[NL], amax[NL], iscale[NL], sumlx[NL], suml2[NL], scale[NL], best[NL];
  int take[NL];
  int Lbest[16 * NL], Laux[16 * NL];
  for (int l = 0; l < NL; ++l) max[l] = amax[l] = 0;
  for (int i = 0; i < n; ++i)
    for (int l = 0; l < NL; ++l) {
      const float xi = x[i * NL + l], ax = fabsf(xi);
      const bool bigger = ax > amax[l];
      amax[l] = bigger ? ax : amax[l];
      max[l] = bigger ? xi : max[l];
    }
  for (int l = 0; l < NL; ++l) {
    iscale[l] = (float)(-nmax) / max[l];
    sumlx[l] = suml2[l] = 0;
  }
  for (int i = 0; i < n; ++i)
    for (int l = 0; l < NL; ++l) {
      const float xi = x[i * NL + l];
      const int q = imax(-nmax, imin(nmax - 1, nearest_int(iscale[l] * xi)));
      Lbest[i * NL + l] = q + nmax;
      const float w = xi * xi, fq = (float)q;
      sumlx[l] += w * xi * fq;
      suml2[l] += w * fq * fq;
    }
  for (int l = 0; l < NL; ++l) {
    scale[l] = suml2[l] != 0.f ? sumlx[l] / suml2[l] : 0.0f;
    best[l] = scale[l] * sumlx[l];
  }
  for (int is = -9; is <= 9; ++is) {
    if (is == 0) continue;
    for (int l = 0; l < NL; ++l) {
      iscale[l] = -((float)nmax + 0.1f * (float)is) / max[l];
      sumlx[l] = suml2[l] = 0;
    }
    for (int i = 0; i < n; ++i)
      for (int l = 0; l < NL; ++l) {
        const float xi = x[i * NL + l];
        const int q = imax(-nmax, imin(nmax - 1, nearest_int(iscale[l] * xi)));
        Laux[i * NL + l] = q + nmax;
        const float w = xi * xi, fq = (float)q;
        sumlx[l] += w * xi * fq;
        suml2[l] += w * fq * fq;
      }
    int any = 0;
    for (int l = 0; l < NL; ++l) {
      take[l] = (suml2[l] > 0) & (sumlx[l] * sumlx[l] > best[l] * suml2[l]);
      const float s = sumlx[l] / suml2[l];
      scale[l] = take[l] ? s : scale[l];
      best[l] = take[l] ? s * sumlx[l] : best[l];
      any |= take[l];
    }
    if (any)
      for (int i = 0; i < n; ++i)
        for (int l = 0; l < NL; ++l) Lbest[i * NL + l] = take[l] ? Laux[i * NL + l] : Lbest[i * NL + l];
  }
  for (int l = 0; l < NL; ++l) scale_out[l] = amax[l] < kGroupMaxEps ? 0.f : scale[l];
  for (int i = 0; i < n; ++i)
    for (int l = 0; l < NL; ++l) L[i * NL + l] = amax[l] < kGroupMaxEps ? (int8_t)0 : (int8_t)Lbest[i * NL + l];
}

// make_q3_quants with do_rmse: levels in [0, 2*nmax), refined coordinate-wise (5 passes).
TALLOW_QBLOCK_FN float make_q3_quants(int n, int nmax, const float* x, int8_t* L) {
  float max = 0, amax = 0;
  for (int i = 0; i < n; ++i) {
    const float ax = fabsf(x[i]);
    if (ax > amax) { amax = ax; max = x[i]; }
  }
  if (amax < kGroupMaxEps) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    return 0.f;
  }
  const float iscale = (float)(-nmax) / max;
  float sumlx = 0, suml2 = 0;
  for (int i = 0; i < n; ++i) {
    int l = nearest_int(iscale * x[i]);
    l = imax(-nmax, imin(nmax - 1, l));
    L[i] = (int8_t)l;
    const float w = x[i] * x[i];
    sumlx += w * x[i] * (float)l;
    suml2 += w * (float)l * (float)l;
  }
  for (int itry = 0; itry < 5; ++itry) {
    int n_changed = 0;
    for (int i = 0; i < n; ++i) {
      const float w = x[i] * x[i];
      float slx = sumlx - w * x[i] * (float)L[i];
      if (slx > 0) {
        float sl2 = suml2 - w * (float)L[i] * (float)L[i];
        int new_l = nearest_int(x[i] * sl2 / slx);
        new_l = imax(-nmax, imin(nmax - 1, new_l));
        if (new_l != L[i]) {
          slx += w * x[i] * (float)new_l;
          sl2 += w * (float)new_l * (float)new_l;
          if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
            L[i] = (int8_t)new_l;
            sumlx = slx;
            suml2 = sl2;
            ++n_changed;
          }
        }
      }
    }
    if (!n_changed) break;
  }
  for (int i = 0; i < n; ++i) L[i] = (int8_t)(L[i] + nmax);
  return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

// make_qkx2_quants (asymmetric levels L in [0, nmax] with a scale and a min, returned as -min in the_min,
// searched over nstep+1 candidate scales by weighted least squares, kMad: absolute instead of squared
// error) for NL sub-blocks of n <= 32 at once: lane l is sub-block l, x / weights / L laid out [n][NL].
// Each lane runs exactly llama.cpp's scalar operations in their order (same bytes); the lanes only let
// the compiler put sub-blocks side by side in vector registers (~2x on AVX2). A flat lane (max == min,
// where llama.cpp returns early) computes garbage that is discarded at the end.
template <int NL, bool kMad>
TALLOW_QBLOCK_FN void make_qkx2_quants_lanes(int n, int nmax, const float* x, const float* weights, uint8_t* L,
                                             float* scale_out, float* the_min, float rmin, float rdelta,
                                             int nstep) {
  float mn[NL], mx[NL], mn0[NL], sum_w[NL], sum_x[NL], scale[NL], best[NL], iscale[NL];
  float sl[NL], sl2[NL], sxl[NL], ts[NL], tm[NL], cur[NL], D[NL];
  int take[NL];
  int Lbest[32 * NL], Laux[32 * NL];
  for (int l = 0; l < NL; ++l) {
    mn[l] = mx[l] = x[l];
    sum_w[l] = weights[l];
    sum_x[l] = sum_w[l] * x[l];
  }
  for (int i = 1; i < n; ++i) {
    for (int l = 0; l < NL; ++l) {
      const float xi = x[i * NL + l], w = weights[i * NL + l];
      mn[l] = xi < mn[l] ? xi : mn[l];
      mx[l] = xi > mx[l] ? xi : mx[l];
      sum_w[l] += w;
      sum_x[l] += w * xi;
    }
  }
  for (int l = 0; l < NL; ++l) {
    mn[l] = mn[l] > 0 ? 0.f : mn[l];
    mn0[l] = mn[l];
    iscale[l] = (float)nmax / (mx[l] - mn[l]);
    scale[l] = 1 / iscale[l];
    best[l] = 0;
  }
  for (int i = 0; i < n; ++i) {
    for (int l = 0; l < NL; ++l) {
      const float xi = x[i * NL + l];
      const int q = imax(0, imin(nmax, nearest_int(iscale[l] * (xi - mn[l]))));
      Lbest[i * NL + l] = q;
      float diff = scale[l] * (float)q + mn[l] - xi;
      diff = kMad ? fabsf(diff) : diff * diff;
      best[l] += weights[i * NL + l] * diff;
    }
  }
  for (int is = 0; is <= nstep; ++is) {
    for (int l = 0; l < NL; ++l) {
      iscale[l] = (rmin + rdelta * (float)is + (float)nmax) / (mx[l] - mn[l]);
      sl[l] = sl2[l] = sxl[l] = 0;
    }
    for (int i = 0; i < n; ++i) {
      for (int l = 0; l < NL; ++l) {
        const float xi = x[i * NL + l], w = weights[i * NL + l];
        const int q = imax(0, imin(nmax, nearest_int(iscale[l] * (xi - mn[l]))));
        Laux[i * NL + l] = q;
        const float fq = (float)q;
        sl[l] += w * fq;
        sl2[l] += w * fq * fq;
        sxl[l] += w * fq * xi;
      }
    }
    for (int l = 0; l < NL; ++l) {
      D[l] = sum_w[l] * sl2[l] - sl[l] * sl[l];
      const float s = (sum_w[l] * sxl[l] - sum_x[l] * sl[l]) / D[l];
      const float m = (sl2[l] * sum_x[l] - sl[l] * sxl[l]) / D[l];
      ts[l] = m > 0 ? sxl[l] / sl2[l] : s;
      tm[l] = m > 0 ? 0.f : m;
      cur[l] = 0;
    }
    for (int i = 0; i < n; ++i) {
      for (int l = 0; l < NL; ++l) {
        float diff = ts[l] * (float)Laux[i * NL + l] + tm[l] - x[i * NL + l];
        diff = kMad ? fabsf(diff) : diff * diff;
        cur[l] += weights[i * NL + l] * diff;
      }
    }
    int any = 0;
    for (int l = 0; l < NL; ++l) {
      take[l] = (D[l] > 0) & (cur[l] < best[l]);
      best[l] = take[l] ? cur[l] : best[l];
      scale[l] = take[l] ? ts[l] : scale[l];
      mn[l] = take[l] ? tm[l] : mn[l];
      any |= take[l];
    }
    if (any)
      for (int i = 0; i < n; ++i)
        for (int l = 0; l < NL; ++l) Lbest[i * NL + l] = take[l] ? Laux[i * NL + l] : Lbest[i * NL + l];
  }
  for (int l = 0; l < NL; ++l) {
    const bool flat = mx[l] == mn0[l];
    the_min[l] = flat ? -mn0[l] : -mn[l];
    scale_out[l] = flat ? 0.f : scale[l];
  }
  for (int i = 0; i < n; ++i)
    for (int l = 0; l < NL; ++l) L[i * NL + l] = mx[l] == mn0[l] ? (uint8_t)0 : (uint8_t)Lbest[i * NL + l];
}

// The 6-bit scale j and min j of Q4_K / Q5_K's 12 packed bytes.
TALLOW_QBLOCK_FN void get_scale_min_k4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    *m = (uint8_t)((q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4));
  }
}

// ---- 256-element super-blocks -----------------------------------------------------------------

// Q2_K (84 B): u8 scales[16] (low 4 bits scale, high 4 bits min) | u8 qs[64] | f16 d | f16 dmin
TALLOW_QBLOCK_FN void quantize_q2_k(const float* x, uint8_t* y) {
  uint8_t L[kQK], Lt[kQK];
  float xt[kQK], wt[kQK], mins[16], scales[16];
  uint8_t* sc = y;
  uint8_t* qs = y + 16;
  const float q4scale = 15.f;
  for (int j = 0; j < 16; ++j)  // sub-block j in lane j
    for (int i = 0; i < 16; ++i) {
      xt[i * 16 + j] = x[16 * j + i];
      wt[i * 16 + j] = fabsf(x[16 * j + i]);
    }
  make_qkx2_quants_lanes<16, true>(16, 3, xt, wt, Lt, scales, mins, -0.5f, 0.1f, 15);
  float max_scale = 0, max_min = 0;
  for (int j = 0; j < 16; ++j) {
    for (int i = 0; i < 16; ++i) L[16 * j + i] = Lt[i * 16 + j];
    if (scales[j] > max_scale) max_scale = scales[j];
    if (mins[j] > max_min) max_min = mins[j];
  }
  if (max_scale > 0) {
    const float iscale = q4scale / max_scale;
    for (int j = 0; j < 16; ++j) sc[j] = (uint8_t)nearest_int(iscale * scales[j]);
    store_f16(y + 80, max_scale / q4scale);
  } else {
    for (int j = 0; j < 16; ++j) sc[j] = 0;
    store_f16(y + 80, 0.f);
  }
  if (max_min > 0) {
    const float iscale = q4scale / max_min;
    for (int j = 0; j < 16; ++j) sc[j] = (uint8_t)(sc[j] | (nearest_int(iscale * mins[j]) << 4));
    store_f16(y + 82, max_min / q4scale);
  } else {
    store_f16(y + 82, 0.f);
  }
  const float dall = stored_f16(y + 80), dmin = stored_f16(y + 82);
  for (int j = 0; j < 16; ++j) {
    const float d = dall * (float)(sc[j] & 0xF);
    if (!(d != 0.f)) continue;
    const float dm = dmin * (float)(sc[j] >> 4);
    for (int ii = 0; ii < 16; ++ii) {
      const int l = nearest_int((x[16 * j + ii] + dm) / d);
      L[16 * j + ii] = (uint8_t)imax(0, imin(3, l));
    }
  }
  for (int j = 0; j < kQK; j += 128)
    for (int l = 0; l < 32; ++l)
      qs[j / 4 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6));
}

// Q3_K (110 B): u8 hmask[32] | u8 qs[64] | u8 scales[12] (16 6-bit scales) | f16 d
TALLOW_QBLOCK_FN void quantize_q3_k(const float* x, uint8_t* y) {
  int8_t L[kQK];
  float scales[16];
  uint8_t* hmask = y;
  uint8_t* qs = y + 32;
  uint8_t* sc = y + 96;
  float max_scale = 0, amax = 0;
  for (int j = 0; j < 16; ++j) {
    scales[j] = make_q3_quants(16, 4, x + 16 * j, L + 16 * j);
    const float scale = fabsf(scales[j]);
    if (scale > amax) { amax = scale; max_scale = scales[j]; }
  }
  for (int j = 0; j < 12; ++j) sc[j] = 0;
  if (max_scale != 0.f) {
    const float iscale = -32.f / max_scale;
    for (int j = 0; j < 16; ++j) {
      int8_t l = (int8_t)nearest_int(iscale * scales[j]);
      l = (int8_t)(imax(-32, imin(31, l)) + 32);
      if (j < 8) sc[j] = (uint8_t)(l & 0xF);
      else sc[j - 8] = (uint8_t)(sc[j - 8] | ((l & 0xF) << 4));
      l = (int8_t)(l >> 4);
      sc[j % 4 + 8] = (uint8_t)(sc[j % 4 + 8] | (l << (2 * (j / 4))));
    }
    store_f16(y + 108, 1 / iscale);
  } else {
    store_f16(y + 108, 0.f);
  }
  const float dall = stored_f16(y + 108);
  for (int j = 0; j < 16; ++j) {
    int8_t s = (int8_t)(j < 8 ? sc[j] & 0xF : sc[j - 8] >> 4);
    s = (int8_t)((s | (((sc[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32);
    const float d = dall * (float)s;
    if (!(d != 0.f)) continue;
    for (int ii = 0; ii < 16; ++ii) {
      const int l = nearest_int(x[16 * j + ii] / d);
      L[16 * j + ii] = (int8_t)(imax(-4, imin(3, l)) + 4);
    }
  }
  for (int j = 0; j < 32; ++j) hmask[j] = 0;
  int m = 0;
  uint8_t hm = 1;
  for (int j = 0; j < kQK; ++j) {
    if (L[j] > 3) {
      hmask[m] = (uint8_t)(hmask[m] | hm);
      L[j] = (int8_t)(L[j] - 4);
    }
    if (++m == 32) { m = 0; hm = (uint8_t)(hm << 1); }
  }
  for (int j = 0; j < kQK; j += 128)
    for (int l = 0; l < 32; ++l)
      qs[j / 4 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6));
}

// Q4_K and Q5_K share their scales: 8 sub-blocks of 32 per block with 6-bit scales and mins packed in 12
// bytes at y + 4 (f16 d, f16 dmin at y). NB consecutive blocks (x: NB * 256 floats, y: NB blocks of ts
// bytes) go through the sub-block search together, 8 * NB lanes wide: each lane is still one sub-block
// computed exactly as llama.cpp does, so NB changes the speed (more independent work per step), never
// the bytes. L receives the levels 0..nmax of the NB blocks (NB * 256).
template <int NB>
TALLOW_QBLOCK_FN void quantize_k4_scales(const float* x, uint8_t* y, int ts, uint8_t* L, int nmax, float rmin,
                                         int nstep) {
  constexpr int NL = 8 * NB;
  float xt[32 * NL], wt[32 * NL], mins[NL], scales[NL], av_x[NL];
  uint8_t Lt[32 * NL];
  for (int j = 0; j < NL; ++j)  // sub-block j (block j / 8) in lane j
    for (int i = 0; i < 32; ++i) xt[i * NL + j] = x[32 * j + i];
  for (int j = 0; j < NL; ++j) {
    float sum_x2 = 0;
    for (int i = 0; i < 32; ++i) sum_x2 += x[32 * j + i] * x[32 * j + i];
    av_x[j] = sqrtf(sum_x2 / 32);
  }
  for (int i = 0; i < 32; ++i)
    for (int j = 0; j < NL; ++j) wt[i * NL + j] = av_x[j] + fabsf(xt[i * NL + j]);
  make_qkx2_quants_lanes<NL, false>(32, nmax, xt, wt, Lt, scales, mins, rmin, 0.1f, nstep);
  for (int j = 0; j < NL; ++j)
    for (int i = 0; i < 32; ++i) L[32 * j + i] = Lt[i * NL + j];
  for (int b = 0; b < NB; ++b) {
    const float* xb = x + kQK * b;
    uint8_t* yb = y + ts * b;
    uint8_t* Lb = L + kQK * b;
    const float* sb = scales + 8 * b;
    const float* mb = mins + 8 * b;
    uint8_t* sc = yb + 4;
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; ++j) {
      if (sb[j] > max_scale) max_scale = sb[j];
      if (mb[j] > max_min) max_min = mb[j];
    }
    const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
    const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    for (int j = 0; j < 8; ++j) {
      uint8_t ls = (uint8_t)nearest_int(inv_scale * sb[j]);
      uint8_t lm = (uint8_t)nearest_int(inv_min * mb[j]);
      ls = ls < 63 ? ls : 63;
      lm = lm < 63 ? lm : 63;
      if (j < 4) {
        sc[j] = ls;
        sc[j + 4] = lm;
      } else {
        sc[j + 4] = (uint8_t)((ls & 0xF) | ((lm & 0xF) << 4));
        sc[j - 4] = (uint8_t)(sc[j - 4] | ((ls >> 4) << 6));
        sc[j - 0] = (uint8_t)(sc[j - 0] | ((lm >> 4) << 6));
      }
    }
    store_f16(yb, max_scale / 63.f);
    store_f16(yb + 2, max_min / 63.f);
    const float dall = stored_f16(yb), dmin = stored_f16(yb + 2);
    for (int j = 0; j < 8; ++j) {
      uint8_t s, m;
      get_scale_min_k4(j, sc, &s, &m);
      const float d = dall * (float)s;
      if (!(d != 0.f)) continue;
      const float dm = dmin * (float)m;
      for (int ii = 0; ii < 32; ++ii) {
        const int l = nearest_int((xb[32 * j + ii] + dm) / d);
        Lb[32 * j + ii] = (uint8_t)imax(0, imin(nmax, l));
      }
    }
  }
}

// Q4_K (144 B): f16 d | f16 dmin | u8 scales[12] | u8 qs[128]; NB consecutive blocks.
template <int NB>
TALLOW_QBLOCK_FN void quantize_q4_k_n(const float* x, uint8_t* y) {
  uint8_t L[kQK * NB];
  quantize_k4_scales<NB>(x, y, 144, L, 15, -1.f, 20);
  for (int b = 0; b < NB; ++b) {
    uint8_t* q = y + 144 * b + 16;
    const uint8_t* Lb = L + kQK * b;
    for (int j = 0; j < kQK; j += 64, q += 32)
      for (int l = 0; l < 32; ++l) q[l] = (uint8_t)(Lb[j + l] | (Lb[j + l + 32] << 4));
  }
}

// Q5_K (176 B): f16 d | f16 dmin | u8 scales[12] | u8 qh[32] | u8 qs[128]; NB consecutive blocks.
template <int NB>
TALLOW_QBLOCK_FN void quantize_q5_k_n(const float* x, uint8_t* y) {
  uint8_t L[kQK * NB];
  quantize_k4_scales<NB>(x, y, 176, L, 31, -0.5f, 15);
  for (int b = 0; b < NB; ++b) {
    uint8_t* qh = y + 176 * b + 16;
    uint8_t* ql = y + 176 * b + 48;
    const uint8_t* Lb = L + kQK * b;
    for (int j = 0; j < 32; ++j) qh[j] = 0;
    uint8_t m1 = 1, m2 = 2;
    for (int n = 0; n < kQK; n += 64, ql += 32) {
      for (int j = 0; j < 32; ++j) {
        int l1 = Lb[n + j];
        if (l1 > 15) { l1 -= 16; qh[j] = (uint8_t)(qh[j] | m1); }
        int l2 = Lb[n + j + 32];
        if (l2 > 15) { l2 -= 16; qh[j] = (uint8_t)(qh[j] | m2); }
        ql[j] = (uint8_t)(l1 | (l2 << 4));
      }
      m1 = (uint8_t)(m1 << 2);
      m2 = (uint8_t)(m2 << 2);
    }
  }
}

TALLOW_QBLOCK_FN void quantize_q4_k(const float* x, uint8_t* y) { quantize_q4_k_n<1>(x, y); }
TALLOW_QBLOCK_FN void quantize_q5_k(const float* x, uint8_t* y) { quantize_q5_k_n<1>(x, y); }

// Q6_K (210 B): u8 ql[128] | u8 qh[64] | i8 scales[16] | f16 d
TALLOW_QBLOCK_FN void quantize_q6_k(const float* x, uint8_t* y) {
  int8_t L[kQK], Lt[kQK];
  float xt[kQK], scales[16];
  for (int j = 0; j < 16; ++j)  // sub-block j in lane j
    for (int i = 0; i < 16; ++i) xt[i * 16 + j] = x[16 * j + i];
  make_qx_quants_lanes<16>(16, 32, xt, Lt, scales);
  for (int j = 0; j < 16; ++j)
    for (int i = 0; i < 16; ++i) L[16 * j + i] = Lt[i * 16 + j];
  float max_scale = 0, max_abs_scale = 0;
  for (int ib = 0; ib < 16; ++ib) {
    const float scale = scales[ib];
    const float abs_scale = fabsf(scale);
    if (abs_scale > max_abs_scale) { max_abs_scale = abs_scale; max_scale = scale; }
  }
  if (max_abs_scale < kGroupMaxEps) {
    for (int i = 0; i < 210; ++i) y[i] = 0;
    return;
  }
  uint8_t* ql = y;
  uint8_t* qh = y + 128;
  int8_t* sc = reinterpret_cast<int8_t*>(y + 192);
  const float iscale = -128.f / max_scale;
  store_f16(y + 208, 1 / iscale);
  for (int ib = 0; ib < 16; ++ib) sc[ib] = (int8_t)imin(127, nearest_int(iscale * scales[ib]));
  const float dall = stored_f16(y + 208);
  for (int j = 0; j < 16; ++j) {
    const float d = dall * (float)sc[j];
    if (!(d != 0.f)) continue;
    for (int ii = 0; ii < 16; ++ii) {
      const int l = nearest_int(x[16 * j + ii] / d);
      L[16 * j + ii] = (int8_t)(imax(-32, imin(31, l)) + 32);
    }
  }
  for (int j = 0; j < kQK; j += 128, ql += 64, qh += 32) {
    for (int l = 0; l < 32; ++l) {
      const uint8_t q1 = L[j + l + 0] & 0xF, q2 = L[j + l + 32] & 0xF, q3 = L[j + l + 64] & 0xF,
                    q4 = L[j + l + 96] & 0xF;
      ql[l + 0] = (uint8_t)(q1 | (q3 << 4));
      ql[l + 32] = (uint8_t)(q2 | (q4 << 4));
      qh[l] = (uint8_t)((L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) | ((L[j + l + 64] >> 4) << 4) |
                        ((L[j + l + 96] >> 4) << 6));
    }
  }
}

// Q8_K (292 B): f32 d | i8 qs[256] | i16 bsums[16]   (an all-zero block gets zero sums too)
TALLOW_QBLOCK_FN void quantize_q8_k(const float* x, uint8_t* y) {
  float max = 0, amax = 0;
  for (int j = 0; j < kQK; ++j) {
    const float ax = fabsf(x[j]);
    if (ax > amax) { amax = ax; max = x[j]; }
  }
  if (!(amax != 0.f)) {
    for (int i = 0; i < 292; ++i) y[i] = 0;
    return;
  }
  const float iscale = -127.f / max;
  int8_t* qs = reinterpret_cast<int8_t*>(y + 4);
  for (int j = 0; j < kQK; ++j) qs[j] = (int8_t)imin(127, nearest_int(iscale * x[j]));
  for (int j = 0; j < 16; ++j) {
    int sum = 0;
    for (int ii = 0; ii < 16; ++ii) sum += qs[j * 16 + ii];
    y[260 + 2 * j] = (uint8_t)(sum & 0xff);
    y[261 + 2 * j] = (uint8_t)((sum >> 8) & 0xff);
  }
  store_u32(y, float_bits(1 / iscale));
}

// ---- non-linear 4-bit (IQ4_NL, IQ4_XS) ----------------------------------------------------------

TALLOW_QBLOCK_FN int iq4_value(int i) {
  const int8_t kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
  return kvalues_iq4nl[i];
}

// ggml's best_index_int8 over the IQ4 table (as in the llama.cpp that llama-cpp-python 0.3.36 vendors):
// the nearest level, a tie going to the upper one.
TALLOW_QBLOCK_FN int iq4_best_index(float x) {
  if (x <= (float)iq4_value(0)) return 0;
  if (x >= (float)iq4_value(15)) return 15;
  int ml = 0, mu = 15;
  while (mu - ml > 1) {
    const int mav = (ml + mu) / 2;
    if (x < (float)iq4_value(mav)) mu = mav;
    else ml = mav;
  }
  return x - (float)iq4_value(mu - 1) < (float)iq4_value(mu) - x ? mu - 1 : mu;
}

// llama.cpp's quantize_row_iq4_nl_impl as ggml_quantize_chunk runs it (ntry 7, no importance matrix) for
// kSuper = 32 (IQ4_NL: f16 d | u8 qs[16]) or 256 (IQ4_XS: f16 d | u16 scales_h | u8 scales_l[4] | u8 qs[128]).
template <int kSuper>
TALLOW_QBLOCK_FN void quantize_iq4(const float* x, uint8_t* y) {
  constexpr int nsub = kSuper / 32, ntry = 7;
  uint8_t* q4 = y + (nsub > 1 ? 8 : 2);
  uint8_t L[kSuper];
  float scales[nsub], weight[32];
  for (int j = 0; j < kSuper / 2; ++j) q4[j] = 0;
  float max_scale = 0, amax_scale = 0;
  for (int ib = 0; ib < nsub; ++ib) {
    const float* xb = x + ib * 32;
    for (int j = 0; j < 32; ++j) weight[j] = xb[j] * xb[j];
    float amax = 0, max = 0;
    for (int j = 0; j < 32; ++j) {
      const float ax = fabsf(xb[j]);
      if (ax > amax) { amax = ax; max = xb[j]; }
    }
    if (amax < kGroupMaxEps) {
      scales[ib] = 0;
      continue;
    }
    float d = -max / (float)iq4_value(0);
    float id = 1 / d;
    float sumqx = 0, sumq2 = 0;
    for (int j = 0; j < 32; ++j) {
      const float q = (float)iq4_value(iq4_best_index(id * xb[j]));
      sumqx += weight[j] * q * xb[j];
      sumq2 += weight[j] * q * q;
    }
    d = sumq2 > 0 ? sumqx / sumq2 : 0.f;
    float best = d * sumqx;
    for (int itry = -ntry; itry <= ntry; ++itry) {
      id = (float)(itry + iq4_value(0)) / max;
      sumqx = sumq2 = 0;
      for (int j = 0; j < 32; ++j) {
        const float q = (float)iq4_value(iq4_best_index(id * xb[j]));
        sumqx += weight[j] * q * xb[j];
        sumq2 += weight[j] * q * q;
      }
      if (sumq2 > 0 && sumqx * sumqx > best * sumq2) {
        d = sumqx / sumq2;
        best = d * sumqx;
      }
    }
    scales[ib] = d;
    const float abs_d = fabsf(d);
    if (abs_d > amax_scale) { amax_scale = abs_d; max_scale = d; }
  }
  if (nsub > 1) {
    uint16_t scales_h = 0;
    uint8_t* scales_l = y + 4;
    const float d = -max_scale / 32;
    store_f16(y, d);
    const float id = d != 0.f ? 1 / d : 0.f;
    for (int ib = 0; ib < nsub; ++ib) {
      int l = nearest_int(id * scales[ib]);
      l = imax(-32, imin(31, l));
      const float dl = d * (float)l;
      const float idl = dl != 0.f ? 1 / dl : 0.f;
      for (int j = 0; j < 32; ++j) L[ib * 32 + j] = (uint8_t)iq4_best_index(idl * x[ib * 32 + j]);
      l += 32;
      const uint8_t l_l = (uint8_t)(l & 0xf), l_h = (uint8_t)(l >> 4);
      if (ib % 2 == 0) scales_l[ib / 2] = l_l;
      else scales_l[ib / 2] = (uint8_t)(scales_l[ib / 2] | (l_l << 4));
      scales_h = (uint16_t)(scales_h | (l_h << (2 * (ib % 8))));
    }
    y[2] = (uint8_t)(scales_h & 0xff);
    y[3] = (uint8_t)(scales_h >> 8);
  } else {
    store_f16(y, scales[0]);
    const float id = scales[0] != 0.f ? 1 / scales[0] : 0.f;
    for (int j = 0; j < kSuper; ++j) L[j] = (uint8_t)iq4_best_index(id * x[j]);
  }
  for (int i = 0; i < kSuper / 32; ++i)
    for (int j = 0; j < 16; ++j) q4[16 * i + j] = (uint8_t)(L[32 * i + j] | (L[32 * i + 16 + j] << 4));
}

// Whether quantize_block<T> exists.
constexpr bool has_quantizer(DType t) {
  return t == DType::Q4_0 || t == DType::Q4_1 || t == DType::Q5_0 || t == DType::Q5_1 || t == DType::Q8_0 ||
         t == DType::Q8_1 || t == DType::Q2_K || t == DType::Q3_K || t == DType::Q4_K || t == DType::Q5_K ||
         t == DType::Q6_K || t == DType::Q8_K || t == DType::IQ4_NL || t == DType::IQ4_XS;
}

// Elements and bytes of one block (core/dtype.h).
using ::tallow::block_bytes;
using ::tallow::block_elems;

// One block of T from its block_elems(T) floats.
template <DType T>
TALLOW_QBLOCK_FN void quantize_block(const float* x, uint8_t* y) {
  if constexpr (T == DType::Q4_0) quantize_q4_0(x, y);
  else if constexpr (T == DType::Q4_1) quantize_q4_1(x, y);
  else if constexpr (T == DType::Q5_0) quantize_q5_0(x, y);
  else if constexpr (T == DType::Q5_1) quantize_q5_1(x, y);
  else if constexpr (T == DType::Q8_0) quantize_q8_0(x, y);
  else if constexpr (T == DType::Q8_1) quantize_q8_1(x, y);
  else if constexpr (T == DType::Q2_K) quantize_q2_k(x, y);
  else if constexpr (T == DType::Q3_K) quantize_q3_k(x, y);
  else if constexpr (T == DType::Q4_K) quantize_q4_k(x, y);
  else if constexpr (T == DType::Q5_K) quantize_q5_k(x, y);
  else if constexpr (T == DType::Q6_K) quantize_q6_k(x, y);
  else if constexpr (T == DType::Q8_K) quantize_q8_k(x, y);
  else if constexpr (T == DType::IQ4_NL) quantize_iq4<32>(x, y);
  else if constexpr (T == DType::IQ4_XS) quantize_iq4<256>(x, y);
  else static_assert(T == DType::Q4_0, "quantize_block: no quantizer for this dtype");
}

// Blocks quantized together by quantize_blocks_n (the CPU's unit of work): 4 for q4_k / q5_k, whose
// sub-block search is latency-bound at 8 lanes; 1 for the rest.
constexpr int block_group(DType t) { return (t == DType::Q4_K || t == DType::Q5_K) ? 4 : 1; }

// block_group(T) consecutive blocks of T: x holds their floats back to back, y their bytes.
template <DType T>
TALLOW_QBLOCK_FN void quantize_blocks_n(const float* x, uint8_t* y) {
  if constexpr (T == DType::Q4_K) quantize_q4_k_n<block_group(T)>(x, y);
  else if constexpr (T == DType::Q5_K) quantize_q5_k_n<block_group(T)>(x, y);
  else quantize_block<T>(x, y);
}

}  // namespace tallow::quant_block

// X(T) for every dtype with a quantizer (the ops' dispatch switches).
#define TALLOW_FOR_EACH_QUANTIZE_DTYPE(X) \
  X(Q4_0) X(Q4_1) X(Q5_0) X(Q5_1) X(Q8_0) X(Q8_1) X(Q2_K) X(Q3_K) X(Q4_K) X(Q5_K) X(Q6_K) X(Q8_K) X(IQ4_NL) X(IQ4_XS)
