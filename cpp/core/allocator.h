// Memory for tensors. Each device type has one Allocator; the CPU one hands out 64-byte aligned
// host memory. A caching device allocator (size classes, stream-ordered reuse) registers itself
// for its device type through set_allocator and keeps its statistics behind stats().
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/device.h"

namespace tallow {

struct AllocatorStats {
  int64_t allocated_bytes = 0;  // live allocations
  int64_t reserved_bytes = 0;   // held from the system (>= allocated for a caching allocator)
  int64_t peak_allocated_bytes = 0;
  int64_t num_allocs = 0;
};

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(size_t nbytes, Device device) = 0;
  virtual void deallocate(void* ptr, size_t nbytes, Device device) = 0;
  virtual AllocatorStats stats() const = 0;
  virtual void empty_cache() {}
};

Allocator* get_allocator(DeviceType type);  // ValueError when this build has no backend for it
void set_allocator(DeviceType type, Allocator* allocator);

}  // namespace tallow
