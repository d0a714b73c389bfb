// GGUF block dequantization, one element at a time: element j of the block at `x`, with exactly the
// operations (and their order) of cpp/ops/dequant.cpp, so results are bit-exact with the CPU and ggml.
// Multi-byte fields are read byte by byte (blocks of 18, 22, ... bytes are not aligned).
#pragma once
#include "common.cuh"
#include "core/dtype.h"

namespace tallow::cuda::deq {

// Block geometry at compile time (core/dtype.h).
using ::tallow::block_bytes;
using ::tallow::block_elems;

__device__ __forceinline__ float f16_at(const uint8_t* p) {
  return __half2float(__ushort_as_half((unsigned short)(p[0] | (p[1] << 8))));
}
__device__ __forceinline__ uint32_t u32_at(const uint8_t* p) {
  return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
__device__ __forceinline__ float f32_at(const uint8_t* p) { return __uint_as_float(u32_at(p)); }

__device__ __forceinline__ void scale_min_k4(const uint8_t* q, int j, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

template <DType kT> __device__ __forceinline__ float element(const uint8_t* x, int j);

template <> __device__ __forceinline__ float element<DType::Q4_0>(const uint8_t* x, int j) {
  const float d = f16_at(x);
  const uint8_t b = x[2 + (j & 15)];
  const int q = j < 16 ? (b & 0x0F) : (b >> 4);
  return (float)(q - 8) * d;
}
template <> __device__ __forceinline__ float element<DType::Q4_1>(const uint8_t* x, int j) {
  const float d = f16_at(x), m = f16_at(x + 2);
  const uint8_t b = x[4 + (j & 15)];
  const int q = j < 16 ? (b & 0x0F) : (b >> 4);
  return (float)q * d + m;
}
template <> __device__ __forceinline__ float element<DType::Q5_0>(const uint8_t* x, int j) {
  const float d = f16_at(x);
  const uint32_t qh = u32_at(x + 2);
  const int l = j & 15;
  const uint8_t b = x[6 + l];
  const int q = j < 16 ? ((b & 0x0F) | ((int)((qh >> l) << 4) & 0x10)) : ((b >> 4) | ((int)(qh >> (l + 12)) & 0x10));
  return (float)(q - 16) * d;
}
template <> __device__ __forceinline__ float element<DType::Q5_1>(const uint8_t* x, int j) {
  const float d = f16_at(x), m = f16_at(x + 2);
  const uint32_t qh = u32_at(x + 4);
  const int l = j & 15;
  const uint8_t b = x[8 + l];
  const int q = j < 16 ? ((b & 0x0F) | ((int)((qh >> l) << 4) & 0x10)) : ((b >> 4) | ((int)(qh >> (l + 12)) & 0x10));
  return (float)q * d + m;
}
template <> __device__ __forceinline__ float element<DType::Q8_0>(const uint8_t* x, int j) {
  return (float)(int8_t)x[2 + j] * f16_at(x);
}
template <> __device__ __forceinline__ float element<DType::Q8_1>(const uint8_t* x, int j) {
  return (float)(int8_t)x[4 + j] * f16_at(x);
}
template <> __device__ __forceinline__ float element<DType::Q2_K>(const uint8_t* x, int j) {
  const int h = j >> 7, r = j & 127, s = r >> 5, k = (r >> 4) & 1, l = r & 15;
  const float d = f16_at(x + 80), dmin = f16_at(x + 82);
  const uint8_t scb = x[8 * h + 2 * s + k];
  const float dl = d * (float)(scb & 0x0F), ml = dmin * (float)(scb >> 4);
  const int q = (x[16 + 32 * h + 16 * k + l] >> (2 * s)) & 3;
  return dl * (float)q - ml;
}
template <> __device__ __forceinline__ float element<DType::Q3_K>(const uint8_t* x, int j) {
  const int h = j >> 7, r = j & 127, s = r >> 5, k = (r >> 4) & 1, l = r & 15;
  const uint8_t* sb = x + 96;
  const float d_all = f16_at(x + 108);
  const int i = 8 * h + 2 * s + k;
  const int lo = (i < 8 ? sb[i] : sb[i - 8] >> 4) & 0x0F;
  const int hi = (sb[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
  const int sc = (lo | (hi << 4)) - 32;
  const int bit = 4 * h + s;
  const int v = (int)((x[32 + 32 * h + 16 * k + l] >> (2 * s)) & 3) - (((x[16 * k + l] >> bit) & 1) ? 0 : 4);
  const float dl = d_all * (float)sc;
  return dl * (float)v;
}
template <> __device__ __forceinline__ float element<DType::Q4_K>(const uint8_t* x, int j) {
  const float d = f16_at(x), dmin = f16_at(x + 2);
  const int g = j >> 6, r = j & 63, hi = r >> 5, l = r & 31;
  int sc, m;
  scale_min_k4(x + 4, 2 * g + hi, sc, m);
  const float d1 = d * (float)sc, dm1 = dmin * (float)m;
  const uint8_t b = x[16 + 32 * g + l];
  const int q = hi ? (b >> 4) : (b & 0x0F);
  return d1 * (float)q - dm1;
}
template <> __device__ __forceinline__ float element<DType::Q5_K>(const uint8_t* x, int j) {
  const float d = f16_at(x), dmin = f16_at(x + 2);
  const int g = j >> 6, r = j & 63, hi = r >> 5, l = r & 31;
  int sc, m;
  scale_min_k4(x + 4, 2 * g + hi, sc, m);
  const float d1 = d * (float)sc, dm1 = dmin * (float)m;
  const uint8_t b = x[48 + 32 * g + l];
  const int v = (hi ? (b >> 4) : (b & 0x0F)) | (((x[16 + l] >> (2 * g + hi)) & 1) << 4);
  return d1 * (float)v - dm1;
}
template <> __device__ __forceinline__ float element<DType::Q6_K>(const uint8_t* x, int j) {
  const float d = f16_at(x + 208);
  const int h = j >> 7, r = j & 127, qd = r >> 5, l = r & 31, k = l >> 4;
  const uint8_t* ql = x + 64 * h;
  const uint8_t* qh = x + 128 + 32 * h;
  const int8_t scv = (int8_t)x[192 + 8 * h + k + 2 * qd];
  int q;
  switch (qd) {
    case 0: q = (ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4); break;
    case 1: q = (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4); break;
    case 2: q = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4); break;
    default: q = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4); break;
  }
  const float s = d * (float)scv;
  return s * (float)(q - 32);
}
template <> __device__ __forceinline__ float element<DType::Q8_K>(const uint8_t* x, int j) {
  return (float)(int8_t)x[4 + j] * f32_at(x);
}

// ggml's kvalues_iq4nl {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113} as
// four little-endian words of int8 (entries 4w .. 4w+3 in word w): no table in device memory.
constexpr uint32_t kIq4nlWord0 = 0xBFAD9881u, kIq4nlWord1 = 0xF6EADDCFu, kIq4nlWord2 = 0x26190D01u,
                   kIq4nlWord3 = 0x71594535u;
__device__ __forceinline__ int iq4nl_value(int q) {
  const uint32_t w = q < 8 ? (q < 4 ? kIq4nlWord0 : kIq4nlWord1) : (q < 12 ? kIq4nlWord2 : kIq4nlWord3);
  return (int)(int8_t)(uint8_t)(w >> (8 * (q & 3)));
}
// IQ4_NL (18 B / 32): f16 d | u8 qs[16]; y = d * kvalues[nibble] (low nibbles: elements 0-15).
template <> __device__ __forceinline__ float element<DType::IQ4_NL>(const uint8_t* x, int j) {
  const float d = f16_at(x);
  const uint8_t b = x[2 + (j & 15)];
  return d * (float)iq4nl_value(j < 16 ? (b & 0x0F) : (b >> 4));
}
// IQ4_XS (136 B / 256): f16 d | u16 scales_h | u8 scales_l[4] | u8 qs[128]; sub-block ib of 32 has the
// 6-bit scale ls (low 4 bits in scales_l, high 2 in scales_h) and y = (d * (ls - 32)) * kvalues[nibble].
template <> __device__ __forceinline__ float element<DType::IQ4_XS>(const uint8_t* x, int j) {
  const float d = f16_at(x);
  const int ib = j >> 5, l = j & 31;
  const int scales_h = x[2] | (x[3] << 8);
  const int ls = ((x[4 + (ib >> 1)] >> (4 * (ib & 1))) & 0x0F) | (((scales_h >> (2 * ib)) & 3) << 4);
  const float dl = d * (float)(ls - 32);
  const uint8_t b = x[8 + 16 * ib + (l & 15)];
  return dl * (float)iq4nl_value(l < 16 ? (b & 0x0F) : (b >> 4));
}

}  // namespace tallow::cuda::deq

// X(Q4_0) X(Q4_1) ... for every GGUF block dtype.
#define TALLOW_FOR_EACH_BLOCK_DTYPE(X) \
  X(Q4_0) X(Q4_1) X(Q5_0) X(Q5_1) X(Q8_0) X(Q8_1) X(Q2_K) X(Q3_K) X(Q4_K) X(Q5_K) X(Q6_K) X(Q8_K) X(IQ4_NL) X(IQ4_XS)

namespace tallow::cuda {
// Rows of a block-dtype matrix (row r's first block at base + r * row_bytes, K elements a row) into a
// contiguous [rows, K] out of out_dtype (f32/f16/bf16, 16-byte aligned): one thread per 16-byte pack of
// outputs (contiguous stores across a warp), values bit-exact with deq::element. Asynchronous on `stream`; no allocation.
void dequantize_rows(DType wt, const uint8_t* base, int64_t rows, int64_t K, int64_t row_bytes, DType out_dtype,
                     void* out, cudaStream_t stream);
}  // namespace tallow::cuda
