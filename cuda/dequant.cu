// GGUF dequantization on CUDA: one thread per output element (dequant.cuh), bit-exact with the CPU.
// q [..., K]: last dim contiguous whole blocks, other dims any strides; output contiguous f32/f16/bf16.
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

}  // namespace

Tensor dequantize(const Tensor& q, DType dtype) {
  Tensor o = Tensor::empty(q.shape(), dtype, q.device());
  const int64_t n = o.numel();
  if (n == 0) return o;
  OpContext ctx(q);
  const int64_t K = q.size(-1);
  const int bs = (int)dtype_block_size(q.dtype()), ts = (int)dtype_type_size(q.dtype());
  const uint8_t* base = static_cast<const uint8_t*>(q.data_ptr());
  const Strided rows = row_index("dequantize", q);
#define TALLOW_DEQ_CASE(T)                                                                                   \
  case DType::T:                                                                                             \
    dequant_kernel<DType::T, O><<<grid_for(n, 256), 256, 0, ctx.stream>>>(base, rows, 0, K, bs, ts, po, n); \
    break;
  auto launch = [&](auto otag) {
    using O = decltype(otag);
    O* po = static_cast<O*>(o.data_ptr());
    switch (q.dtype()) {
      TALLOW_FOR_EACH_BLOCK_DTYPE(TALLOW_DEQ_CASE)
      default: throw TypeError(str_cat("dequantize: ", dtype_name(q.dtype()), " is not a GGUF block dtype"));
    }
  };
#undef TALLOW_DEQ_CASE
  switch (dtype) {
    case DType::F32: launch(float{}); break;
    case DType::F16: launch(__half{}); break;
    case DType::BF16: launch(__nv_bfloat16{}); break;
    default: throw TypeError(str_cat("dequantize: unsupported output dtype ", dtype_name(dtype)));
  }
  TALLOW_CUDA_CHECK_LAUNCH("dequantize");
  return o;
}

}  // namespace tallow::cuda
