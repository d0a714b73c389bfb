// Softmax over the last dimension: the per-element transform z = x * scale (or soft-capped), with
// -inf kept as a masked entry (cpp/ops/softmax.cpp's semantics).
#pragma once
#include "common.cuh"

namespace tallow::cuda {

__device__ __forceinline__ float softmax_z(float x, float scale, float softcap) {
  if (x == -INFINITY) return -INFINITY;
  return softcap > 0.f ? softcap * tanhf(x * (scale / softcap)) : x * scale;
}

}  // namespace tallow::cuda
