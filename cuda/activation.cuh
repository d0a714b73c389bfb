// Gated activations: act(a) * b in f32 (silu, gelu tanh, gelu erf).
#pragma once
#include "common.cuh"

namespace tallow::cuda {

enum class Act { Silu, GeluTanh, GeluErf };

template <Act kAct>
__device__ __forceinline__ float act(float a) {
  if constexpr (kAct == Act::Silu) {
    return a / (1.0f + __expf(-a));
  } else if constexpr (kAct == Act::GeluTanh) {
    return 0.5f * a * (1.0f + tanhf(0.7978845608028654f * (a + 0.044715f * a * a * a)));
  } else {
    return 0.5f * a * (1.0f + erff(a * 0.7071067811865476f));
  }
}

}  // namespace tallow::cuda
