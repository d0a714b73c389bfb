// softmax on CUDA: one block per row, z cached in shared memory when the row fits, f32 throughout.
// A fully masked row (all -inf) gives zeros; NaN (or +inf without softcap) gives a NaN row.
#include "launch.cuh"
#include "norm.cuh"
#include "ops_cuda.h"
#include "softmax.cuh"

namespace tallow::cuda {

namespace {

template <class T>
__global__ void softmax_kernel(const T* __restrict__ x, Strided rows, int64_t n, float scale, float softcap, bool cache,
                               T* __restrict__ out) {
  extern __shared__ float z[];
  __shared__ float red[32];
  const int64_t row = blockIdx.x;
  const T* xr = x + rows.offset(row);
  T* orow = out + row * n;
  float m = -INFINITY;
  bool nan = false;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = softmax_z(to_float(xr[i]), scale, softcap);
    if (cache) z[i] = v;
    nan |= v != v;
    m = v > m ? v : m;
  }
  m = block_max(m, red);
  const float any_nan = block_sum(nan ? 1.f : 0.f, red);
  if (m == -INFINITY && any_nan == 0.f) {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) orow[i] = from_float<T>(0.f);
    return;
  }
  if (any_nan > 0.f) m = NAN;
  float sum = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = cache ? z[i] : softmax_z(to_float(xr[i]), scale, softcap);
    const float e = expf(v - m);
    if (cache) z[i] = e;
    sum += e;
  }
  sum = block_sum(sum, red);
  const float inv = 1.0f / sum;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float e = cache ? z[i] : expf(softmax_z(to_float(xr[i]), scale, softcap) - m);
    orow[i] = from_float<T>(e * inv);
  }
}

}  // namespace

Tensor softmax(const Tensor& x_in, float scale, float softcap, const std::optional<Tensor>& out) {
  const char* op = "softmax";
  Tensor o = make_out(op, out, x_in.shape(), x_in.dtype(), x_in.device());
  const int64_t n = x_in.size(-1), rows = n ? o.numel() / n : 0;
  if (rows == 0) return o;
  const Tensor x = last_dim_contiguous(x_in);
  OpContext ctx(x);
  const bool cache = n <= kNormMaxCachedFloats;
  const size_t smem = cache ? (size_t)n * sizeof(float) : 0;
  const int threads = (int)std::min<int64_t>(1024, std::max<int64_t>(32, (n / 4 + 31) / 32 * 32));
  TALLOW_CUDA_DISPATCH_FLOAT(op, x.dtype(), [&] {
    using T = scalar_t;
    if (smem > 48 * 1024)
      TALLOW_CUDA_CHECK(op, cudaFuncSetAttribute(softmax_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    softmax_kernel<T><<<(unsigned)rows, threads, smem, ctx.stream>>>(static_cast<const T*>(x.data_ptr()),
                                                                    row_index(op, x), n, scale, softcap, cache,
                                                                    static_cast<T*>(o.data_ptr()));
  });
  TALLOW_CUDA_CHECK_LAUNCH(op);
  return o;
}

}  // namespace tallow::cuda
