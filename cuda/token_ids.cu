// fill_from_previous_ (cpp/ops/token_ids.h): one thread per row.
#include <cuda_runtime.h>

#include "check.h"
#include "ops_cuda.h"
#include "runtime.h"

namespace tallow::cuda {

namespace {
__global__ void fill_from_previous_kernel(int32_t* ids, int64_t n, const int32_t* prev, int64_t np) {
  const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= n) return;
  const int32_t v = ids[t];
  if (v >= 0) return;
  const int64_t j = -(int64_t)v - 1;
  ids[t] = j < np ? prev[j] : 0;
}
}  // namespace

void fill_from_previous_(const Tensor& ids, const Tensor& previous) {
  const int64_t n = ids.numel();
  if (n == 0) return;
  DeviceGuard g(ids.device().index);
  const int threads = 256;
  fill_from_previous_kernel<<<(unsigned)((n + threads - 1) / threads), threads, 0,
                              (cudaStream_t)current_stream(ids.device().index)>>>(
      static_cast<int32_t*>(ids.data_ptr()), n, static_cast<const int32_t*>(previous.data_ptr()), previous.numel());
  TALLOW_CUDA_CHECK("fill_from_previous_", cudaGetLastError());
}

}  // namespace tallow::cuda
