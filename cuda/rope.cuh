// Rotary embedding: the rotation of one pair, f32 math, one rounding (as cpp/ops/rope.cpp).
#pragma once
#include "common.cuh"

namespace tallow::cuda {

template <class T>
__device__ __forceinline__ void rotate_pair(T* pa, T* pb, float c, float s) {
  const float a = to_float(*pa), b = to_float(*pb);
  *pa = from_float<T>(a * c - b * s);
  *pb = from_float<T>(b * c + a * s);
}

}  // namespace tallow::cuda
