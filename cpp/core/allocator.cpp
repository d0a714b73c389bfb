#include "core/allocator.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <new>

#include "core/error.h"

namespace tallow {

namespace {

class CpuAllocator final : public Allocator {
 public:
  static constexpr size_t kAlignment = 64;

  void* allocate(size_t nbytes, Device) override {
    const size_t rounded = std::max<size_t>(kAlignment, (nbytes + kAlignment - 1) / kAlignment * kAlignment);
    void* p = std::aligned_alloc(kAlignment, rounded);
    if (!p) throw std::bad_alloc();
    const int64_t now = allocated_.fetch_add((int64_t)nbytes) + (int64_t)nbytes;
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {}
    num_allocs_.fetch_add(1);
    return p;
  }
  void deallocate(void* ptr, size_t nbytes, Device) override {
    std::free(ptr);
    allocated_.fetch_sub((int64_t)nbytes);
  }
  AllocatorStats stats() const override {
    AllocatorStats s;
    s.allocated_bytes = s.reserved_bytes = allocated_.load();
    s.peak_allocated_bytes = peak_.load();
    s.num_allocs = num_allocs_.load();
    return s;
  }

 private:
  std::atomic<int64_t> allocated_{0}, peak_{0}, num_allocs_{0};
};

Allocator* g_allocators[3] = {nullptr, nullptr, nullptr};

}  // namespace

Allocator* get_allocator(DeviceType type) {
  static CpuAllocator cpu;
  if (type == DeviceType::CPU) return g_allocators[0] ? g_allocators[0] : &cpu;
  Allocator* a = g_allocators[(int)type];
  TALLOW_CHECK(a != nullptr, "this build of tallow has no ", (type == DeviceType::CUDA ? "CUDA" : "Metal"),
               " backend");
  return a;
}

void set_allocator(DeviceType type, Allocator* allocator) { g_allocators[(int)type] = allocator; }

}  // namespace tallow
