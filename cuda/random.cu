// fill_uniform_ on CUDA: each thread writes 16 bytes (one Vec16) per iteration of a grid-stride loop,
// so the kernel is store-bandwidth bound; the few elements before the first 16-byte boundary and
// after the last whole vector are written one by one. No host sync, no allocation: capturable.
#include "launch.cuh"
#include "ops_cuda.h"
#include "random.cuh"

namespace tallow::cuda {

namespace {

template <class T>
__global__ void fill_uniform_kernel(T* __restrict__ p, int64_t n, int64_t head, int64_t nvec, uint64_t key,
                                    float low, float span) {
  constexpr int N = Vec16<T>::N;
  const int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t v = tid; v < nvec; v += stride) {
    const int64_t base = head + v * N;
    Vec16<T> r;
#pragma unroll
    for (int j = 0; j < N; ++j) r.v[j] = random_uniform<T>(key, (uint64_t)(base + j), low, span);
    store16(p + base, r);
  }
  // Unaligned head [0, head) and tail [head + nvec * N, n): fewer than 2N elements, the first threads.
  const int64_t tail0 = head + nvec * N;
  if (tid < head + (n - tail0)) {
    const int64_t i = tid < head ? tid : tail0 + (tid - head);
    p[i] = random_uniform<T>(key, (uint64_t)i, low, span);
  }
}

}  // namespace

void fill_uniform_(Tensor& t, float low, float span, uint64_t key) {
  const int64_t n = t.numel();
  if (n == 0) return;
  OpContext ctx(t);
  TALLOW_CUDA_DISPATCH_FLOAT("fill_uniform_", t.dtype(), [&] {
    constexpr int N = Vec16<scalar_t>::N;
    scalar_t* p = static_cast<scalar_t*>(t.data_ptr());
    const int64_t mis = (int64_t)((uintptr_t)p % 16);  // element pointers are size-aligned
    int64_t head = mis ? (16 - mis) / (int64_t)sizeof(scalar_t) : 0;
    if (head > n) head = n;
    const int64_t nvec = (n - head) / N;
    const int threads = 256;
    fill_uniform_kernel<scalar_t><<<grid_for(nvec, threads), threads, 0, ctx.stream>>>(p, n, head, nvec, key, low,
                                                                                      span);
    TALLOW_CUDA_CHECK_LAUNCH("fill_uniform_");
  });
}

}  // namespace tallow::cuda
