// GGUF dequantization on CUDA, bit-exact with the CPU (dequant.cuh's element functions).
// q [..., K]: last dim contiguous whole blocks, other dims any strides; output contiguous f32/f16/bf16.
// Contiguous q (and quant_linear's prefill path, through dequantize_rows) takes the pack kernel: one
// thread per 16-byte pack of outputs; other strides the element kernel (one thread each).
#include "dequant.cuh"
#include "launch.cuh"
#include "ops_cuda.h"

namespace tallow::cuda {

namespace {

template <DType kT, class O>
__global__ void dequant_kernel(const uint8_t* __restrict__ base, Strided rows, int64_t row_stride_blocks_unused,
                               int64_t K, int bs, int ts, O* __restrict__ out, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / K, c = i % K;
    // rows.offset() is in logical elements (whole blocks) from the tensor's first element.
    const int64_t blk = (rows.offset(r) + c) / bs;
    out[i] = from_float<O>(deq::element<kT>(base + blk * ts, (int)(c % bs)));
  }
}

// One 16-byte pack of outputs a thread (8 bf16/f16 or 4 f32 consecutive elements of one block), so a
// warp's stores are contiguous; out is [rows, K] contiguous, pack p starts at out + p * kPack.
template <DType kT, class O>
__global__ void dequant_packs_kernel(const uint8_t* __restrict__ base, int64_t row_bytes, int64_t K,
                                     int64_t n_packs, O* __restrict__ out) {
  constexpr int kBlock = deq::block_elems(kT), kBytes = deq::block_bytes(kT), kPack = Vec16<O>::N;
  for (int64_t p = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; p < n_packs;
       p += (int64_t)gridDim.x * blockDim.x) {
    const int64_t e = p * kPack, r = e / K, c = e % K;
    const uint8_t* blk = base + r * row_bytes + (c / kBlock) * kBytes;
    const int j0 = (int)(c % kBlock);
    Vec16<O> v;
#pragma unroll
    for (int j = 0; j < kPack; ++j) v.v[j] = from_float<O>(deq::element<kT>(blk, j0 + j));
    store16(out + e, v);
  }
}

template <class F>
void for_output_dtype(const char* op, DType dtype, F&& f) {
  switch (dtype) {
    case DType::F32: f(float{}); break;
    case DType::F16: f(__half{}); break;
    case DType::BF16: f(__nv_bfloat16{}); break;
    default: throw TypeError(str_cat(op, ": unsupported output dtype ", dtype_name(dtype)));
  }
}

}  // namespace

void dequantize_rows(DType wt, const uint8_t* base, int64_t rows, int64_t K, int64_t row_bytes, DType out_dtype,
                     void* out, cudaStream_t stream) {
  if (rows * K == 0) return;
#define TALLOW_DEQ_PACKS_CASE(T)                                                                          \
  case DType::T:                                                                                          \
    dequant_packs_kernel<DType::T, O><<<grid_for(n_packs, 256), 256, 0, stream>>>(base, row_bytes, K, n_packs, po); \
    break;
  for_output_dtype("dequantize", out_dtype, [&](auto otag) {
    using O = decltype(otag);
    O* po = static_cast<O*>(out);
    const int64_t n_packs = rows * K / Vec16<O>::N;  // K is a multiple of 32
    switch (wt) {
      TALLOW_FOR_EACH_BLOCK_DTYPE(TALLOW_DEQ_PACKS_CASE)
      default: throw TypeError(str_cat("dequantize: ", dtype_name(wt), " is not a GGUF block dtype"));
    }
  });
#undef TALLOW_DEQ_PACKS_CASE
  TALLOW_CUDA_CHECK_LAUNCH("dequantize");
}

Tensor dequantize(const Tensor& q, DType dtype) {
  Tensor o = Tensor::empty(q.shape(), dtype, q.device());
  const int64_t n = o.numel();
  if (n == 0) return o;
  OpContext ctx(q);
  const int64_t K = q.size(-1);
  const int bs = (int)dtype_block_size(q.dtype()), ts = (int)dtype_type_size(q.dtype());
  const uint8_t* base = static_cast<const uint8_t*>(q.data_ptr());
  if (q.is_contiguous() && K % 32 == 0) {
    dequantize_rows(q.dtype(), base, n / K, K, K / bs * ts, dtype, o.data_ptr(), ctx.stream);
    return o;
  }
  const Strided rows = row_index("dequantize", q);
#define TALLOW_DEQ_CASE(T)                                                                                   \
  case DType::T:                                                                                             \
    dequant_kernel<DType::T, O><<<grid_for(n, 256), 256, 0, ctx.stream>>>(base, rows, 0, K, bs, ts, po, n); \
    break;
  for_output_dtype("dequantize", dtype, [&](auto otag) {
    using O = decltype(otag);
    O* po = static_cast<O*>(o.data_ptr());
    switch (q.dtype()) {
      TALLOW_FOR_EACH_BLOCK_DTYPE(TALLOW_DEQ_CASE)
      default: throw TypeError(str_cat("dequantize: ", dtype_name(q.dtype()), " is not a GGUF block dtype"));
    }
  });
#undef TALLOW_DEQ_CASE
  TALLOW_CUDA_CHECK_LAUNCH("dequantize");
  return o;
}

}  // namespace tallow::cuda
