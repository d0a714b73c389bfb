// Decode GEMV / skinny GEMM on CUDA (internal; host API, no CUDA headers so bindings can include it):
// out[M, N] (row stride ldo) = x[M, K] (row stride ldx) * w[N, K]^T (row stride ldw) (+ bias[N]) for
// f16/bf16 with M <= 16 rows, streaming w once at HBM bandwidth. See gemv.cu for the kernel.
// Also the programmatic-dependent-launch (PDL) switch and, for .cu files, its device helpers.
#pragma once
#include <cstdint>
#include <string>

#include "core/dtype.h"

namespace tallow::cuda {

// A launch configuration. -1 in an override means "the heuristic's choice".
struct GemvConfig {
  int warps = -1;   // warps per CTA (1..16); they split the CTA's share of K
  int split = -1;   // CTAs per row tile (1..8), one thread-block cluster reducing through DSMEM (sm_90+)
  int rt = -1;      // 16-row tiles per warp (1, 2): x fragments reused across them
  int unroll = -1;  // 16-byte chunks per row per lane per step (2, 4, 8); halved until rt * unroll <= 8 (4 for M > 8)
  int policy = -1;  // weight loads: 0 ld.global.cs (evict-first), 1 ld.global.nc.L1::no_allocate.L2::256B
  int pdl = -1;     // 1: always PDL, 0: never; default: PDL under graph capture (see use_pdl)
  int target = -1;  // heuristic: warps per SM to aim for (default 16: 64 KiB of loads in flight per SM)
};

// True when gemv can run this product: f16/bf16, 1 <= M <= 16, K % 8 == 0 (16-byte rows), w/x base
// 16-byte aligned with row strides multiples of 8 elements, unit stride along K, ldo >= N, and a
// device of compute capability >= 8.0.
bool gemv_supported(DType dt, int64_t M, int64_t N, int64_t K, const void* x, int64_t ldx, int64_t x_kstride,
                    const void* w, int64_t ldw, int64_t w_kstride, int64_t ldo);

// Launches on `stream` (a cudaStream_t); no synchronisation, no allocation: safe under graph capture.
// Deterministic: every output is reduced in a fixed order. Call only where gemv_supported() holds.
void gemv(DType dt, const void* x, int64_t ldx, int M, const void* w, int64_t ldw, const void* bias, void* out,
          int64_t ldo, int64_t N, int64_t K, void* stream);

// Gated GEMV: out = (act(x[:, :K]) * x[:, K:]) * w^T (+ bias) with x [M, 2K] (row stride ldx >= 2K),
// the product rounded to x's dtype before the GEMM exactly as silu_and_mul / gelu_and_mul round it, so
// the result is bitwise that of gemv on their output. Each CTA applies the activation to the x chunks
// it reads; the weight stream is gemv's.
enum GemvAct : int { kGemvSilu = 0, kGemvGeluTanh = 1, kGemvGeluErf = 2 };
bool gemv_gated_supported(DType dt, int64_t M, int64_t N, int64_t K, const void* x, int64_t ldx,
                          int64_t x_kstride, const void* w, int64_t ldw, int64_t w_kstride, int64_t ldo);
void gemv_gated(DType dt, const void* x, int64_t ldx, int M, int act, const void* w, int64_t ldw, const void* bias,
                void* out, int64_t ldo, int64_t N, int64_t K, void* stream);

// The configuration gemv uses for this shape on the current device, as "warps=8,split=2,...".
std::string gemv_config(int64_t M, int64_t N, int64_t K);

// Overrides fields of the heuristic, e.g. "warps=8,split=2,unroll=4" ("" restores the heuristic);
// unknown keys or out-of-range values raise ValueError. TALLOW_GEMV_CONFIG sets it at start.
void set_gemv_config(const std::string& spec);

// ---- programmatic dependent launch (PDL) --------------------------------------------------------
// A kernel launched with PDL (sm_90+) may start while the previous kernel of its stream still runs.
// So it executes griddepcontrol.wait (pdl_wait) before it reads anything an earlier kernel may write
// and before its first global store (the caching allocator reuses memory in stream order: a buffer it
// writes may still be read by the previous kernel), and it triggers its own dependents early. Used by
// gemv / gated gemv, rms_norm / fused_add_rms_norm / layer_norm and silu_and_mul / gelu_and_mul on
// streams that are capturing a CUDA graph (the decode path; weights are never written there, so
// gemv's first weight loads go before the wait). Every one of them waits in every thread, so a
// kernel's completion still implies its predecessors' (a later kernel's wait covers the whole chain).
bool pdl_enabled();              // TALLOW_PDL=0 (read once) turns PDL off everywhere; default on
void set_pdl_enabled(bool on);   // tests: compare with and without
bool use_pdl(void* stream);      // enabled, compute capability >= 9.0 and `stream` is capturing

}  // namespace tallow::cuda

#ifdef __CUDACC__
#include <cuda_runtime.h>

#include <utility>

namespace tallow::cuda {

// Waits until the previous kernel of the stream has completed and its writes are visible (no-op
// for a kernel launched without PDL, and below sm_90).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Lets the next kernel (if launched with PDL) start its pre-wait part once every CTA of this grid
// has executed this; the next kernel's wait still covers all of this grid.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// A hint that warms L2 with p's line (no value is read: safe before pdl_wait).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// kernel<<<grid, block, smem, stream>>>(args...), with the PDL attribute when `pdl`.
template <class... P, class... A>
cudaError_t launch_kernel(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl,
                          A&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  if (pdl) {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...);
}

}  // namespace tallow::cuda
#endif
