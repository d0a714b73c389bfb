// Paged KV cache (vLLM layout) on CUDA: index views over i32/i64 tensors, one layer's cache, and the
// FP8 E4M3 storage tag of fp8 caches (conversions bit-exact with cpp/core/half.h).
#pragma once
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

}  // namespace tallow::cuda
