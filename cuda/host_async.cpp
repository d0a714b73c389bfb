#include "host_async.h"

#include <cuda_runtime_api.h>

#include "check.h"
#include "core/error.h"
#include "runtime.h"

namespace tallow::cuda {

Tensor empty_pinned(const Shape& shape, DType dtype) {
  int64_t n = 1;
  for (auto d : shape) {
    TALLOW_CHECK(d >= 0, "empty_pinned: negative dimension");
    n *= d;
  }
  const size_t nbytes = (size_t)dtype_nbytes(dtype, n);
  void* p = nullptr;
  TALLOW_CUDA_CHECK("empty_pinned", cudaHostAlloc(&p, nbytes ? nbytes : 1, cudaHostAllocPortable));
  Shape strides(shape.size());
  int64_t s = 1;
  for (int64_t i = (int64_t)shape.size() - 1; i >= 0; --i) {
    strides[(size_t)i] = s;
    s *= shape[(size_t)i];
  }
  return Tensor::from_blob(p, shape, strides, dtype, Device{}, [p] { (void)cudaFreeHost(p); }, nbytes);
}

void copy_to_host_async(const Tensor& dst, const Tensor& src) {
  TALLOW_CHECK(src.device().type == DeviceType::CUDA && dst.device().type == DeviceType::CPU,
               "copy_to_host_async: needs a CUDA source and a CPU destination, got ", src.device().str(), " -> ",
               dst.device().str());
  TALLOW_CHECK(src.dtype() == dst.dtype() && src.numel() == dst.numel(),
               "copy_to_host_async: dtype/size differ: ", src.numel(), " ", dtype_name(src.dtype()), " -> ",
               dst.numel(), " ", dtype_name(dst.dtype()));
  TALLOW_CHECK(src.is_contiguous() && dst.is_contiguous(), "copy_to_host_async: both tensors must be contiguous");
  if (src.numel() == 0) return;
  DeviceGuard g(src.device().index);
  TALLOW_CUDA_CHECK("copy_to_host_async",
                    cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), (size_t)src.nbytes(), cudaMemcpyDeviceToHost,
                                    (cudaStream_t)current_stream(src.device().index)));
}

}  // namespace tallow::cuda
