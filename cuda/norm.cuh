// Row normalisations (rms_norm, fused_add_rms_norm, layer_norm): one block per row. The row is read
// once with 16-byte loads where alignment allows, kept in shared memory as f32 (when it fits), and
// the reductions are f32 block sums.
#pragma once
#include "common.cuh"

namespace tallow::cuda {

constexpr int kNormMaxCachedFloats = 40 * 1024;  // softmax: 160 KiB of shared memory per row at most
constexpr int64_t kNormMaxCachedBytes = 96 * 1024;  // norms: the row in its storage type

// VEC consecutive elements (VEC * sizeof(T) bytes, aligned to that) in one access.
template <class T, int VEC>
struct alignas(VEC * sizeof(T)) Pack {
  T v[VEC];
};

template <class T, int VEC>
__device__ __forceinline__ void load_vec(const T* p, int64_t e, float (&f)[VEC]) {
  const Pack<T, VEC> v = *reinterpret_cast<const Pack<T, VEC>*>(p + e);
#pragma unroll
  for (int j = 0; j < VEC; ++j) f[j] = to_float(v.v[j]);
}

template <class T, int VEC>
__device__ __forceinline__ void store_vec(T* p, int64_t e, const float (&f)[VEC]) {
  Pack<T, VEC> v;
#pragma unroll
  for (int j = 0; j < VEC; ++j) v.v[j] = from_float<T>(f[j]);
  *reinterpret_cast<Pack<T, VEC>*>(p + e) = v;
}

// Element offset of row `row` of a row_index() descriptor: one multiply in the usual case of a single
// (merged) leading dimension, instead of 64-bit divisions.
__device__ __forceinline__ int64_t row_offset(const Strided& s, int64_t row) {
  return s.ndim == 1 ? row * s.stride[0] : s.offset(row);
}

}  // namespace tallow::cuda
