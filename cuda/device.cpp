// Device management and error reporting for the CUDA runtime.
#include <cuda_runtime_api.h>

#include <mutex>

#include "check.h"
#include "core/error.h"
#include "runtime.h"

namespace tallow::cuda {

void throw_cuda_error(const char* op, const char* expr, cudaError_t err, const char* file, int line) {
  (void)cudaGetLastError();  // clear a non-sticky error so later calls are not blamed for it
  throw CudaError(str_cat(op, ": CUDA error ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ") in ", expr,
                          " at ", file, ":", line));
}

void throw_cublas_error(const char* op, const char* expr, int status, const char* file, int line) {
  throw CudaError(str_cat(op, ": cuBLAS error ", status, " in ", expr, " at ", file, ":", line));
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

bool is_available() { return device_count() > 0; }

int current_device() {
  int d = 0;
  TALLOW_CUDA_CHECK("current_device", cudaGetDevice(&d));
  return d;
}

static int resolve(int device) { return device < 0 ? current_device() : device; }

void set_device(int device) {
  const int n = device_count();
  TALLOW_CHECK(device >= 0 && device < n, "set_device: device ", device, " out of range (", n, " CUDA devices)");
  TALLOW_CUDA_CHECK("set_device", cudaSetDevice(device));
}

std::pair<size_t, size_t> mem_get_info(int device) {
  DeviceGuard g(resolve(device));
  size_t free_b = 0, total = 0;
  TALLOW_CUDA_CHECK("mem_get_info", cudaMemGetInfo(&free_b, &total));
  return {free_b, total};
}

void synchronize(int device) {
  DeviceGuard g(resolve(device));
  TALLOW_CUDA_CHECK("synchronize", cudaDeviceSynchronize());
}

DeviceProperties device_properties(int device) {
  device = resolve(device);
  cudaDeviceProp p{};
  TALLOW_CUDA_CHECK("device_properties", cudaGetDeviceProperties(&p, device));
  DeviceProperties r;
  r.name = p.name;
  r.major = p.major;
  r.minor = p.minor;
  r.multiprocessors = p.multiProcessorCount;
  r.total_memory = p.totalGlobalMem;
  r.l2_cache_bytes = p.l2CacheSize;
  r.shared_memory_per_block_optin = (int)p.sharedMemPerBlockOptin;
  r.memory_bus_width = p.memoryBusWidth;
  return r;
}

DeviceGuard::DeviceGuard(int device) {
  int cur = 0;
  TALLOW_CUDA_CHECK("DeviceGuard", cudaGetDevice(&cur));
  if (cur != device) {
    TALLOW_CUDA_CHECK("DeviceGuard", cudaSetDevice(device));
    prev_ = cur;
  }
}

DeviceGuard::~DeviceGuard() {
  if (prev_ >= 0) (void)cudaSetDevice(prev_);
}

}  // namespace tallow::cuda
