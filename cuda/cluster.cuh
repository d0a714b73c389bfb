// Thread-block cluster helpers (sm_90+; hosts launch clusters only there, so below sm_90 these
// compile to nothing): the barrier halves and distributed-shared-memory stores and loads. Used by
// the split GEMV (gemv.cu) and the split sampling kernels (sampling.cuh).
#pragma once
#include <cstdint>

namespace tallow::cuda {

// Barrier halves. A relaxed arrive at a kernel's start and its wait before the first remote access
// guarantee that every CTA of the cluster runs (its shared memory exists) at no cost; the
// release/acquire pair publishes remote stores.
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_arrive_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// The address of *p (in this CTA's shared memory) in the shared memory of cluster CTA `rank`.
__device__ __forceinline__ uint32_t cluster_addr(const void* p, int rank) {
  uint32_t remote = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint32_t local = (uint32_t)__cvta_generic_to_shared(p);
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
#endif
  return remote;
}

// Loads and stores at such addresses; store_remote(p, rank, v): *p = v in CTA `rank`'s copy.
__device__ __forceinline__ uint32_t ld_cluster(uint32_t addr) {
  uint32_t v = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
#endif
  return v;
}
__device__ __forceinline__ void store_remote(float* p, int rank, float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(cluster_addr(p, rank)), "f"(v) : "memory");
#endif
}
__device__ __forceinline__ void store_remote(unsigned long long* p, int rank, unsigned long long v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.shared::cluster.u64 [%0], %1;" ::"r"(cluster_addr(p, rank)), "l"(v) : "memory");
#endif
}

}  // namespace tallow::cuda
