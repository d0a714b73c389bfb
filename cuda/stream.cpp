// Streams and events. The current stream is per thread and per device; ops launch on it.
#include <cuda_runtime_api.h>

#include <mutex>
#include <set>
#include <vector>

#include "check.h"
#include "core/error.h"
#include "runtime.h"

namespace tallow::cuda {

namespace {
std::vector<StreamHandle>& current_streams() {
  thread_local std::vector<StreamHandle> s;
  return s;
}
}  // namespace

StreamHandle current_stream(int device) {
  if (device < 0) device = current_device();
  auto& v = current_streams();
  return (size_t)device < v.size() ? v[(size_t)device] : nullptr;
}

void set_current_stream(StreamHandle s, int device) {
  if (device < 0) device = current_device();
  auto& v = current_streams();
  if ((size_t)device >= v.size()) v.resize((size_t)device + 1, nullptr);
  v[(size_t)device] = s;
}

bool is_capturing(StreamHandle s) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  TALLOW_CUDA_CHECK("is_capturing", cudaStreamIsCapturing((cudaStream_t)s, &st));
  return st != cudaStreamCaptureStatusNone;
}

namespace {
std::mutex& private_mu() {
  static std::mutex mu;
  return mu;
}
std::set<StreamHandle>& private_streams() {
  static std::set<StreamHandle> s;
  return s;
}
}  // namespace

void set_private_scratch(StreamHandle s) {
  TALLOW_CHECK(s != nullptr, "set_private_scratch: the default stream shares the device's scratch");
  std::lock_guard<std::mutex> lk(private_mu());
  private_streams().insert(s);
}

StreamHandle scratch_key(StreamHandle s) {
  std::lock_guard<std::mutex> lk(private_mu());
  return private_streams().count(s) ? s : nullptr;
}

Stream::Stream(int device, int priority) {
  device_ = device < 0 ? current_device() : device;
  DeviceGuard g(device_);
  cudaStream_t s = nullptr;
  TALLOW_CUDA_CHECK("Stream", cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, priority));
  handle_ = s;
  owned_ = true;
}

std::shared_ptr<Stream> Stream::wrap(StreamHandle s, int device) {
  return std::shared_ptr<Stream>(new Stream(s, device < 0 ? current_device() : device, false));
}

Stream::~Stream() {
  if (owned_ && handle_) {
    DeviceGuard g(device_);
    (void)cudaStreamDestroy((cudaStream_t)handle_);
  }
}

void Stream::synchronize() const {
  TALLOW_CUDA_CHECK("Stream.synchronize", cudaStreamSynchronize((cudaStream_t)handle_));
}

bool Stream::query() const {
  const cudaError_t e = cudaStreamQuery((cudaStream_t)handle_);
  if (e == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  TALLOW_CUDA_CHECK("Stream.query", e);
  return true;
}

void Stream::wait_stream(const Stream& other) const {
  Event e;
  e.record(other.handle());
  e.wait(handle_);
}

Event::Event(bool enable_timing) {
  device_ = current_device();
  cudaEvent_t e = nullptr;
  TALLOW_CUDA_CHECK("Event", cudaEventCreateWithFlags(&e, enable_timing ? cudaEventDefault : cudaEventDisableTiming));
  ev_ = e;
}

Event::~Event() {
  if (ev_) (void)cudaEventDestroy((cudaEvent_t)ev_);
}

void Event::record(StreamHandle s) {
  TALLOW_CUDA_CHECK("Event.record", cudaEventRecord((cudaEvent_t)ev_, (cudaStream_t)s));
  recorded_ = true;
}

void Event::wait(StreamHandle s) const {
  TALLOW_CUDA_CHECK("Event.wait", cudaStreamWaitEvent((cudaStream_t)s, (cudaEvent_t)ev_, 0));
}

void Event::synchronize() const {
  TALLOW_CUDA_CHECK("Event.synchronize", cudaEventSynchronize((cudaEvent_t)ev_));
}

bool Event::query() const {
  const cudaError_t e = cudaEventQuery((cudaEvent_t)ev_);
  if (e == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  TALLOW_CUDA_CHECK("Event.query", e);
  return true;
}

float Event::elapsed_ms(const Event& end) const {
  TALLOW_CHECK(recorded_ && end.recorded_, "Event.elapsed_time: both events must be recorded first");
  float ms = 0.f;
  TALLOW_CUDA_CHECK("Event.elapsed_time", cudaEventElapsedTime(&ms, (cudaEvent_t)ev_, (cudaEvent_t)end.ev_));
  return ms;
}

}  // namespace tallow::cuda
