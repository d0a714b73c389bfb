// A one-shot all-reduce (sum) over CUDA IPC buffers, for the small messages of tensor-parallel decode
// (64 all-reduces of 8 KB a Llama-3-8B token at TP=2), where NCCL's ~14 us a call from a CUDA graph
// dominates. One kernel a call: copy the input into this rank's buffer, a per-block flag barrier with
// every peer over NVLink, then each block sums its slice of every rank's buffer in rank order. See
// ipc_allreduce.cu for the protocol and why two buffer phases need no end barrier; cuda/README.md.
// No CUDA headers here (the bindings include this).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace tallow::cuda {

class IpcAllReduce {
 public:
  static constexpr int kMaxWorld = 8;
  static constexpr int kMaxBlocks = 64;  // the kernel's largest grid (flags are per block)
  static constexpr int kThreads = 512;

  // Allocates (cudaMalloc on `device`) one region: a header, the flags of both phases, the per-block
  // epoch counters (all zeroed) and a data buffer of max_bytes per phase. rank in [0, world),
  // world in 2..8. Every rank must pass the same world and max_bytes (open() checks).
  IpcAllReduce(int device, int rank, int world, size_t max_bytes);
  ~IpcAllReduce();  // closes the opened peer regions and frees this one; never throws
  IpcAllReduce(const IpcAllReduce&) = delete;
  IpcAllReduce& operator=(const IpcAllReduce&) = delete;

  // This rank's cudaIpcMemHandle_t as its 64 raw bytes, for the other ranks' open().
  std::string handle() const { return handle_; }
  // Every rank's handle in rank order (this rank's own included; it is checked, not opened). Opens the
  // peers' regions (cudaIpcMemLazyEnablePeerAccess) and checks their headers (world, max_bytes, rank).
  void open(const std::vector<std::string>& handles);

  // CUDA on this device, contiguous, 16-byte aligned, f32/f16/bf16, nbytes <= max_bytes,
  // nbytes % 16 == 0, and opened.
  bool supports(const Tensor& t) const { return unsupported_reason(t).empty(); }
  // Why supports(t) is false ("" when it is true).
  std::string unsupported_reason(const Tensor& t) const;

  // In place: t becomes the elementwise sum over the ranks (f32 accumulation in rank order 0..world-1,
  // one rounding: the same bits on every rank). On the current stream of t's device; capturable in a
  // CUDA graph (the epoch lives on the device). Every rank calls it with a tensor of the same nbytes in
  // the same order, and a rank's calls run one after another (one stream, or streams ordered by
  // events): the protocol relies on a call's kernel not starting before the previous one finished.
  void all_reduce(Tensor& t);

  int device() const { return device_; }
  int rank() const { return rank_; }
  int world_size() const { return world_; }
  size_t max_bytes() const { return max_bytes_; }
  bool opened() const { return opened_; }

 private:
  int device_, rank_, world_;
  size_t max_bytes_;
  size_t phase_bytes_;            // one phase's data buffer (max_bytes rounded up to 256)
  char* base_ = nullptr;          // this rank's region (cudaMalloc)
  std::string handle_;            // its IPC handle, 64 bytes
  std::vector<char*> regions_;    // every rank's region as mapped here (own one at rank_), after open()
  bool opened_ = false;
};

}  // namespace tallow::cuda
