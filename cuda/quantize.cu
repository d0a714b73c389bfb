// quantize on CUDA (ops/quantize.h): one thread per GGUF block running cpp/ops/quantize_block.h, the same
// code as the CPU op, compiled with -fmad=false (cmake/cuda.cmake) so the bytes match the CPU's exactly.
// x [..., K]: last dim contiguous (else copied), other dims any strides; output contiguous. Runs on the
// current stream of x's device with no host synchronization or allocation beyond the output: graph-safe.
#include "launch.cuh"
#include "ops/quantize_block.h"
#include "ops_cuda.h"

namespace tallow::cuda {

namespace {

// The k-quants keep ~2 KiB of per-thread arrays (local memory); small blocks keep occupancy up.
constexpr int kThreads = 64;

template <DType T, class S>
__global__ void quantize_kernel(const S* __restrict__ base, Strided rows, int64_t blocks_per_row, int64_t nblocks,
                                uint8_t* __restrict__ out) {
  constexpr int bs = quant_block::block_elems(T), ts = quant_block::block_bytes(T);
  float buf[bs];
  for (int64_t b = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; b < nblocks; b += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = b / blocks_per_row, c = b % blocks_per_row;
    const S* src = base + rows.offset(r) + c * bs;
    for (int j = 0; j < bs; ++j) buf[j] = to_float(src[j]);  // exact widening of f16 / bf16
    quant_block::quantize_block<T>(buf, out + b * ts);
  }
}

}  // namespace

Tensor quantize(const Tensor& x_in, DType dtype) {
  const Tensor x = last_dim_contiguous(x_in);
  Tensor o = Tensor::empty(x.shape(), dtype, x.device());
  const int64_t bs = quant_block::block_elems(dtype);
  const int64_t per_row = x.dim() == 0 ? 0 : x.size(-1) / bs;
  const int64_t nblocks = per_row == 0 ? 0 : x.numel() / x.size(-1) * per_row;
  if (nblocks == 0) return o;
  OpContext ctx(x);
  const Strided rows = row_index("quantize", x);
  uint8_t* out = static_cast<uint8_t*>(o.data_ptr());
  auto launch = [&](auto stag) {
    using S = decltype(stag);
    // rows.offset() counts elements from the tensor's first element (data_ptr()).
    const S* base = static_cast<const S*>(x.data_ptr());
#define TALLOW_QUANTIZE_CASE(T)                                                                          \
  case DType::T:                                                                                         \
    quantize_kernel<DType::T, S><<<grid_for(nblocks, kThreads), kThreads, 0, ctx.stream>>>(base, rows,   \
                                                                                           per_row,      \
                                                                                           nblocks, out); \
    break;
    switch (dtype) {
      TALLOW_FOR_EACH_QUANTIZE_DTYPE(TALLOW_QUANTIZE_CASE)
      default: throw TypeError(str_cat("quantize: no CUDA quantizer for dtype ", dtype_name(dtype)));
    }
#undef TALLOW_QUANTIZE_CASE
  };
  switch (x.dtype()) {
    case DType::F32: launch(float{}); break;
    case DType::F16: launch(__half{}); break;
    case DType::BF16: launch(__nv_bfloat16{}); break;
    default: throw TypeError(str_cat("quantize: unsupported input dtype ", dtype_name(x.dtype())));
  }
  TALLOW_CUDA_CHECK_LAUNCH("quantize");
  return o;
}

}  // namespace tallow::cuda
