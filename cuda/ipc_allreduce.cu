// One-shot all-reduce over CUDA IPC buffers (see ipc_allreduce.h).
//
// Each rank owns one cudaMalloc region, mapped into every peer with cudaIpcOpenMemHandle:
//   [header 256 B: magic, max_bytes, world, rank]
//   [flags: uint64 [2 phases][kMaxBlocks][kMaxWorld]; slot [ph][b][p] is written by peer p's block b]
//   [epochs: uint64 [kMaxBlocks]; this rank's own call counters, never touched by peers]
//   [data: 2 phases x phase_bytes]
// A call is one kernel. Block b reads e = epochs[b] + 1 (the call's number, starting at 1) and
// phase = e & 1, then:
//   1. copies its slice of t into its own data[phase];
//   2. barrier: __syncthreads, then thread p (one per peer) stores e into peer p's flags[phase][b][rank]
//      with st.release.sys (the block's copy is visible before the flag) and spins with ld.acquire.sys
//      until its own flags[phase][b][p] == e (the peer's copy of the same slice is visible after it);
//   3. sums the slice of every rank's data[phase] in rank order 0..world-1 in f32 (16-byte loads,
//      ld.volatile: nothing stale from an L1 line of an earlier call) and writes t;
//   4. thread 0 stores epochs[b] = e; block 0 also stores e into the counters of the blocks >= gridDim.x
//      that this call did not launch. So after every call all kMaxBlocks counters hold the same value:
//      e is one global call number, and every block of a call uses the same phase, whatever the grid
//      of the previous calls (the grid grows with the message; per-block counters that only advanced
//      in launched blocks would give two blocks of one call different phases over overlapping bytes).
// The epoch lives on the device, so a captured graph replays with a new e each time; uint64 never
// wraps, so a flag can never equal an e it was not written for.
//
// Why two phases need no end barrier. A rank's calls are stream-ordered: call k+1's kernel starts
// after call k's has finished (all blocks). Take rank r starting call k+2, about to write data[k & 1]
// and peers' flags[k & 1]. Its call k+1 finished, so each of its blocks saw every peer p's flag for
// k+1, which p's call k+1 wrote, so p's call k+1 had started, so p's call k had finished: p reads
// nothing of call k any more (neither r's data[k & 1] nor its own flags[k & 1]). p may still be in
// call k+1, reading data[(k+1) & 1], the other phase. Symmetrically a flag for k can only be
// overwritten (with k+2) once its reader has finished call k, so every spin sees its own call's value:
// no rank gets more than one call ahead of another. Both arguments need every call to launch at least
// one block (it does) and the same grid on every rank (the grid depends only on nbytes).
#include "ipc_allreduce.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>

#include "common.cuh"

namespace tallow::cuda {

namespace {

constexpr int kMaxWorld = IpcAllReduce::kMaxWorld;
constexpr int kMaxBlocks = IpcAllReduce::kMaxBlocks;
constexpr int kThreads = IpcAllReduce::kThreads;
constexpr uint64_t kMagic = 0x5249776f6c6c6174ull;  // "tallowIR"
constexpr size_t kFlagsOffset = 256;
constexpr size_t kEpochsOffset = kFlagsOffset + sizeof(uint64_t) * 2 * kMaxBlocks * kMaxWorld;
constexpr size_t kDataOffset = 16384;
static_assert(kEpochsOffset + sizeof(uint64_t) * kMaxBlocks <= kDataOffset, "region layout");
constexpr int kHeaderWords = 4;  // magic, max_bytes, world, rank

struct Regions {
  char* base[kMaxWorld];  // every rank's region as mapped on this device
};

__device__ __forceinline__ uint64_t* flags_of(char* base) { return reinterpret_cast<uint64_t*>(base + kFlagsOffset); }

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint4 ld_volatile16(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

// t: nvec 16-byte vectors, in place. W: the world size.
template <class T, int W>
__global__ void __launch_bounds__(kThreads) ipc_all_reduce_kernel(Regions regions, char* own, int rank,
                                                                  size_t phase_bytes, uint4* t, int64_t nvec) {
  // own == regions.base[rank], passed apart: indexing the parameter array with a run-time value would
  // copy it to local memory.
  constexpr int N = Vec16<T>::N;
  uint64_t* epochs = reinterpret_cast<uint64_t*>(own + kEpochsOffset);
  const uint64_t epoch = epochs[blockIdx.x] + 1;
  const size_t phase = (size_t)(epoch & 1);
  const size_t data_offset = kDataOffset + phase * phase_bytes;

  // This block's slice: whole warps of 16-byte vectors (512-byte aligned runs per warp).
  int64_t per_block = (nvec + gridDim.x - 1) / gridDim.x;
  per_block = (per_block + 31) / 32 * 32;
  const int64_t begin = (int64_t)blockIdx.x * per_block;
  const int64_t end = begin + per_block < nvec ? begin + per_block : nvec;

  // 1. the input into this rank's buffer of the phase
  uint4* mine = reinterpret_cast<uint4*>(own + data_offset);
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) mine[i] = t[i];
  __syncthreads();

  // 2. barrier with block blockIdx.x of every peer
  if ((int)threadIdx.x < W && (int)threadIdx.x != rank) {
    const int p = threadIdx.x;
    char* peer = regions.base[0];
#pragma unroll
    for (int q = 1; q < W; ++q)
      if (p == q) peer = regions.base[q];
    const size_t slot = (phase * kMaxBlocks + blockIdx.x) * kMaxWorld;
    st_release_sys(flags_of(peer) + slot + rank, epoch);
    const uint64_t* wait = flags_of(own) + slot + p;
    while (ld_acquire_sys(wait) != epoch) {
    }
  }
  __syncthreads();

  // 3. sum the slice over the ranks in rank order: the same f32 operations, so the same bits, everywhere
  const uint4* src[W];
#pragma unroll
  for (int r = 0; r < W; ++r) src[r] = reinterpret_cast<const uint4*>(regions.base[r] + data_offset);
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    uint4 raw[W];
#pragma unroll
    for (int r = 0; r < W; ++r) raw[r] = ld_volatile16(src[r] + i);  // all loads in flight first
    float acc[N];
    {
      Vec16<T> v;
      *reinterpret_cast<uint4*>(&v) = raw[0];
#pragma unroll
      for (int j = 0; j < N; ++j) acc[j] = to_float(v.v[j]);
    }
#pragma unroll
    for (int r = 1; r < W; ++r) {
      Vec16<T> v;
      *reinterpret_cast<uint4*>(&v) = raw[r];
#pragma unroll
      for (int j = 0; j < N; ++j) acc[j] += to_float(v.v[j]);
    }
    Vec16<T> out;
#pragma unroll
    for (int j = 0; j < N; ++j) out.v[j] = from_float<T>(acc[j]);
    t[i] = *reinterpret_cast<const uint4*>(&out);
  }

  // 4. the next call's number, for this block and for the blocks this call did not launch
  if (threadIdx.x == 0) {
    epochs[blockIdx.x] = epoch;
    if (blockIdx.x == 0)
      for (int b = gridDim.x; b < kMaxBlocks; ++b) epochs[b] = epoch;
  }
}

template <class T, int W>
void launch(const Regions& regions, int rank, size_t phase_bytes, void* t, int64_t nvec, unsigned grid,
            cudaStream_t stream) {
  ipc_all_reduce_kernel<T, W><<<grid, kThreads, 0, stream>>>(regions, regions.base[rank], rank, phase_bytes,
                                                              static_cast<uint4*>(t), nvec);
}

template <class T>
void launch_world(int world, const Regions& regions, int rank, size_t phase_bytes, void* t, int64_t nvec,
                  unsigned grid, cudaStream_t stream) {
  switch (world) {
    case 2: return launch<T, 2>(regions, rank, phase_bytes, t, nvec, grid, stream);
    case 3: return launch<T, 3>(regions, rank, phase_bytes, t, nvec, grid, stream);
    case 4: return launch<T, 4>(regions, rank, phase_bytes, t, nvec, grid, stream);
    case 5: return launch<T, 5>(regions, rank, phase_bytes, t, nvec, grid, stream);
    case 6: return launch<T, 6>(regions, rank, phase_bytes, t, nvec, grid, stream);
    case 7: return launch<T, 7>(regions, rank, phase_bytes, t, nvec, grid, stream);
    case 8: return launch<T, 8>(regions, rank, phase_bytes, t, nvec, grid, stream);
    default: throw ValueError(str_cat("ipc all_reduce: world_size ", world, " not in 2..", kMaxWorld));
  }
}

}  // namespace

IpcAllReduce::IpcAllReduce(int device, int rank, int world, size_t max_bytes)
    : device_(device), rank_(rank), world_(world), max_bytes_(max_bytes) {
  TALLOW_CHECK(world >= 2 && world <= kMaxWorld, "IpcAllReduce: world_size ", world, " not in 2..", kMaxWorld);
  TALLOW_CHECK(rank >= 0 && rank < world, "IpcAllReduce: rank ", rank, " not in 0..", world - 1);
  TALLOW_CHECK(max_bytes >= 16 && max_bytes <= (size_t(1) << 40), "IpcAllReduce: max_bytes ", max_bytes,
               " must be at least 16 (and at most 2^40)");
  const int count = device_count();
  TALLOW_CHECK(device >= 0 && device < count, "IpcAllReduce: device ", device, " not in 0..", count - 1,
               " (", count, " CUDA devices)");
  phase_bytes_ = (max_bytes + 255) / 256 * 256;
  DeviceGuard guard(device_);
  void* p = nullptr;
  TALLOW_CUDA_CHECK("IpcAllReduce (buffer)", cudaMalloc(&p, kDataOffset + 2 * phase_bytes_));
  base_ = static_cast<char*>(p);
  try {
    // Zeroed flags and counters before the handle leaves this process: peers write flags from their
    // first call on. The data buffers need no zeroing (every byte read was copied in by its call).
    TALLOW_CUDA_CHECK("IpcAllReduce (zero the flags)", cudaMemset(base_, 0, kDataOffset));
    const uint64_t header[kHeaderWords] = {kMagic, (uint64_t)max_bytes_, (uint64_t)world_, (uint64_t)rank_};
    TALLOW_CUDA_CHECK("IpcAllReduce (header)", cudaMemcpy(base_, header, sizeof header, cudaMemcpyHostToDevice));
    TALLOW_CUDA_CHECK("IpcAllReduce (synchronize)", cudaDeviceSynchronize());
    cudaIpcMemHandle_t h;
    TALLOW_CUDA_CHECK("IpcAllReduce (cudaIpcGetMemHandle)", cudaIpcGetMemHandle(&h, base_));
    handle_.assign(reinterpret_cast<const char*>(&h), sizeof h);
  } catch (...) {
    (void)cudaFree(base_);
    base_ = nullptr;
    throw;
  }
  regions_.assign(world_, nullptr);
  regions_[rank_] = base_;
}

IpcAllReduce::~IpcAllReduce() {
  if (base_ == nullptr) return;
  int prev = -1;
  const bool have_prev = cudaGetDevice(&prev) == cudaSuccess;
  if (cudaSetDevice(device_) == cudaSuccess) {
    for (int i = 0; i < (int)regions_.size(); ++i)
      if (i != rank_ && regions_[i] != nullptr) (void)cudaIpcCloseMemHandle(regions_[i]);
    (void)cudaFree(base_);
  }
  if (have_prev) (void)cudaSetDevice(prev);
  (void)cudaGetLastError();  // a failure here (e.g. at interpreter exit) must not surface in a later op
}

void IpcAllReduce::open(const std::vector<std::string>& handles) {
  TALLOW_CHECK(!opened_, "ipc all_reduce open: already opened");
  TALLOW_CHECK((int)handles.size() == world_, "ipc all_reduce open: ", handles.size(), " handles for world_size ",
               world_);
  for (size_t i = 0; i < handles.size(); ++i)
    TALLOW_CHECK(handles[i].size() == sizeof(cudaIpcMemHandle_t), "ipc all_reduce open: handle ", i, " has ",
                 handles[i].size(), " bytes, not ", sizeof(cudaIpcMemHandle_t));
  TALLOW_CHECK(handles[rank_] == handle_, "ipc all_reduce open: handle ", rank_,
               " is not this rank's own (handles go in rank order)");
  DeviceGuard guard(device_);
  try {
    for (int i = 0; i < world_; ++i) {
      if (i == rank_) continue;
      cudaIpcMemHandle_t h;
      std::memcpy(&h, handles[i].data(), sizeof h);
      void* p = nullptr;
      TALLOW_CUDA_CHECK("ipc all_reduce open (cudaIpcOpenMemHandle)",
                        cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
      regions_[i] = static_cast<char*>(p);
      uint64_t header[kHeaderWords] = {};
      TALLOW_CUDA_CHECK("ipc all_reduce open (peer header)",
                        cudaMemcpy(header, regions_[i], sizeof header, cudaMemcpyDefault));
      TALLOW_CHECK(header[0] == kMagic && header[1] == (uint64_t)max_bytes_ && header[2] == (uint64_t)world_ &&
                       header[3] == (uint64_t)i,
                   "ipc all_reduce open: handle ", i, " is a region with ",
                   header[0] == kMagic ? "" : "no IpcAllReduce header, ", "max_bytes ", header[1], ", world_size ",
                   header[2], ", rank ", header[3], "; this rank (", rank_, ") expects max_bytes ", max_bytes_,
                   ", world_size ", world_, ", rank ", i);
    }
  } catch (...) {
    for (int i = 0; i < world_; ++i)
      if (i != rank_ && regions_[i] != nullptr) {
        (void)cudaIpcCloseMemHandle(regions_[i]);
        regions_[i] = nullptr;
      }
    throw;
  }
  opened_ = true;
}

std::string IpcAllReduce::unsupported_reason(const Tensor& t) const {
  if (!t.defined()) return "undefined tensor";
  const auto what = [&](const auto&... why) {
    return str_cat("tensor ", shape_str(t.shape()), " ", dtype_name(t.dtype()), " on ", t.device().str(), ": ",
                   why...);
  };
  if (t.device().type != DeviceType::CUDA || t.device().index != device_)
    return what("the communicator is on cuda:", device_);
  if (t.dtype() != DType::F32 && t.dtype() != DType::F16 && t.dtype() != DType::BF16)
    return what("dtype must be float32, float16 or bfloat16");
  if (!t.is_contiguous()) return what("not contiguous (strides ", shape_str(t.strides()), ")");
  const int64_t nbytes = t.nbytes();
  if (nbytes % 16 != 0) return what(nbytes, " bytes, not a multiple of 16");
  if ((uint64_t)nbytes > max_bytes_) return what(nbytes, " bytes, more than max_bytes ", max_bytes_);
  if (nbytes > 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return what("data not 16-byte aligned");
  if (!opened_) return what("open() has not been called");
  return "";
}

void IpcAllReduce::all_reduce(Tensor& t) {
  const std::string why = unsupported_reason(t);
  TALLOW_CHECK(why.empty(), "ipc all_reduce: ", why);
  const int64_t nvec = t.nbytes() / 16;
  if (nvec == 0) return;  // every rank skips it alike: no epoch is used
  DeviceGuard guard(device_);
  const cudaStream_t stream = (cudaStream_t)current_stream(device_);
  // Depends on nbytes only: every rank launches the same grid for the same call.
  const unsigned grid = (unsigned)std::min<int64_t>(kMaxBlocks, ceil_div(nvec, kThreads));
  Regions regions{};
  for (int i = 0; i < world_; ++i) regions.base[i] = regions_[i];
  TALLOW_CUDA_DISPATCH_FLOAT("ipc all_reduce", t.dtype(), [&] {
    launch_world<scalar_t>(world_, regions, rank_, phase_bytes_, t.data_ptr(), nvec, grid, stream);
  });
  TALLOW_CUDA_CHECK_LAUNCH("ipc all_reduce");
}

}  // namespace tallow::cuda
