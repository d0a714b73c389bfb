// Total order used by argmax/topk (as cpp/ops/topk.cpp): NaN above every number, +0 == -0, equal
// values rank by lower index. A 64-bit key, larger = ranks first: order-preserving bits of the
// value in the high half, the complemented index in the low half.
#pragma once
#include "common.cuh"

namespace tallow::cuda {

__device__ __forceinline__ uint64_t rank_key(float v, int64_t idx) {
  uint32_t u;
  if (v != v) {
    u = 0xffffffffu;
  } else {
    if (v == 0.f) v = 0.f;  // -0 -> +0
    const uint32_t b = __float_as_uint(v);
    u = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  }
  return ((uint64_t)u << 32) | (uint64_t)(0xffffffffu - (uint32_t)idx);
}

__device__ __forceinline__ int64_t key_index(uint64_t k) { return (int64_t)(0xffffffffu - (uint32_t)(k & 0xffffffffu)); }

}  // namespace tallow::cuda
