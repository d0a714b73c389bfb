// Integer dot products of GGUF weight blocks with q8 activations (quant_linear.cu's decode kernel, in
// the manner of llama.cpp's vecdotq.cuh). The unit of work is 32 consecutive weights of a row, one q8
// activation block: decode<T>(block, sub) unpacks sub-block `sub` of a weight block into 8 words of 4
// int8 each (weights in element order, so word i meets activation word i in a __dp4a) and its scales:
//   w[j] = sc[h] * v[j] + mn[h]   (h = j / 16: two 16-weight halves; most types have one scale for both)
// and dot() returns sum_j w[j] * (d_x * q_x[j]) from the activation block's d_x and s_x = d_x * sum q_x.
// The integer part is exact; the result is the f32 product of the dequantized weights with the
// quantized activations up to f32 rounding of a few scale products.
// Loads: blocks whose size is a multiple of 4 are read as 32-bit words (16-byte vectors where the
// layout is 16-byte aligned: Q4_K, Q5_K), the others (Q4_0, Q5_0, Q8_0, IQ4_NL: 18/22/34 B; Q3_K 110 B,
// Q6_K 210 B) as 16-bit halves, since their blocks are only 2-byte aligned.
#pragma once
#include "common.cuh"
#include "core/dtype.h"
#include "dequant.cuh"

namespace tallow::cuda::qdot {

struct Unit {
  int v[8];     // 32 weights as int8 x 4 per word (unsigned nibbles or signed values, all in [-128, 127])
  float sc[2];  // scale of each 16-weight half (equal for one-scale types)
  float mn[2];  // offset of each half (0 for symmetric types)
};

__device__ __forceinline__ float ldh(const uint8_t* p) { return __half2float(*reinterpret_cast<const __half*>(p)); }
__device__ __forceinline__ uint32_t ld32(const uint8_t* p) { return *reinterpret_cast<const uint32_t*>(p); }
__device__ __forceinline__ uint32_t ld16x2(const uint8_t* p) {  // 2-byte aligned word
  const uint16_t* q = reinterpret_cast<const uint16_t*>(p);
  return (uint32_t)q[0] | ((uint32_t)q[1] << 16);
}
__device__ __forceinline__ void ld16x8(const uint8_t* p, uint32_t (&w)[8]) {  // 32 bytes, 16-byte aligned
  const uint4 a = *reinterpret_cast<const uint4*>(p), b = *reinterpret_cast<const uint4*>(p + 16);
  w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w, w[4] = b.x, w[5] = b.y, w[6] = b.z, w[7] = b.w;
}

// Bit k (0..3) of h into bit 8k + 4 (the high bit of a 5-bit value in byte k).
__device__ __forceinline__ uint32_t spread4_to_bit4(uint32_t h) {
  return ((h & 1u) << 4) | ((h & 2u) << 11) | ((h & 4u) << 18) | ((h & 8u) << 25);
}

// Four 4-bit indices (one per byte, 0..15) -> the four int8 kvalues_iq4nl entries.
__device__ __forceinline__ int iq4nl_lookup4(uint32_t idx) {
  const uint32_t s = (idx & 0xFu) | ((idx >> 4) & 0xF0u) | ((idx >> 8) & 0xF00u) | ((idx >> 12) & 0xF000u);
  // Selector nibbles kept below 8: prmt's bit 3 would replicate the sign instead of selecting.
  const uint32_t lo = __byte_perm(deq::kIq4nlWord0, deq::kIq4nlWord1, s & 0x7777u);
  const uint32_t hi = __byte_perm(deq::kIq4nlWord2, deq::kIq4nlWord3, s & 0x7777u);
  return (int)__byte_perm(lo, hi, 0x3210u | ((s & 0x8888u) >> 1));
}

template <DType kT> __device__ __forceinline__ Unit decode(const uint8_t* x, int sub);

// Low nibbles of 16 bytes are weights 0-15, high nibbles 16-31 (Q4_0, Q4_1, IQ4_NL, IQ4_XS).
__device__ __forceinline__ void nibbles(const uint32_t (&q)[4], Unit& u) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    u.v[i] = (int)(q[i] & 0x0F0F0F0Fu);
    u.v[4 + i] = (int)((q[i] >> 4) & 0x0F0F0F0Fu);
  }
}
__device__ __forceinline__ void one_scale(Unit& u, float sc, float mn) {
  u.sc[0] = u.sc[1] = sc;
  u.mn[0] = u.mn[1] = mn;
}

template <> __device__ __forceinline__ Unit decode<DType::Q4_0>(const uint8_t* x, int) {
  Unit u;
  uint32_t q[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) q[i] = ld16x2(x + 2 + 4 * i);
  nibbles(q, u);
  const float d = ldh(x);
  one_scale(u, d, -8.f * d);
  return u;
}
template <> __device__ __forceinline__ Unit decode<DType::Q4_1>(const uint8_t* x, int) {
  Unit u;
  uint32_t q[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) q[i] = ld32(x + 4 + 4 * i);
  nibbles(q, u);
  one_scale(u, ldh(x), ldh(x + 2));
  return u;
}
// Q5_0 / Q5_1: bit j of qh is weight j's fifth bit.
__device__ __forceinline__ void five_bit(const uint32_t (&q)[4], uint32_t qh, Unit& u) {
  nibbles(q, u);
#pragma unroll
  for (int w = 0; w < 8; ++w) u.v[w] |= (int)spread4_to_bit4((qh >> (4 * w)) & 0xFu);
}
template <> __device__ __forceinline__ Unit decode<DType::Q5_0>(const uint8_t* x, int) {
  Unit u;
  uint32_t q[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) q[i] = ld16x2(x + 6 + 4 * i);
  five_bit(q, ld16x2(x + 2), u);
  const float d = ldh(x);
  one_scale(u, d, -16.f * d);
  return u;
}
template <> __device__ __forceinline__ Unit decode<DType::Q5_1>(const uint8_t* x, int) {
  Unit u;
  uint32_t q[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) q[i] = ld32(x + 8 + 4 * i);
  five_bit(q, ld32(x + 4), u);
  one_scale(u, ldh(x), ldh(x + 2));
  return u;
}
template <> __device__ __forceinline__ Unit decode<DType::Q8_0>(const uint8_t* x, int) {
  Unit u;
#pragma unroll
  for (int i = 0; i < 8; ++i) u.v[i] = (int)ld16x2(x + 2 + 4 * i);
  one_scale(u, ldh(x), 0.f);
  return u;
}
template <> __device__ __forceinline__ Unit decode<DType::Q8_1>(const uint8_t* x, int) {
  Unit u;
#pragma unroll
  for (int i = 0; i < 8; ++i) u.v[i] = (int)ld32(x + 4 + 4 * i);
  one_scale(u, ldh(x), 0.f);
  return u;
}
template <> __device__ __forceinline__ Unit decode<DType::IQ4_NL>(const uint8_t* x, int) {
  Unit u;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t q = ld16x2(x + 2 + 4 * i);
    u.v[i] = iq4nl_lookup4(q & 0x0F0F0F0Fu);
    u.v[4 + i] = iq4nl_lookup4((q >> 4) & 0x0F0F0F0Fu);
  }
  one_scale(u, ldh(x), 0.f);
  return u;
}
template <> __device__ __forceinline__ Unit decode<DType::IQ4_XS>(const uint8_t* x, int sub) {
  Unit u;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t q = ld32(x + 8 + 16 * sub + 4 * i);
    u.v[i] = iq4nl_lookup4(q & 0x0F0F0F0Fu);
    u.v[4 + i] = iq4nl_lookup4((q >> 4) & 0x0F0F0F0Fu);
  }
  const int scales_h = x[2] | (x[3] << 8);
  const int ls = ((x[4 + (sub >> 1)] >> (4 * (sub & 1))) & 0x0F) | (((scales_h >> (2 * sub)) & 3) << 4);
  one_scale(u, ldh(x) * (float)(ls - 32), 0.f);
  return u;
}
// Q2_K: sub = 4 h + s: 2-bit fields at shift 2 s of qs[32 h .. 32 h + 32); half k has scale byte
// scales[8 h + 2 s + k] (low 4 bits x d, high 4 bits x dmin as the offset).
template <> __device__ __forceinline__ Unit decode<DType::Q2_K>(const uint8_t* x, int sub) {
  Unit u;
  const int h = sub >> 2, s = sub & 3;
#pragma unroll
  for (int i = 0; i < 8; ++i) u.v[i] = (int)((ld32(x + 16 + 32 * h + 4 * i) >> (2 * s)) & 0x03030303u);
  const float d = ldh(x + 80), dmin = ldh(x + 82);
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int scb = x[8 * h + 2 * s + k];
    u.sc[k] = d * (float)(scb & 0x0F);
    u.mn[k] = -(dmin * (float)(scb >> 4));
  }
  return u;
}
// Q3_K: sub = 4 h + s: 2 low bits at shift 2 s of qs[32 h ..], the third bit in hmask[0..32) at bit
// 4 h + s (set: +0, clear: -4); half k has the 6-bit scale i = 8 h + 2 s + k, minus 32, times d.
template <> __device__ __forceinline__ Unit decode<DType::Q3_K>(const uint8_t* x, int sub) {
  Unit u;
  const int h = sub >> 2, s = sub & 3;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t lo = (ld16x2(x + 32 + 32 * h + 4 * i) >> (2 * s)) & 0x03030303u;
    const uint32_t hb = (ld16x2(x + 4 * i) >> (4 * h + s)) & 0x01010101u;
    u.v[i] = (int)__vsub4(lo | (hb << 2), 0x04040404u);
  }
  const uint8_t* sb = x + 96;
  const float d = ldh(x + 108);
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int i = 8 * h + 2 * s + k;
    const int lo = (i < 8 ? sb[i] : sb[i - 8] >> 4) & 0x0F;
    const int hi = (sb[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
    u.sc[k] = d * (float)((lo | (hi << 4)) - 32);
    u.mn[k] = 0.f;
  }
  return u;
}
// Q4_K / Q5_K: sub = 2 g + hi: nibble hi of qs[32 g .. 32 g + 32); 6-bit scale and min from
// scale_min_k4(sub); Q5_K's fifth bit is bit `sub` of qh[0..32).
template <> __device__ __forceinline__ Unit decode<DType::Q4_K>(const uint8_t* x, int sub) {
  Unit u;
  uint32_t q[8];
  ld16x8(x + 16 + 32 * (sub >> 1), q);
  const int shift = 4 * (sub & 1);
#pragma unroll
  for (int i = 0; i < 8; ++i) u.v[i] = (int)((q[i] >> shift) & 0x0F0F0F0Fu);
  int sc, m;
  deq::scale_min_k4(x + 4, sub, sc, m);
  one_scale(u, ldh(x) * (float)sc, -(ldh(x + 2) * (float)m));
  return u;
}
template <> __device__ __forceinline__ Unit decode<DType::Q5_K>(const uint8_t* x, int sub) {
  Unit u;
  uint32_t q[8], qh[8];
  ld16x8(x + 48 + 32 * (sub >> 1), q);
  ld16x8(x + 16, qh);
  const int shift = 4 * (sub & 1);
#pragma unroll
  for (int i = 0; i < 8; ++i) u.v[i] = (int)(((q[i] >> shift) & 0x0F0F0F0Fu) | (((qh[i] >> sub) & 0x01010101u) << 4));
  int sc, m;
  deq::scale_min_k4(x + 4, sub, sc, m);
  one_scale(u, ldh(x) * (float)sc, -(ldh(x + 2) * (float)m));
  return u;
}
// Q6_K: sub = 4 h + qd: low 4 bits = nibble (qd >> 1) of ql[64 h + 32 (qd & 1) ..], high 2 bits at
// shift 2 qd of qh[32 h ..], value - 32; half k has the int8 scale scales[8 h + 2 qd + k] times d.
template <> __device__ __forceinline__ Unit decode<DType::Q6_K>(const uint8_t* x, int sub) {
  Unit u;
  const int h = sub >> 2, qd = sub & 3;
  const uint8_t* ql = x + 64 * h + 32 * (qd & 1);
  const uint8_t* qh = x + 128 + 32 * h;
  const int lshift = 4 * (qd >> 1), hshift = 2 * qd;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t lo = (ld16x2(ql + 4 * i) >> lshift) & 0x0F0F0F0Fu;
    const uint32_t hi = (ld16x2(qh + 4 * i) >> hshift) & 0x03030303u;
    u.v[i] = (int)__vsub4(lo | (hi << 4), 0x20202020u);
  }
  const float d = ldh(x + 208);
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    u.sc[k] = d * (float)(int8_t)x[192 + 8 * h + 2 * qd + k];
    u.mn[k] = 0.f;
  }
  return u;
}
template <> __device__ __forceinline__ Unit decode<DType::Q8_K>(const uint8_t* x, int sub) {
  Unit u;
#pragma unroll
  for (int i = 0; i < 8; ++i) u.v[i] = (int)ld32(x + 4 + 32 * sub + 4 * i);
  one_scale(u, __uint_as_float(ld32(x)), 0.f);
  return u;
}

// Types whose halves have their own scale (and, for Q2_K, their own offset).
template <DType kT> constexpr bool kTwoScales = kT == DType::Q2_K || kT == DType::Q3_K || kT == DType::Q6_K;
template <DType kT> constexpr bool kHalfOffsets = kT == DType::Q2_K;

// sum_j w[j] * d_x * q_x[j] for one unit and one activation block (xv: its 32 int8; xd = (d_x, d_x * sum q_x)).
template <DType kT>
__device__ __forceinline__ float dot(const Unit& u, const int (&xv)[8], float2 xd) {
  int s0 = 0, s1 = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    s0 = __dp4a(u.v[i], xv[i], s0);
    s1 = __dp4a(u.v[4 + i], xv[4 + i], s1);
  }
  if constexpr (!kTwoScales<kT>) {
    return xd.x * (u.sc[0] * (float)(s0 + s1)) + u.mn[0] * xd.y;
  } else {
    float r = u.sc[0] * (float)s0 + u.sc[1] * (float)s1;
    if constexpr (kHalfOffsets<kT>) {
      int x0 = 0, x1 = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        x0 = __dp4a(0x01010101, xv[i], x0);
        x1 = __dp4a(0x01010101, xv[4 + i], x1);
      }
      r += u.mn[0] * (float)x0 + u.mn[1] * (float)x1;
    }
    return xd.x * r;
  }
}

}  // namespace tallow::cuda::qdot
