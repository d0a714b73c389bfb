// Elementwise binary ops (add, mul) with broadcasting, and scale: device functors.
#pragma once
#include "common.cuh"

namespace tallow::cuda {

struct AddOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};
struct MulOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a * b; }
};

}  // namespace tallow::cuda
