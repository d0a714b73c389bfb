#include "pdl.cuh"

#include <cuda_runtime_api.h>

#include <mutex>

#include "check.h"
#include "runtime.h"

namespace tallow::cuda {

namespace {

int compute_major() {  // of the current device, cached per device
  static int cache[64] = {};
  static std::mutex mu;
  int dev = 0;
  TALLOW_CUDA_CHECK("pdl", cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lk(mu);
  int& m = cache[dev < 64 ? dev : 63];
  if (!m) TALLOW_CUDA_CHECK("pdl", cudaDeviceGetAttribute(&m, cudaDevAttrComputeCapabilityMajor, dev));
  return m;
}

}  // namespace

bool pdl_capable(void* stream) { return is_capturing(static_cast<StreamHandle>(stream)) && compute_major() >= 9; }

}  // namespace tallow::cuda
