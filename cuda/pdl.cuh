// Programmatic dependent launch (PDL): the host switch and, for .cu files, the device helpers and a
// launch wrapper. Host part without CUDA headers, so bindings can include it.
#pragma once

namespace tallow::cuda {

// ---- programmatic dependent launch (PDL) --------------------------------------------------------
// A kernel launched with PDL (sm_90+) may start while the previous kernel of its stream still runs.
// So it executes griddepcontrol.wait (pdl_wait) before it reads anything an earlier kernel may write
// and before its first global store (the caching allocator reuses memory in stream order: a buffer it
// writes may still be read by the previous kernel), and it triggers its own dependents early. Used by
// the norms for a few rows and rope_and_cache on streams that are capturing a CUDA graph (the decode
// path), and by the decode-attention kernel on its own terms (attention/decode.cu); gemv only with a
// pinned "pdl=1" launch (gemv weights are never written on the decode path, so its first weight loads
// go before the wait). The kernels that may be launched so (also gemv, silu_and_mul / gelu_and_mul)
// wait in every thread, so a kernel's completion still implies its predecessors' (a later kernel's
// wait covers the whole chain). The global switch for the rest (TALLOW_PDL) was removed with the path
// it selected, measured slower (cuda/README.md, "Removed switches").
bool pdl_capable(void* stream);  // compute capability >= 9.0 and `stream` is capturing

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
