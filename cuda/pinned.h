// Pinned (page-locked) host staging buffers for host<->device copies (internal header).
// A buffer handed back is reused only once the work recorded on its event is done.
#pragma once
#include <cstddef>

#include "runtime.h"

namespace tallow::cuda {

struct PinnedBuffer {
  void* ptr = nullptr;
  size_t size = 0;
  void* event = nullptr;  // cudaEvent_t, on device `device`
  int device = -1;
};

// A buffer of at least nbytes whose last use is complete. At most kPinnedPerClass buffers of one size
// class exist; when all are busy, this waits for the oldest.
constexpr int kPinnedPerClass = 4;
PinnedBuffer* pinned_acquire(size_t nbytes);
void pinned_record(PinnedBuffer* b, StreamHandle s);  // marks the buffer busy until s reaches this point
void pinned_release(PinnedBuffer* b);                  // back to the cache (busy until its event completes)

}  // namespace tallow::cuda
