// CUDA graphs: capture the work a thread issues on one stream (ops called from Python included),
// then replay it. Allocations made during the capture come from the graph's pool (allocator.h), so
// the addresses baked into the graph stay valid and reserved for replays; update the static inputs
// in place (copy_) between replays and read the outputs captured tensors point at.
#include <cuda_runtime_api.h>

#include "allocator.h"
#include "check.h"
#include "core/error.h"
#include "runtime.h"

namespace tallow::cuda {

Graph::Graph() = default;

Graph::~Graph() {
  try {
    reset();
  } catch (...) {
  }
}

void Graph::capture_begin(StreamHandle s, std::shared_ptr<GraphPool> pool) {
  TALLOW_CHECK(!capturing_, "CUDAGraph.capture_begin: already capturing");
  TALLOW_CHECK(!exec_, "CUDAGraph.capture_begin: this graph was already captured; call reset() first");
  TALLOW_CHECK(s != nullptr, "CUDAGraph.capture_begin: capture needs a created stream, not the default stream");
  device_ = current_device();
  if (!pool) pool = new_graph_pool(device_);
  TALLOW_CHECK(pool->device() == device_, "CUDAGraph.capture_begin: pool is on cuda:", pool->device(),
               " but the current device is cuda:", device_);
  pool_ = pool;
  stream_ = s;
  // Work queued on s before the capture must not be recorded into the graph: wait for it here.
  TALLOW_CUDA_CHECK("CUDAGraph.capture_begin", cudaStreamSynchronize((cudaStream_t)s));
  set_capture_pool(device_, pool_.get());
  const cudaError_t e = cudaStreamBeginCapture((cudaStream_t)s, cudaStreamCaptureModeRelaxed);
  if (e != cudaSuccess) {
    set_capture_pool(device_, nullptr);
    TALLOW_CUDA_CHECK("CUDAGraph.capture_begin", e);
  }
  capturing_ = true;
}

void Graph::capture_end() {
  TALLOW_CHECK(capturing_, "CUDAGraph.capture_end: not capturing");
  capturing_ = false;
  set_capture_pool(device_, nullptr);
  cudaGraph_t g = nullptr;
  TALLOW_CUDA_CHECK("CUDAGraph.capture_end", cudaStreamEndCapture((cudaStream_t)stream_, &g));
  graph_ = g;
  cudaGraphExec_t ex = nullptr;
  TALLOW_CUDA_CHECK("CUDAGraph.capture_end", cudaGraphInstantiate(&ex, g, 0));
  exec_ = ex;
}

void Graph::replay(StreamHandle s) {
  TALLOW_CHECK(exec_, "CUDAGraph.replay: nothing captured");
  DeviceGuard g(device_);
  TALLOW_CUDA_CHECK("CUDAGraph.replay", cudaGraphLaunch((cudaGraphExec_t)exec_, (cudaStream_t)s));
}

int64_t Graph::num_nodes() const {
  if (!graph_) return 0;
  size_t n = 0;
  TALLOW_CUDA_CHECK("CUDAGraph.num_nodes", cudaGraphGetNodes((cudaGraph_t)graph_, nullptr, &n));
  return (int64_t)n;
}

void Graph::reset() {
  if (capturing_) {
    capturing_ = false;
    set_capture_pool(device_, nullptr);
    cudaGraph_t g = nullptr;
    (void)cudaStreamEndCapture((cudaStream_t)stream_, &g);
    (void)cudaGetLastError();
    if (g) (void)cudaGraphDestroy(g);
  }
  if (exec_) (void)cudaGraphExecDestroy((cudaGraphExec_t)exec_);
  if (graph_) (void)cudaGraphDestroy((cudaGraph_t)graph_);
  exec_ = graph_ = nullptr;
  pool_.reset();
}

}  // namespace tallow::cuda
