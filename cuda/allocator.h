// The caching device allocator (internal header).
//
// Sizes are rounded to classes (512 B steps up to 1 MiB, 2 MiB steps above) and every block is one
// cudaMalloc. A freed block is cached on the free list of the stream it was allocated on and reused
// for a later allocation on that stream: work on one stream runs in order, so the next user of the
// block cannot overtake the last one (stream-ordered reuse). Using a tensor on another stream than
// the one it was allocated on needs the caller to order the streams (Stream.wait_stream / events).
// When cudaMalloc fails, cached blocks are released and the allocation is retried once.
//
// While a thread captures a CUDA graph, its allocations on the capturing device come from the
// graph's pool instead: blocks that stay reserved (and keep their addresses) for replays, reused only
// by later allocations of captures into the same pool, and released when the pool's last owner is gone.
#pragma once
#include <memory>

#include "runtime.h"

namespace tallow::cuda {

// Route this thread's allocations on `device` to `pool` (nullptr: back to the shared cache).
void set_capture_pool(int device, GraphPool* pool);

// Registers the allocator for DeviceType::CUDA (called from init()).
void register_caching_allocator();

}  // namespace tallow::cuda
