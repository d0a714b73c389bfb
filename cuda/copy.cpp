// Host<->device and device<->device copies behind Tensor::copy_ (registered with register_copy).
// Host->device copies stage through pinned buffers in chunks and return once the last chunk is
// queued on the current stream (async); device->host copies wait for their data. Strided sources
// are made contiguous first (on their own side); strided destinations are filled from a
// contiguous copy by the strided device kernel or the host copy.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>

#include "check.h"
#include "copy_kernels.cuh"
#include "core/error.h"
#include "core/tensor.h"
#include "pinned.h"
#include "runtime.h"

namespace tallow::cuda {

namespace {

constexpr size_t kChunk = size_t(8) << 20;

void no_capture(const char* what, StreamHandle s) {
  TALLOW_CHECK(!is_capturing(s), "copy_: ", what,
               " copies cannot be captured in a CUDA graph; update static inputs before replay instead");
}

void copy_h2d(const Tensor& dst, const Tensor& src) {
  DeviceGuard g(dst.device().index);
  const StreamHandle stream = current_stream(dst.device().index);
  no_capture("host-to-device", stream);
  const Tensor s = src.contiguous();
  const Tensor d = dst.is_contiguous() ? dst : Tensor::empty(dst.shape(), dst.dtype(), dst.device());
  const size_t bytes = (size_t)d.nbytes();
  const char* sp = static_cast<const char*>(s.data_ptr());
  char* dp = static_cast<char*>(d.data_ptr());
  for (size_t off = 0; off < bytes; off += kChunk) {
    const size_t n = std::min(kChunk, bytes - off);
    PinnedBuffer* b = pinned_acquire(n);
    std::memcpy(b->ptr, sp + off, n);
    const cudaError_t e = cudaMemcpyAsync(dp + off, b->ptr, n, cudaMemcpyHostToDevice, (cudaStream_t)stream);
    if (e == cudaSuccess) pinned_record(b, stream);
    pinned_release(b);
    TALLOW_CUDA_CHECK("copy_ (host to device)", e);
  }
  if (!dst.is_contiguous()) strided_copy(dst, d, stream);
}

void copy_d2h(const Tensor& dst, const Tensor& src) {
  DeviceGuard g(src.device().index);
  const StreamHandle stream = current_stream(src.device().index);
  no_capture("device-to-host", stream);
  const Tensor s = contiguous(src);
  const Tensor d = dst.is_contiguous() ? dst : Tensor::empty(dst.shape(), dst.dtype(), Device{});
  const size_t bytes = (size_t)d.nbytes();
  const char* sp = static_cast<const char*>(s.data_ptr());
  char* dp = static_cast<char*>(d.data_ptr());
  const size_t nchunks = (bytes + kChunk - 1) / kChunk;
  PinnedBuffer* bufs[2] = {nullptr, nullptr};
  auto issue = [&](size_t i) {
    const size_t off = i * kChunk, n = std::min(kChunk, bytes - off);
    PinnedBuffer* b = pinned_acquire(n);
    bufs[i & 1] = b;
    TALLOW_CUDA_CHECK("copy_ (device to host)",
                      cudaMemcpyAsync(b->ptr, sp + off, n, cudaMemcpyDeviceToHost, (cudaStream_t)stream));
    pinned_record(b, stream);
  };
  try {
    if (nchunks) issue(0);
    for (size_t i = 0; i < nchunks; ++i) {
      if (i + 1 < nchunks) issue(i + 1);  // the next chunk moves while this one is copied out
      PinnedBuffer* b = bufs[i & 1];
      TALLOW_CUDA_CHECK("copy_ (device to host)", cudaEventSynchronize((cudaEvent_t)b->event));
      const size_t off = i * kChunk, n = std::min(kChunk, bytes - off);
      std::memcpy(dp + off, b->ptr, n);
      bufs[i & 1] = nullptr;
      pinned_release(b);
    }
  } catch (...) {
    for (auto* b : bufs)
      if (b) pinned_release(b);
    throw;
  }
  if (!dst.is_contiguous()) const_cast<Tensor&>(dst).copy_(d);
}

void copy_d2d(const Tensor& dst, const Tensor& src) {
  if (dst.numel() == 0) return;
  if (dst.device() == src.device()) {
    DeviceGuard g(dst.device().index);
    strided_copy(dst, src, current_stream(dst.device().index));
    return;
  }
  // Across devices: contiguous on both sides, a peer copy ordered after the source's current stream.
  const Tensor s = [&] {
    DeviceGuard g(src.device().index);
    Tensor c = contiguous(src);
    TALLOW_CUDA_CHECK("copy_ (peer)", cudaStreamSynchronize((cudaStream_t)current_stream(src.device().index)));
    return c;
  }();
  DeviceGuard g(dst.device().index);
  const StreamHandle stream = current_stream(dst.device().index);
  const Tensor d = dst.is_contiguous() ? dst : Tensor::empty(dst.shape(), dst.dtype(), dst.device());
  TALLOW_CUDA_CHECK("copy_ (peer)", cudaMemcpyPeerAsync(d.data_ptr(), dst.device().index, s.data_ptr(),
                                                        src.device().index, (size_t)d.nbytes(), (cudaStream_t)stream));
  if (!dst.is_contiguous()) strided_copy(dst, d, stream);
  // `s` may be freed when this returns: wait so its block is not reused under the copy.
  TALLOW_CUDA_CHECK("copy_ (peer)", cudaStreamSynchronize((cudaStream_t)stream));
}

}  // namespace

void register_copies() {
  register_copy(DeviceType::CUDA, DeviceType::CPU, copy_h2d);
  register_copy(DeviceType::CPU, DeviceType::CUDA, copy_d2h);
  register_copy(DeviceType::CUDA, DeviceType::CUDA, copy_d2d);
}

}  // namespace tallow::cuda
