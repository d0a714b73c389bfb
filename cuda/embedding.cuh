// Embedding lookup helpers: id loading from i32/i64 index tensors.
#pragma once
#include "common.cuh"

namespace tallow::cuda {

__device__ __forceinline__ int64_t load_id(const void* ids, bool i32, int64_t i) {
  return i32 ? (int64_t) static_cast<const int32_t*>(ids)[i] : static_cast<const int64_t*>(ids)[i];
}

}  // namespace tallow::cuda
