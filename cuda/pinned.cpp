// Pinned host staging buffers (see pinned.h): power-of-two sizes from 64 KiB, cached for reuse.
#include "pinned.h"

#include <cuda_runtime_api.h>

#include <deque>
#include <map>
#include <mutex>

#include "check.h"

namespace tallow::cuda {

namespace {

std::mutex g_mu;
std::deque<PinnedBuffer*> g_free;    // released buffers, oldest first
std::map<size_t, int> g_count;       // buffers per size class
int64_t g_reserved = 0;

size_t pinned_class(size_t n) {
  size_t s = size_t(64) << 10;
  while (s < n) s <<= 1;
  return s;
}

bool idle(PinnedBuffer* b) {
  if (!b->event) return true;
  const cudaError_t e = cudaEventQuery((cudaEvent_t)b->event);
  if (e == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  TALLOW_CUDA_CHECK("pinned staging", e);
  return true;
}

}  // namespace

PinnedBuffer* pinned_acquire(size_t nbytes) {
  const size_t size = pinned_class(nbytes);
  PinnedBuffer* oldest = nullptr;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    for (auto it = g_free.begin(); it != g_free.end(); ++it) {
      PinnedBuffer* b = *it;
      if (b->size != size) continue;
      if (!oldest) oldest = b;
      if (idle(b)) {
        g_free.erase(it);
        return b;
      }
    }
    if (oldest && g_count[size] >= kPinnedPerClass) {
      for (auto it = g_free.begin(); it != g_free.end(); ++it)
        if (*it == oldest) {
          g_free.erase(it);
          break;
        }
    } else {
      oldest = nullptr;
      g_count[size]++;
      g_reserved += (int64_t)size;
    }
  }
  if (oldest) {
    TALLOW_CUDA_CHECK("pinned staging", cudaEventSynchronize((cudaEvent_t)oldest->event));
    return oldest;
  }
  auto* b = new PinnedBuffer;
  b->size = size;
  TALLOW_CUDA_CHECK("pinned staging", cudaHostAlloc(&b->ptr, size, cudaHostAllocPortable));
  return b;
}

void pinned_record(PinnedBuffer* b, StreamHandle s) {
  int dev = 0;
  TALLOW_CUDA_CHECK("pinned staging", cudaGetDevice(&dev));
  if (b->event && b->device != dev) {
    (void)cudaEventDestroy((cudaEvent_t)b->event);
    b->event = nullptr;
  }
  if (!b->event) {
    cudaEvent_t ev = nullptr;
    TALLOW_CUDA_CHECK("pinned staging", cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    b->event = ev;
    b->device = dev;
  }
  TALLOW_CUDA_CHECK("pinned staging", cudaEventRecord((cudaEvent_t)b->event, (cudaStream_t)s));
}

void pinned_release(PinnedBuffer* b) {
  std::lock_guard<std::mutex> lk(g_mu);
  g_free.push_back(b);
}

int64_t pinned_bytes_reserved() {
  std::lock_guard<std::mutex> lk(g_mu);
  return g_reserved;
}

}  // namespace tallow::cuda
