// Device side of the counter-based random fill (cpp/ops/random.h holds the shared arithmetic): the
// value of element i depends only on (key, i), so any thread may produce any element.
#pragma once
#include "common.cuh"
#include "ops/random.h"

namespace tallow::cuda {

// Element i of a uniform fill, rounded to T (nearest even, as from_f32 on the CPU).
template <class T>
__device__ __forceinline__ T random_uniform(uint64_t key, uint64_t i, float low, float span) {
  namespace rd = ::tallow::ops::random_detail;
  return from_float<T>(rd::affine(rd::bits24(key, i), low, span));
}

}  // namespace tallow::cuda
