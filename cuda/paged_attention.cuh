// Paged KV cache (vLLM layout) on CUDA: index views over i32/i64 tensors, one layer's cache, the
// FP8 E4M3 storage tag of fp8 caches (conversions bit-exact with cpp/core/half.h), and cache_value:
// how the kernels that write caches (reshape_and_cache, rope_and_cache) encode an element.
#pragma once
#include <cstdint>
#include <type_traits>

#include "cast.cuh"
#include "common.cuh"

namespace tallow::cuda {

struct IndexArg {
  const void* data;
  bool i32;
  int64_t s0, s1;
  __device__ __forceinline__ int64_t operator()(int64_t i, int64_t j = 0) const {
    const int64_t o = i * s0 + j * s1;
    return i32 ? (int64_t) static_cast<const int32_t*>(data)[o] : static_cast<const int64_t*>(data)[o];
  }
};

struct CacheArg {
  const void* base;
  int64_t sb, sr, sh;  // element strides of block, row, head; head vectors contiguous
};

// One float8_e4m3 ("fn": saturating, no infinities) cache element.
struct F8E4M3 {
  uint8_t bits;
};
__device__ __forceinline__ float to_float(F8E4M3 v) { return f8e4m3_to_float(v.bits); }
template <>
__device__ __forceinline__ F8E4M3 from_float<F8E4M3>(float v) {
  return F8E4M3{float_to_f8e4m3(v)};
}

// Sign bit and NaN-ness of a source element, from its bits (a GPU division turns any NaN into the
// canonical positive one, so the sign must be taken before dividing).
__device__ __forceinline__ bool nan_bits(float x, uint32_t& sign) {
  const uint32_t u = __float_as_uint(x);
  sign = u >> 31;
  return (u & 0x7fffffffu) > 0x7f800000u;
}
__device__ __forceinline__ bool nan_bits(__half x, uint32_t& sign) {
  const uint32_t u = __half_as_ushort(x);
  sign = u >> 15;
  return (u & 0x7fffu) > 0x7c00u;
}
__device__ __forceinline__ bool nan_bits(__nv_bfloat16 x, uint32_t& sign) {
  const uint32_t u = __bfloat16_as_ushort(x);
  sign = u >> 15;
  return (u & 0x7fffu) > 0x7f80u;
}

// The cache's value of x: fp8 caches hold x / scale (one f32 division, then e4m3 rounding); a NaN
// keeps its sign (0x7f | sign), as on the CPU.
template <class C, class S>
__device__ __forceinline__ C cache_value(S x, float scale) {
  if constexpr (std::is_same_v<C, F8E4M3>) {
    uint32_t sign;
    if (nan_bits(x, sign)) return F8E4M3{(uint8_t)(0x7fu | (sign << 7))};
    return from_float<C>(to_float(x) / scale);
  } else {
    return from_float<C>(to_float(x));
  }
}

}  // namespace tallow::cuda
