// The caching device allocator (see allocator.h).
#include "allocator.h"

#include <cuda_runtime_api.h>

#include <map>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "check.h"
#include "core/allocator.h"
#include "core/error.h"

namespace tallow::cuda {

struct Block {
  void* ptr = nullptr;
  size_t size = 0;       // rounded size (what cudaMalloc gave)
  size_t requested = 0;  // live allocation's request
  int device = 0;
  cudaStream_t stream = nullptr;
  PoolState* pool = nullptr;
  bool in_use = false;
};

struct PoolState {
  int device = 0;
  // Free blocks by the stream that allocated them: a capture that forks work onto a second stream
  // must not hand one stream's freed block to the other, whose replayed kernels may run concurrently.
  std::map<cudaStream_t, std::multimap<size_t, Block*>> free_blocks;
  std::unordered_set<Block*> blocks;
  bool released = false;  // its owner (GraphPool) is gone: free blocks go back to the driver
};

namespace {

constexpr size_t kSmall = size_t(1) << 20;     // <= 1 MiB: 512-byte classes
constexpr size_t kLargeStep = size_t(2) << 20;  // above: 2 MiB classes

size_t round_size(size_t n) {
  if (n <= 512) return 512;
  if (n <= kSmall) return (n + 511) / 512 * 512;
  return (n + kLargeStep - 1) / kLargeStep * kLargeStep;
}

struct StreamKey {
  int device;
  cudaStream_t stream;
  bool operator<(const StreamKey& o) const {
    return device != o.device ? device < o.device : (uintptr_t)stream < (uintptr_t)o.stream;
  }
};

thread_local std::vector<GraphPool*> t_capture_pool;

class CachingAllocator final : public Allocator {
 public:
  void* allocate(size_t nbytes, Device device) override {
    if (nbytes == 0) return nullptr;
    const int dev = device.index;
    const size_t size = round_size(nbytes);
    GraphPool* gp = (size_t)dev < t_capture_pool.size() ? t_capture_pool[(size_t)dev] : nullptr;
    const cudaStream_t stream = (cudaStream_t)current_stream(dev);
    std::lock_guard<std::mutex> lk(mu_);
    MemoryStats& st = stats_for(dev);
    st.num_allocs++;
    Block* b = nullptr;
    if (gp) {
      b = take(gp->state()->free_blocks[stream], size);
    } else {
      auto it = free_.find(StreamKey{dev, stream});
      if (it != free_.end()) b = take(it->second, size);
    }
    if (b) {
      st.num_cache_hits++;
      st.cached_bytes -= gp ? 0 : (int64_t)b->size;
    } else {
      void* ptr = device_malloc(dev, size, nbytes, gp != nullptr);
      b = new Block;
      b->ptr = ptr;
      b->size = size;
      b->device = dev;
      b->stream = stream;
      st.reserved_bytes += (int64_t)size;
      st.peak_reserved_bytes = std::max(st.peak_reserved_bytes, st.reserved_bytes);
      if (gp) {
        b->pool = gp->state();
        b->pool->blocks.insert(b);
        st.graph_pool_bytes += (int64_t)size;
      }
      live_.emplace(b->ptr, b);
    }
    b->in_use = true;
    b->requested = nbytes;
    st.allocated_bytes += (int64_t)b->size;
    st.requested_bytes += (int64_t)nbytes;
    st.peak_allocated_bytes = std::max(st.peak_allocated_bytes, st.allocated_bytes);
    return b->ptr;
  }

  void deallocate(void* ptr, size_t, Device) override {
    if (!ptr) return;
    std::lock_guard<std::mutex> lk(mu_);
    auto it = live_.find(ptr);
    if (it == live_.end()) return;  // not ours (cannot happen for storage made by this allocator)
    Block* b = it->second;
    MemoryStats& st = stats_for(b->device);
    st.num_frees++;
    st.allocated_bytes -= (int64_t)b->size;
    st.requested_bytes -= (int64_t)b->requested;
    b->in_use = false;
    if (b->pool) {
      PoolState* p = b->pool;
      if (p->released) {
        free_block(b);
        maybe_delete_pool(p);
      } else {
        p->free_blocks[b->stream].emplace(b->size, b);
      }
      return;
    }
    free_[StreamKey{b->device, b->stream}].emplace(b->size, b);
    st.cached_bytes += (int64_t)b->size;
  }

  AllocatorStats stats() const override {
    std::lock_guard<std::mutex> lk(mu_);
    int dev = 0;
    (void)cudaGetDevice(&dev);
    AllocatorStats s;
    if ((size_t)dev < stats_.size()) {
      s.allocated_bytes = stats_[(size_t)dev].allocated_bytes;
      s.reserved_bytes = stats_[(size_t)dev].reserved_bytes;
      s.peak_allocated_bytes = stats_[(size_t)dev].peak_allocated_bytes;
      s.num_allocs = stats_[(size_t)dev].num_allocs;
    }
    return s;
  }

  void empty_cache() override {
    std::lock_guard<std::mutex> lk(mu_);
    release_cached(-1);
  }

  MemoryStats device_stats(int dev) {
    std::lock_guard<std::mutex> lk(mu_);
    return stats_for(dev);
  }

  void reset_peak(int dev) {
    std::lock_guard<std::mutex> lk(mu_);
    MemoryStats& st = stats_for(dev);
    st.peak_allocated_bytes = st.allocated_bytes;
    st.peak_reserved_bytes = st.reserved_bytes;
  }

  PoolState* new_pool(int dev) {
    std::lock_guard<std::mutex> lk(mu_);
    auto* p = new PoolState;
    p->device = dev;
    return p;
  }

  void release_pool(PoolState* p) {
    std::lock_guard<std::mutex> lk(mu_);
    p->released = true;
    for (auto& per_stream : p->free_blocks)
      for (auto& kv : per_stream.second) free_block(kv.second);
    p->free_blocks.clear();
    maybe_delete_pool(p);
  }

 private:
  MemoryStats& stats_for(int dev) {
    if ((size_t)dev >= stats_.size()) stats_.resize((size_t)dev + 1);
    return stats_[(size_t)dev];
  }

  // Best fit within the size class tolerance: exact for small classes, up to +25% for large ones.
  static Block* take(std::multimap<size_t, Block*>& m, size_t size) {
    auto it = m.lower_bound(size);
    if (it == m.end()) return nullptr;
    const size_t limit = size <= kSmall ? size : size + size / 4;
    if (it->first > limit) return nullptr;
    Block* b = it->second;
    m.erase(it);
    return b;
  }

  void* device_malloc(int dev, size_t size, size_t requested, bool capturing) {
    DeviceGuard g(dev);
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, size);
    if (e == cudaErrorMemoryAllocation && !capturing) {
      (void)cudaGetLastError();
      release_cached(dev);  // give cached blocks back and try once more
      e = cudaMalloc(&p, size);
    }
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      size_t free_b = 0, total = 0;
      (void)cudaMemGetInfo(&free_b, &total);
      (void)cudaGetLastError();
      const MemoryStats& st = stats_for(dev);
      throw CudaError(str_cat("CUDA out of memory on cuda:", dev, ": tried to allocate ", requested, " bytes (",
                              size >> 20, " MiB); tallow holds ", st.allocated_bytes >> 20, " MiB allocated, ",
                              st.reserved_bytes >> 20, " MiB reserved; the device has ", free_b >> 20, " MiB free of ",
                              total >> 20, " MiB"));
    }
    TALLOW_CUDA_CHECK("allocate", e);
    stats_for(dev).num_device_mallocs++;
    return p;
  }

  void free_block(Block* b) {
    MemoryStats& st = stats_for(b->device);
    {
      DeviceGuard g(b->device);
      TALLOW_CUDA_CHECK("free", cudaFree(b->ptr));
    }
    st.num_device_frees++;
    st.reserved_bytes -= (int64_t)b->size;
    if (b->pool) {
      st.graph_pool_bytes -= (int64_t)b->size;
      b->pool->blocks.erase(b);
    }
    live_.erase(b->ptr);
    delete b;
  }

  void maybe_delete_pool(PoolState* p) {
    if (p->released && p->blocks.empty()) delete p;
  }

  // Frees the cached blocks of the shared cache (dev < 0: every device).
  void release_cached(int dev) {
    for (auto it = free_.begin(); it != free_.end();) {
      if (dev >= 0 && it->first.device != dev) {
        ++it;
        continue;
      }
      for (auto& kv : it->second) {
        stats_for(kv.second->device).cached_bytes -= (int64_t)kv.second->size;
        free_block(kv.second);
      }
      it = free_.erase(it);
    }
  }

  mutable std::mutex mu_;
  std::map<StreamKey, std::multimap<size_t, Block*>> free_;
  std::unordered_map<void*, Block*> live_;  // every block we hold, by address
  std::vector<MemoryStats> stats_;
};

CachingAllocator& allocator() {
  static CachingAllocator* a = new CachingAllocator;  // never destroyed: storage may outlive statics
  return *a;
}

}  // namespace

GraphPool::GraphPool(int device) : device_(device), state_(allocator().new_pool(device)) {}
GraphPool::~GraphPool() { allocator().release_pool(state_); }

std::shared_ptr<GraphPool> new_graph_pool(int device) {
  return std::make_shared<GraphPool>(device < 0 ? current_device() : device);
}

void set_capture_pool(int device, GraphPool* pool) {
  if ((size_t)device >= t_capture_pool.size()) t_capture_pool.resize((size_t)device + 1, nullptr);
  t_capture_pool[(size_t)device] = pool;
}

void register_caching_allocator() { set_allocator(DeviceType::CUDA, &allocator()); }

MemoryStats memory_stats(int device) { return allocator().device_stats(device < 0 ? current_device() : device); }
void reset_peak_memory_stats(int device) { allocator().reset_peak(device < 0 ? current_device() : device); }
void empty_cache() { allocator().empty_cache(); }

}  // namespace tallow::cuda
