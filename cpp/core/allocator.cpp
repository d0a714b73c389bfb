#include "core/allocator.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <new>
#include <vector>

#include "core/error.h"
#include "core/tuning.h"

namespace tallow {

namespace {

// Host memory, 64-byte aligned. Large blocks (>= 1 MiB) are kept in size-class free lists when
// freed, up to a cap (TALLOW_CPU_CACHE_MB, default 1024): a model step allocates the same
// activation sizes every time, and fresh pages from the OS cost a page fault each on first touch.
class CpuAllocator final : public Allocator {
 public:
  static constexpr size_t kAlignment = 64;
  static constexpr size_t kCacheMin = 1 << 20;

  CpuAllocator() {
    cache_limit_ = (size_t)std::max<int64_t>(0, kernel_tuning().cpu_cache_mb) << 20;
  }
  ~CpuAllocator() override { empty_cache(); }

  // Size classes above 1 MiB: 8 steps per power of two (at most 12.5% slack).
  static size_t size_class(size_t n) {
    if (n < kCacheMin) return std::max<size_t>(kAlignment, (n + kAlignment - 1) / kAlignment * kAlignment);
    size_t p = 1;
    while (p * 2 <= n) p *= 2;
    const size_t step = p / 8;
    return (n + step - 1) / step * step;
  }

  void* allocate(size_t nbytes, Device) override {
    const size_t cls = size_class(nbytes);
    void* p = nullptr;
    if (cls >= kCacheMin) {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = free_.find(cls);
      if (it != free_.end() && !it->second.empty()) {
        p = it->second.back();
        it->second.pop_back();
        cached_ -= cls;
      }
    }
    if (!p) {
      p = std::aligned_alloc(kAlignment, cls);
      if (!p) {
        empty_cache();
        p = std::aligned_alloc(kAlignment, cls);
        if (!p) throw std::bad_alloc();
      }
    }
    const int64_t now = allocated_.fetch_add((int64_t)cls) + (int64_t)cls;
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {}
    num_allocs_.fetch_add(1);
    return p;
  }

  void deallocate(void* ptr, size_t nbytes, Device) override {
    const size_t cls = size_class(nbytes);
    allocated_.fetch_sub((int64_t)cls);
    if (cls >= kCacheMin) {
      std::lock_guard<std::mutex> lk(mu_);
      if (cached_ + cls <= cache_limit_) {
        free_[cls].push_back(ptr);
        cached_ += cls;
        return;
      }
    }
    std::free(ptr);
  }

  AllocatorStats stats() const override {
    AllocatorStats s;
    s.allocated_bytes = allocated_.load();
    {
      std::lock_guard<std::mutex> lk(mu_);
      s.reserved_bytes = s.allocated_bytes + (int64_t)cached_;
    }
    s.peak_allocated_bytes = peak_.load();
    s.num_allocs = num_allocs_.load();
    return s;
  }

  void empty_cache() override {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& [cls, list] : free_)
      for (void* p : list) std::free(p);
    free_.clear();
    cached_ = 0;
  }

 private:
  mutable std::mutex mu_;
  std::map<size_t, std::vector<void*>> free_;
  size_t cached_ = 0, cache_limit_ = 0;
  std::atomic<int64_t> allocated_{0}, peak_{0}, num_allocs_{0};
};

Allocator* g_allocators[3] = {nullptr, nullptr, nullptr};

}  // namespace

Allocator* get_allocator(DeviceType type) {
  static CpuAllocator* cpu = new CpuAllocator();  // never destroyed: tensors may outlive static teardown
  if (type == DeviceType::CPU) return g_allocators[0] ? g_allocators[0] : cpu;
  Allocator* a = g_allocators[(int)type];
  TALLOW_CHECK(a != nullptr, "this build of tallow has no ", (type == DeviceType::CUDA ? "CUDA" : "Metal"),
               " backend");
  return a;
}

void set_allocator(DeviceType type, Allocator* allocator) { g_allocators[(int)type] = allocator; }

}  // namespace tallow
