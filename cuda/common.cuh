// Shared device-side helpers for the CUDA kernels: storage types, f32 conversions, 16-byte vectors,
// warp/block reductions, and the host-side launch context (device guard + current stream).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "check.h"
#include "core/error.h"
#include "core/tensor.h"
#include "runtime.h"

namespace tallow::cuda {

// ---- host side ------------------------------------------------------------------------------------

// Device guard for a tensor's device plus the current stream there; every op opens one.
struct OpContext {
  explicit OpContext(const Tensor& t) : guard(t.device().index), stream((cudaStream_t)current_stream(t.device().index)) {}
  DeviceGuard guard;
  cudaStream_t stream;
};

inline bool aligned_to(const void* p, size_t a) { return ((uintptr_t)p % a) == 0; }
inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Grid size for a grid-stride loop over n items.
inline unsigned grid_for(int64_t n, int threads, int64_t max_blocks = 65535LL * 16) {
  int64_t b = ceil_div(n, threads);
  if (b < 1) b = 1;
  if (b > max_blocks) b = max_blocks;
  return (unsigned)b;
}

// BODY runs with scalar_t bound to float, __half or __nv_bfloat16.
#define TALLOW_CUDA_DISPATCH_FLOAT(OP, DTYPE, ...)                                            \
  [&] {                                                                                       \
    switch (DTYPE) {                                                                          \
      case ::tallow::DType::F32: { using scalar_t = float; return __VA_ARGS__(); }            \
      case ::tallow::DType::F16: { using scalar_t = __half; return __VA_ARGS__(); }           \
      case ::tallow::DType::BF16: { using scalar_t = __nv_bfloat16; return __VA_ARGS__(); }   \
      default:                                                                                \
        throw ::tallow::TypeError(::tallow::str_cat(OP, ": unsupported dtype ",              \
                                                    ::tallow::dtype_name(DTYPE), " on CUDA")); \
    }                                                                                         \
  }()

// ---- device side ----------------------------------------------------------------------------------

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <class T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// N elements of T in one 16-byte access.
template <class T>
struct alignas(16) Vec16 {
  static constexpr int N = 16 / sizeof(T);
  T v[N];
};

template <class T>
__device__ __forceinline__ Vec16<T> load16(const T* p) {
  Vec16<T> r;
  *reinterpret_cast<uint4*>(&r) = __ldg(reinterpret_cast<const uint4*>(p));
  return r;
}
template <class T>
__device__ __forceinline__ void store16(T* p, const Vec16<T>& v) {
  *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(&v);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `smem` holds 32 floats; the function syncs, so it can be called repeatedly with the same smem.
__device__ __forceinline__ float block_sum(float v, float* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < nwarps ? smem[lane] : 0.f;
  return warp_sum(v);
}
__device__ __forceinline__ float block_max(float v, float* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < nwarps ? smem[lane] : -INFINITY;
  return warp_max(v);
}

// Offsets of an N-d strided view (up to kMaxDims dims; row-major linear index -> element offset).
constexpr int kMaxDims = 8;
struct Strided {
  int ndim = 0;
  int64_t size[kMaxDims] = {};
  int64_t stride[kMaxDims] = {};
  __host__ __device__ __forceinline__ int64_t offset(int64_t i) const {
    int64_t off = 0;
    for (int d = ndim - 1; d >= 0; --d) {
      const int64_t s = size[d];
      off += (i % s) * stride[d];
      i /= s;
    }
    return off;
  }
};

}  // namespace tallow::cuda
