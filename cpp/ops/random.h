// Random fills for "dummy" (random-weight) models: a counter-based hash of (seed, element index), so
// the value of every element is fixed by the seed alone, whatever the device, thread count or launch
// shape. The CPU and CUDA kernels share the arithmetic below and agree bit for bit.
#pragma once
#include <cstdint>

#include "core/tensor.h"

#if defined(__CUDACC__)
#define TALLOW_RANDOM_HD __host__ __device__ __forceinline__
#else
#define TALLOW_RANDOM_HD inline
#endif

namespace tallow::ops {

// Fills t (float32/float16/bfloat16, contiguous, any device) in place with values uniform in
// [low, high] and returns it. Element i gets uniform_value(seed_key(seed), i, low, high) rounded
// (nearest even) to t's dtype. Asynchronous on CUDA (current stream; no host sync, capturable).
Tensor& fill_uniform_(Tensor& t, float low, float high, uint64_t seed);

namespace random_detail {

// splitmix64's output function (Steele, Lea, Flood 2014): a bijective 64-bit mixer.
TALLOW_RANDOM_HD uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The seed is mixed first so that seed s + 1 is not the stream of seed s shifted by one element.
TALLOW_RANDOM_HD uint64_t seed_key(uint64_t seed) { return mix64(seed ^ 0x6A09E667F3BCC909ull); }

// 24 random bits for element i (splitmix64 state key + (i + 1) * golden gamma).
TALLOW_RANDOM_HD uint32_t bits24(uint64_t key, uint64_t i) {
  return (uint32_t)(mix64(key + (i + 1) * 0x9E3779B97F4A7C15ull) >> 40);
}

// low + (high - low) * k / 2^24 in f32. span is rounded to f32 once; span * k (24 x 24 bits) is exact
// in double, so the one double rounding of the sum is the same with or without FMA contraction, and
// the result is identical on every compiler and device.
TALLOW_RANDOM_HD float affine(uint32_t k, float low, float span) {
  const double u = (double)k * (1.0 / 16777216.0);
  return (float)((double)low + (double)span * u);
}

}  // namespace random_detail
}  // namespace tallow::ops
