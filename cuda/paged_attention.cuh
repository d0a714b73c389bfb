// Paged KV cache (vLLM layout) on CUDA: index views over i32/i64 tensors and one layer's cache.
#pragma once
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

}  // namespace tallow::cuda
