// rotary_embedding on CUDA, in place on q and k (vLLM's convention; see cpp/ops/rope.h). One thread
// rotates one pair of one head. Positions are validated before anything is written (IndexError, as
// on the CPU); under graph capture the check cannot read back, so rows with an out-of-range position
// are skipped instead.
#include "launch.cuh"
#include "ops_cuda.h"
#include "rope.cuh"

namespace tallow::cuda {

namespace {

template <class P>
__global__ void check_positions_kernel(const P* __restrict__ pos, int64_t n, int64_t max_pos, int* flag) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t p = (int64_t)pos[i];
    if (p < 0 || p >= max_pos) atomicMax(flag, 1);
  }
}

// Rows are (token, head) pairs of one tensor; `rows` maps row -> element offset of the head.
template <class T, class P>
__global__ void rope_kernel(T* __restrict__ x, Strided rows, int64_t heads, int64_t nrows, const P* __restrict__ pos,
                            const float* __restrict__ cache, int64_t cache_stride, int64_t max_pos, int half, bool neox) {
  const int64_t n = nrows * half;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t row = i / half;
    const int p = (int)(i % half);
    const int64_t t = row / heads;
    const int64_t ps = (int64_t)pos[t];
    if (ps < 0 || ps >= max_pos) continue;
    const float* cs = cache + ps * cache_stride;
    const float c = cs[p], s = cs[half + p];
    T* h = x + rows.offset(row);
    if (neox) rotate_pair(h + p, h + p + half, c, s);
    else rotate_pair(h + 2 * p, h + 2 * p + 1, c, s);
  }
}

}  // namespace

void rotary_embedding(const Tensor& positions_in, Tensor& q, std::optional<Tensor> k, const Tensor& cache_in, bool neox) {
  const char* op = "rotary_embedding";
  OpContext ctx(q);
  const Tensor positions = contiguous(positions_in);
  const Tensor cache = cache_in;  // last dim contiguous (checked by the entry point)
  const int64_t T = positions.numel(), max_pos = cache.size(0), rot = cache.size(1), half = rot / 2;
  if (T == 0) return;
  const bool i32 = positions.dtype() == DType::I32;
  if (!is_capturing(ctx.stream)) {
    DeviceFlag flag(q, ctx.stream);
    if (i32)
      check_positions_kernel<<<grid_for(T, 256), 256, 0, ctx.stream>>>(positions.data<int32_t>(), T, max_pos, flag.ptr());
    else
      check_positions_kernel<<<grid_for(T, 256), 256, 0, ctx.stream>>>(positions.data<int64_t>(), T, max_pos, flag.ptr());
    TALLOW_CUDA_CHECK_LAUNCH(op);
    TALLOW_CHECK_INDEX(flag.read() == 0, op, ": a position is out of range of cos_sin_cache of shape ",
                       shape_str(cache.shape()), " (valid positions are 0 .. ", max_pos - 1, ")");
  }
  auto run = [&](Tensor& x) {
    const int64_t heads = x.size(-2), nrows = T * heads;
    if (nrows == 0) return;
    const Strided rows = row_index(op, x);
    TALLOW_CUDA_DISPATCH_FLOAT(op, x.dtype(), [&] {
      using S = scalar_t;
      S* px = static_cast<S*>(x.data_ptr());
      const unsigned blocks = grid_for(nrows * half, 256);
      if (i32)
        rope_kernel<S, int32_t><<<blocks, 256, 0, ctx.stream>>>(px, rows, heads, nrows, positions.data<int32_t>(),
                                                                cache.data<float>(), cache.stride(0), max_pos, (int)half, neox);
      else
        rope_kernel<S, int64_t><<<blocks, 256, 0, ctx.stream>>>(px, rows, heads, nrows, positions.data<int64_t>(),
                                                                cache.data<float>(), cache.stride(0), max_pos, (int)half, neox);
    });
    TALLOW_CUDA_CHECK_LAUNCH(op);
  };
  run(q);
  if (k && k->defined()) run(*k);
}

}  // namespace tallow::cuda
