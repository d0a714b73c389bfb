// Casts between the scalar dtypes on CUDA (floats through f32, integers through i64, as on the
// CPU), any input strides, contiguous output. One kernel with a run-time switch on both dtypes
// (uniform across the grid, so the branches cost a few instructions); block dtypes dequantize.
#include "cast.cuh"
#include "launch.cuh"
#include "ops_cuda.h"

namespace tallow::cuda {

namespace {

enum Code : int { kF32, kF16, kBF16, kF8, kI8, kU8, kI32, kI64, kBool };

Code code_of(DType d) {
  switch (d) {
    case DType::F32: return kF32;
    case DType::F16: return kF16;
    case DType::BF16: return kBF16;
    case DType::F8E4M3: return kF8;
    case DType::I8: return kI8;
    case DType::U8: return kU8;
    case DType::I32: return kI32;
    case DType::I64: return kI64;
    case DType::Bool: return kBool;
    default: throw TypeError(str_cat("cast: unsupported dtype ", dtype_name(d), " on CUDA"));
  }
}

__device__ __forceinline__ bool is_int(int c) { return c >= kI8; }

__device__ __forceinline__ float load_f(const void* p, int64_t i, int c) {
  switch (c) {
    case kF32: return static_cast<const float*>(p)[i];
    case kF16: return __half2float(static_cast<const __half*>(p)[i]);
    case kBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case kF8: return f8e4m3_to_float(static_cast<const uint8_t*>(p)[i]);
    case kI8: return (float)static_cast<const int8_t*>(p)[i];
    case kU8: return (float)static_cast<const uint8_t*>(p)[i];
    case kI32: return (float)static_cast<const int32_t*>(p)[i];
    case kI64: return (float)static_cast<const int64_t*>(p)[i];
    default: return (float)static_cast<const bool*>(p)[i];
  }
}

__device__ __forceinline__ int64_t load_i(const void* p, int64_t i, int c) {
  switch (c) {
    case kI8: return static_cast<const int8_t*>(p)[i];
    case kU8: return static_cast<const uint8_t*>(p)[i];
    case kI32: return static_cast<const int32_t*>(p)[i];
    case kI64: return static_cast<const int64_t*>(p)[i];
    case kBool: return static_cast<const bool*>(p)[i];
    default: return (int64_t)load_f(p, i, c);
  }
}

__device__ __forceinline__ void store_f(void* p, int64_t i, int c, float v) {
  switch (c) {
    case kF32: static_cast<float*>(p)[i] = v; break;
    case kF16: static_cast<__half*>(p)[i] = __float2half_rn(v); break;
    case kBF16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
    case kF8: static_cast<uint8_t*>(p)[i] = float_to_f8e4m3(v); break;
    case kI8: static_cast<int8_t*>(p)[i] = (int8_t)v; break;
    case kU8: static_cast<uint8_t*>(p)[i] = (uint8_t)v; break;
    case kI32: static_cast<int32_t*>(p)[i] = (int32_t)v; break;
    case kI64: static_cast<int64_t*>(p)[i] = (int64_t)v; break;
    default: static_cast<bool*>(p)[i] = v != 0.0f; break;
  }
}

__device__ __forceinline__ void store_i(void* p, int64_t i, int c, int64_t v) {
  switch (c) {
    case kI8: static_cast<int8_t*>(p)[i] = (int8_t)v; break;
    case kU8: static_cast<uint8_t*>(p)[i] = (uint8_t)v; break;
    case kI32: static_cast<int32_t*>(p)[i] = (int32_t)v; break;
    case kI64: static_cast<int64_t*>(p)[i] = v; break;
    default: static_cast<bool*>(p)[i] = v != 0; break;
  }
}

__global__ void cast_kernel(const void* __restrict__ x, Strided ix, bool contig, int sc, void* __restrict__ o, int dc,
                            int64_t n) {
  const bool ints = is_int(sc) && is_int(dc);
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t src = contig ? i : ix.offset(i);
    if (ints) store_i(o, i, dc, load_i(x, src, sc));
    else store_f(o, i, dc, load_f(x, src, sc));
  }
}

}  // namespace

Tensor cast(const Tensor& x, DType dtype) {
  if (is_block_dtype(x.dtype())) return dequantize(x, dtype);
  Tensor o = Tensor::empty(x.shape(), dtype, x.device());
  const int64_t n = o.numel();
  if (n == 0) return o;
  OpContext ctx(x);
  if (dtype == x.dtype()) {
    strided_copy(o, x, ctx.stream);
    return o;
  }
  cast_kernel<<<grid_for(n, 256), 256, 0, ctx.stream>>>(x.data_ptr(), broadcast_index("cast", x, x.shape()),
                                                          x.is_contiguous(), code_of(x.dtype()), o.data_ptr(),
                                                          code_of(dtype), n);
  TALLOW_CUDA_CHECK_LAUNCH("cast");
  return o;
}

}  // namespace tallow::cuda
