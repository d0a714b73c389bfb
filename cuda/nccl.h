// NCCL collectives for tensor parallelism. libnccl is opened at run time (dlopen) rather than linked:
// the build needs no NCCL headers or library, a CPU-only or one-GPU user never loads it, and the
// library comes from wherever the user has it (the nvidia-nccl wheel, the CUDA toolkit, the system),
// which tallow/parallel/nccl_communicator.py finds and passes to nccl_load(). The few functions and
// enum values used are NCCL 2.x's stable C ABI, declared in nccl.cpp.
#pragma once
#include <memory>
#include <string>

#include "core/tensor.h"

namespace tallow::cuda {

// Open libnccl (path: a file; "" tries the default "libnccl.so.2"); idempotent once loaded. Raises
// RuntimeError naming the path and dlerror() when it cannot be opened or lacks a symbol.
void nccl_load(const std::string& path);
bool nccl_loaded();
int nccl_version();               // e.g. 22809 for 2.28.9
std::string nccl_unique_id();     // ncclGetUniqueId: 128 bytes, made by rank 0 and sent to the others

// One rank's communicator. Every rank constructs it with the same id and world size at the same
// time (ncclCommInitRank blocks until all have joined). Collectives run on the current stream of the
// tensor's device, so they are captured by a CUDA graph being recorded on it.
class NcclComm {
 public:
  NcclComm(const std::string& unique_id, int world_size, int rank, int device);
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_; }
  int device() const { return device_; }
  void all_reduce(const Tensor& t);                        // sum, in place
  void all_gather(const Tensor& out, const Tensor& in);    // out: world_size * in's elements, rank blocks
  void broadcast(const Tensor& t, int root);               // in place
  std::string async_error();  // "" while healthy, else NCCL's description (a peer failed, a timeout)
  void abort();               // ncclCommAbort: pending and later collectives of this rank end
 private:
  void check_tensor(const char* op, const Tensor& t) const;
  void* comm_ = nullptr;
  int world_, rank_, device_;
  bool aborted_ = false;
};

}  // namespace tallow::cuda
