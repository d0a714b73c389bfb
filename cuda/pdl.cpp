#include "pdl.cuh"

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>

#include "check.h"
#include "runtime.h"

namespace tallow::cuda {

namespace {

// Off unless TALLOW_PDL=1: on an H200 the Llama-3-8B batch-1 decode ran at 214 tok/s without PDL and
// 203 tok/s with it (benchmarks/results/e2e_h200.json, notes in cuda/README.md).
std::atomic<bool>& pdl_flag() {
  static std::atomic<bool> on{[] {
    const char* e = std::getenv("TALLOW_PDL");
    return e && std::string(e) == "1";
  }()};
  return on;
}

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

bool pdl_enabled() { return pdl_flag().load(); }
void set_pdl_enabled(bool on) { pdl_flag().store(on); }
bool use_pdl(void* stream) {  // cheapest test first: eager launches pay one cudaStreamIsCapturing
  return pdl_flag().load() && pdl_capable(stream);
}
bool pdl_capable(void* stream) { return is_capturing(static_cast<StreamHandle>(stream)) && compute_major() >= 9; }

}  // namespace tallow::cuda
