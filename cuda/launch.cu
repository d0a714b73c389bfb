#include "launch.cuh"

#include <atomic>

#include "ops_cuda.h"

namespace tallow::cuda {

namespace {
std::atomic<bool> g_index_checks{true};
}  // namespace

bool index_checks() { return g_index_checks.load(); }

int sm_count() {
  static int counts[64] = {};
  int dev = 0;
  TALLOW_CUDA_CHECK("sm_count", cudaGetDevice(&dev));
  if (dev >= 64) dev = 63;
  if (!counts[dev]) TALLOW_CUDA_CHECK("sm_count", cudaDeviceGetAttribute(&counts[dev], cudaDevAttrMultiProcessorCount, dev));
  return counts[dev];
}
void set_index_checks(bool on) { g_index_checks.store(on); }

Tensor make_out(const char* op, const std::optional<Tensor>& out, const Shape& shape, DType dtype, Device device) {
  if (!out || !out->defined()) return Tensor::empty(shape, dtype, device);
  TALLOW_CHECK(out->shape() == shape, op, ": out has shape ", shape_str(out->shape()), ", expected ", shape_str(shape));
  TALLOW_CHECK_TYPE(out->dtype() == dtype, op, ": out has dtype ", dtype_name(out->dtype()), ", expected ",
                    dtype_name(dtype));
  TALLOW_CHECK(out->device() == device, op, ": out is on ", out->device().str(), ", expected ", device.str());
  TALLOW_CHECK(out->is_contiguous(), op, ": out of shape ", shape_str(shape), " must be contiguous");
  return *out;
}

Strided row_index(const char* op, const Tensor& t) {
  Strided s;
  const int64_t nd = t.dim();
  // Leading dims, dropping size-1 ones and merging contiguous runs.
  for (int64_t d = 0; d + 1 < nd; ++d) {
    const int64_t size = t.size(d), st = t.stride(d);
    if (size == 1) continue;
    if (s.ndim > 0 && s.stride[s.ndim - 1] == st * size) {
      s.size[s.ndim - 1] *= size;
      s.stride[s.ndim - 1] = st;
      continue;
    }
    TALLOW_CHECK(s.ndim < kMaxDims, op, ": too many dims in ", shape_str(t.shape()));
    s.size[s.ndim] = size;
    s.stride[s.ndim] = st;
    s.ndim++;
  }
  if (s.ndim == 0) {
    s.ndim = 1;
    s.size[0] = 1;
    s.stride[0] = 0;
  }
  return s;
}

Tensor last_dim_contiguous(const Tensor& t) {
  return t.dim() && t.size(-1) > 1 && t.stride(-1) != 1 ? contiguous(t) : t;
}

Strided broadcast_index(const char* op, const Tensor& t, const Shape& shape) {
  const Tensor e = t.expand(shape);
  Strided s;
  for (int64_t d = 0; d < e.dim(); ++d) {
    const int64_t size = e.size(d), st = e.stride(d);
    if (size == 1) continue;
    TALLOW_CHECK(s.ndim < kMaxDims, op, ": too many dims in ", shape_str(shape));
    s.size[s.ndim] = size;
    s.stride[s.ndim] = st;
    s.ndim++;
  }
  if (s.ndim == 0) {
    s.ndim = 1;
    s.size[0] = 1;
    s.stride[0] = 0;
  }
  return s;
}

DeviceFlag::DeviceFlag(const Tensor& like, cudaStream_t stream)
    : buf_(Tensor::empty({1}, DType::I32, like.device())), stream_(stream) {
  TALLOW_CUDA_CHECK("flag", cudaMemsetAsync(buf_.data_ptr(), 0, sizeof(int), stream));
}

int DeviceFlag::read() {
  int v = 0;
  TALLOW_CUDA_CHECK("flag", cudaMemcpyAsync(&v, buf_.data_ptr(), sizeof(int), cudaMemcpyDeviceToHost, stream_));
  TALLOW_CUDA_CHECK("flag", cudaStreamSynchronize(stream_));
  return v;
}

}  // namespace tallow::cuda
