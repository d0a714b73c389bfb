// argmax and topk on CUDA: one block per row. Each round is a block-wide max of the rank keys
// (topk.cuh) below the previous round's winner, so round j finds the j-th element of the total order
// without sorting; keys are cached in shared memory when the row fits. topk costs k passes over the
// row (fine for sampling's k <= a few hundred).
#include "launch.cuh"
#include "ops_cuda.h"
#include "topk.cuh"

namespace tallow::cuda {

namespace {

constexpr int64_t kTopkMaxCached = 6 * 1024;  // keys (8 B each) in shared memory

__device__ __forceinline__ uint64_t warp_max_u64(uint64_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const uint64_t w = __shfl_xor_sync(0xffffffffu, v, o);
    v = w > v ? w : v;
  }
  return v;
}

__device__ uint64_t block_max_u64(uint64_t v, uint64_t* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_max_u64(v);
  __syncthreads();
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < nwarps ? smem[lane] : 0;
  return warp_max_u64(v);
}

template <class T>
__global__ void topk_kernel(const T* __restrict__ x, Strided rows, int64_t sx, int64_t n, int64_t k, bool cache,
                            T* __restrict__ vals, int64_t* __restrict__ idx) {
  extern __shared__ uint64_t keys[];
  __shared__ uint64_t red[32];
  const T* xr = x + rows.offset(blockIdx.x);
  if (cache)
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) keys[i] = rank_key(to_float(xr[i * sx]), i);
  __syncthreads();
  uint64_t prev = ~uint64_t(0);
  for (int64_t j = 0; j < k; ++j) {
    uint64_t best = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const uint64_t key = cache ? keys[i] : rank_key(to_float(xr[i * sx]), i);
      if (key < prev && key > best) best = key;
    }
    best = block_max_u64(best, red);
    prev = best;
    if (threadIdx.x == 0) {
      const int64_t i = key_index(best);
      idx[blockIdx.x * k + j] = i;
      if (vals) vals[blockIdx.x * k + j] = xr[i * sx];
    }
  }
}

std::pair<Tensor, Tensor> run(const char* op, const Tensor& x, int64_t k, bool want_vals) {
  const int64_t n = x.size(-1);
  Shape oshape = x.shape();
  oshape.back() = k;
  Tensor vals = want_vals ? Tensor::empty(oshape, x.dtype(), x.device()) : Tensor();
  Tensor idx = Tensor::empty(oshape, DType::I64, x.device());
  const int64_t rows = n ? x.numel() / n : 0;
  if (k == 0 || rows == 0) return {vals, idx};
  TALLOW_CHECK(n < 0xffffffffLL, op, ": rows longer than 2^32 - 1 elements are not supported");
  OpContext ctx(x);
  const bool cache = n <= kTopkMaxCached && k > 1;
  const size_t smem = cache ? (size_t)n * sizeof(uint64_t) : 0;
  const int threads = (int)std::min<int64_t>(1024, std::max<int64_t>(32, (n / 4 + 31) / 32 * 32));
  TALLOW_CUDA_DISPATCH_FLOAT(op, x.dtype(), [&] {
    using T = scalar_t;
    topk_kernel<T><<<(unsigned)rows, threads, smem, ctx.stream>>>(
        static_cast<const T*>(x.data_ptr()), row_index(op, x), x.stride(-1), n, k, cache,
        want_vals ? static_cast<T*>(vals.data_ptr()) : nullptr, idx.data<int64_t>());
  });
  TALLOW_CUDA_CHECK_LAUNCH(op);
  return {vals, idx};
}

}  // namespace

Tensor argmax(const Tensor& x) {
  Tensor idx = run("argmax", x, 1, false).second;
  Shape s(x.shape().begin(), x.shape().end() - 1);
  return idx.view(s);
}

std::pair<Tensor, Tensor> topk(const Tensor& x, int64_t k) { return run("topk", x, k, true); }

}  // namespace tallow::cuda
