// The CUDA runtime of tallow's core, as a plain C++ API (no CUDA headers, so the bindings and the
// op dispatch in cpp/ compile without them): devices, streams and events, the caching device
// allocator's statistics, and CUDA graphs. Streams are passed as opaque handles (cudaStream_t).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

namespace tallow::cuda {

using StreamHandle = void*;  // cudaStream_t; nullptr is the legacy default stream

// Registers the caching allocator for DeviceType::CUDA and the host<->device copies. Idempotent;
// called when tallow._core is imported and by C++ programs before they make CUDA tensors.
void init();

// ---- devices ---------------------------------------------------------------------------------
bool is_available();        // a driver and at least one device
int device_count();         // 0 when none (never raises)
int current_device();       // this thread's device (default 0)
void set_device(int device);
std::pair<size_t, size_t> mem_get_info(int device = -1);  // (free, total) bytes
void synchronize(int device = -1);                          // -1: the current device

struct DeviceProperties {
  std::string name;
  int major = 0, minor = 0;
  int multiprocessors = 0;
  size_t total_memory = 0;
  int l2_cache_bytes = 0;
  int shared_memory_per_block_optin = 0;
  int memory_bus_width = 0;
};
DeviceProperties device_properties(int device = -1);

// Sets the current device for a scope, restoring the previous one at exit.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
};

// ---- streams and events ------------------------------------------------------------------------
// Every op runs on the current stream of its tensors' device (per thread; default: the legacy
// default stream). Capturing a graph needs a created (non-default) stream.
StreamHandle current_stream(int device = -1);
void set_current_stream(StreamHandle s, int device = -1);
bool is_capturing(StreamHandle s);
// Streams whose ops may run at the same time as another stream's (the engine's second decode stream,
// engine/runner.py): each gets its own cuBLASLt workspace and decode-attention split counters. Every
// other stream of a device shares one of each, so ops on those run one stream at a time.
void set_private_scratch(StreamHandle s);
// The key a stream's scratch is kept under: s when it was made private, else nullptr (shared).
StreamHandle scratch_key(StreamHandle s);

class Stream {
 public:
  // A new non-blocking stream on `device` (-1: current); priority 0 is the default, lower is higher.
  explicit Stream(int device = -1, int priority = 0);
  // Wraps an existing stream (not destroyed here), e.g. the default stream (nullptr).
  static std::shared_ptr<Stream> wrap(StreamHandle s, int device);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  StreamHandle handle() const { return handle_; }
  int device() const { return device_; }
  void synchronize() const;
  bool query() const;  // true when all work is done
  void wait_stream(const Stream& other) const;

 private:
  Stream(StreamHandle h, int device, bool owned) : handle_(h), device_(device), owned_(owned) {}
  StreamHandle handle_ = nullptr;
  int device_ = 0;
  bool owned_ = false;
};

class Event {
 public:
  explicit Event(bool enable_timing = false);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  void record(StreamHandle s);
  void wait(StreamHandle s) const;  // make stream s wait for this event
  void synchronize() const;
  bool query() const;
  float elapsed_ms(const Event& end) const;  // this event to `end`, both recorded and complete
  void* handle() const { return ev_; }

 private:
  void* ev_ = nullptr;
  int device_ = 0;
  bool recorded_ = false;
};

// ---- memory ---------------------------------------------------------------------------------------
struct MemoryStats {
  int64_t allocated_bytes = 0;       // bytes in live blocks (rounded sizes)
  int64_t requested_bytes = 0;       // bytes asked for by live allocations
  int64_t reserved_bytes = 0;        // bytes held from cudaMalloc (live + cached + graph pools)
  int64_t peak_allocated_bytes = 0;
  int64_t peak_reserved_bytes = 0;
  int64_t num_allocs = 0;            // allocate() calls
  int64_t num_frees = 0;
  int64_t num_cache_hits = 0;        // allocations served from cached blocks
  int64_t num_device_mallocs = 0;    // cudaMalloc calls
  int64_t num_device_frees = 0;      // cudaFree calls
  int64_t cached_bytes = 0;          // free blocks kept for reuse
  int64_t graph_pool_bytes = 0;      // reserved bytes owned by graph pools
};
MemoryStats memory_stats(int device = -1);
void reset_peak_memory_stats(int device = -1);
void empty_cache();  // returns cached free blocks (not graph pools') to the driver

// Pinned host staging buffers (held for reuse by host<->device copies).
int64_t pinned_bytes_reserved();

// ---- CUDA graphs ---------------------------------------------------------------------------------
// A memory pool owned by one or more graphs: allocations made while capturing come from it and stay
// reserved for replays. Pass the same pool to several captures to share memory between graphs that
// never run concurrently.
struct PoolState;
class GraphPool {
 public:
  explicit GraphPool(int device);
  ~GraphPool();
  GraphPool(const GraphPool&) = delete;
  GraphPool& operator=(const GraphPool&) = delete;
  int device() const { return device_; }
  PoolState* state() const { return state_; }

 private:
  int device_;
  PoolState* state_;
};
std::shared_ptr<GraphPool> new_graph_pool(int device = -1);

class Graph {
 public:
  Graph();
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  // Starts capturing the calling thread's work on stream s (a created stream, not the default one).
  void capture_begin(StreamHandle s, std::shared_ptr<GraphPool> pool = nullptr);
  void capture_end();
  void replay(StreamHandle s);  // launches the captured work on s (nullptr: the legacy default stream)
  void reset();                 // drops the graph and releases its pool (if no other graph shares it)
  bool captured() const { return exec_ != nullptr; }
  std::shared_ptr<GraphPool> pool() const { return pool_; }
  int64_t num_nodes() const;

 private:
  void* graph_ = nullptr;  // cudaGraph_t
  void* exec_ = nullptr;   // cudaGraphExec_t
  StreamHandle stream_ = nullptr;
  int device_ = 0;
  bool capturing_ = false;
  std::shared_ptr<GraphPool> pool_;
};

}  // namespace tallow::cuda
