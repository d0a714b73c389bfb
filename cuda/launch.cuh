// Host-side helpers shared by the op files: output allocation/checks, row descriptors, flags.
#pragma once
#include <optional>

#include "common.cuh"
#include "copy_kernels.cuh"

namespace tallow::cuda {

// A caller's `out` (checked: shape, dtype, device, contiguous) or a new contiguous tensor.
Tensor make_out(const char* op, const std::optional<Tensor>& out, const Shape& shape, DType dtype, Device device);

// Element offset of each row (all dims but the last) of t; t's last dim must be contiguous.
Strided row_index(const char* op, const Tensor& t);

// t when its last dim is contiguous (stride 1 or size <= 1), else a contiguous copy.
Tensor last_dim_contiguous(const Tensor& t);

// Full-tensor element offsets for t viewed with `shape` (t broadcastable to shape; size-1 dims dropped).
Strided broadcast_index(const char* op, const Tensor& t, const Shape& shape);

// Multiprocessors of the current device (cached per device).
int sm_count();

// A device int flag: reset, then read back (synchronizing) after kernels set it.
class DeviceFlag {
 public:
  DeviceFlag(const Tensor& like, cudaStream_t stream);
  int* ptr() const { return static_cast<int*>(buf_.data_ptr()); }
  int read();  // waits for the stream
 private:
  Tensor buf_;
  cudaStream_t stream_;
};

}  // namespace tallow::cuda
