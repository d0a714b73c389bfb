// Benchmark: how fast can any kernel read N bytes once, launched back to back from a CUDA graph?
// The floor under a batch-1 decode attention step (issue 8, target 4): the K + V bytes of one
// sequence of 2k-32k keys at Llama-3-8B heads (8 kv heads x 128 x 2 bytes x 2 = 4 KiB a key) are
// read by a kernel that does nothing else (16-byte streaming loads, four in flight a thread, one
// xor-reduction per CTA), as a ratio of the copy bandwidth of a 1 GiB device-to-device copy
// (bytes read + written per second, as benchmarks/bench_attention.py measures it). Each timed graph
// cycles through copies of the input that overflow L2 four times; CTAs per SM 2, 4 and 8, with and
// without programmatic dependent launch (wait, then trigger the next launch at once); the best is
// printed per size. A decode kernel also merges splits and computes, so it cannot beat this.
//   ctest --test-dir <build> -L bench -V      or run the binary (sm_90 for PDL; needs a GPU).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#define CHECK(x)                                                                             \
  do {                                                                                       \
    cudaError_t e_ = (x);                                                                    \
    if (e_ != cudaSuccess) {                                                                 \
      std::printf("bench_read_floor: %s: %s (line %d)\n", #x, cudaGetErrorString(e_), __LINE__); \
      return 1;                                                                              \
    }                                                                                        \
  } while (0)

constexpr int kThreads = 256, kUnroll = 4;

__global__ void __launch_bounds__(kThreads) read_once(const uint4* __restrict__ src, size_t n16, size_t per_cta,
                                                      uint32_t* out, int pdl) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (pdl) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
  }
#endif
  const size_t start = (size_t)blockIdx.x * per_cta, end = start + per_cta < n16 ? start + per_cta : n16;
  uint32_t acc = 0;
  for (size_t i = start + threadIdx.x; i < end; i += (size_t)kThreads * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const size_t j = i + (size_t)u * kThreads;
      v[u] = j < end ? __ldcs(src + j) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  __shared__ uint32_t s[kThreads];
  s[threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t a = 0;
    for (int i = 0; i < kThreads; ++i) a ^= s[i];
    out[blockIdx.x] = a;  // keeps the loads
  }
}

int main() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("bench_read_floor: no CUDA device; skipping\n");
    return 0;
  }
  int sms = 0, l2 = 0, major = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0));
  CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const size_t total = 1ull << 30;
  char *buf = nullptr, *dst = nullptr;
  uint32_t* out = nullptr;
  CHECK(cudaMalloc(&buf, total));
  CHECK(cudaMalloc(&dst, total));
  CHECK(cudaMalloc(&out, 1 << 20));
  CHECK(cudaMemset(buf, 0x5a, total));
  cudaStream_t st;
  CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  float ms = 0.f;
  // Copy bandwidth as bench_attention measures it: a 1 GiB copy moves 2 GiB (read + write).
  for (int w = 0; w < 2; ++w) CHECK(cudaMemcpyAsync(dst, buf, total, cudaMemcpyDeviceToDevice, st));
  CHECK(cudaEventRecord(e0, st));
  for (int i = 0; i < 10; ++i) CHECK(cudaMemcpyAsync(dst, buf, total, cudaMemcpyDeviceToDevice, st));
  CHECK(cudaEventRecord(e1, st));
  CHECK(cudaEventSynchronize(e1));
  CHECK(cudaEventElapsedTime(&ms, e0, e1));
  const double copy_gbs = 10.0 * 2.0 * (double)total / (ms * 1e-3) / 1e9;
  std::printf("device: %s, %d SMs, L2 %d MiB; copy of 1 GiB: %.1f GB/s (read + write)\n", prop.name, sms, l2 >> 20,
              copy_gbs);
  std::printf("%-28s %10s %10s %8s  %s\n", "read once (graph-replayed)", "us/call", "GB/s", "ratio", "best launch");
  for (int keys : {2048, 4096, 8192, 16384, 32768}) {  // 2048: also an fp8 cache's 4096 keys
    const size_t bytes = (size_t)keys * 4096;  // K + V of 8 kv heads x 128 dims in 16 bits
    const size_t n16 = bytes / 16;
    const int copies = (int)std::max<size_t>(1, std::min<size_t>(total / bytes, (4ull * l2 + bytes - 1) / bytes));
    const int calls = std::max(40, copies);
    double best_us = 1e30;
    int best_cps = 0, best_pdl = 0;
    for (int cps : {2, 4, 8}) {
      for (int pdl = 0; pdl <= (major >= 9 ? 1 : 0); ++pdl) {
        const int ctas = sms * cps;
        const size_t per = (n16 + ctas - 1) / ctas;
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cudaGraph_t g;
        cudaGraphExec_t ge;
        CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
        for (int c = 0; c < calls; ++c) {
          cudaLaunchConfig_t cfg{};
          cfg.gridDim = dim3((unsigned)ctas);
          cfg.blockDim = dim3(kThreads);
          cfg.stream = st;
          cfg.attrs = attr;
          cfg.numAttrs = pdl ? 1 : 0;
          const uint4* src = reinterpret_cast<const uint4*>(buf + (size_t)(c % copies) * bytes);
          CHECK(cudaLaunchKernelEx(&cfg, read_once, src, n16, per, out, pdl));
        }
        CHECK(cudaStreamEndCapture(st, &g));
        CHECK(cudaGraphInstantiate(&ge, g, 0));
        for (int w = 0; w < 2; ++w) CHECK(cudaGraphLaunch(ge, st));
        std::vector<float> t;
        for (int r = 0; r < 5; ++r) {
          CHECK(cudaEventRecord(e0, st));
          CHECK(cudaGraphLaunch(ge, st));
          CHECK(cudaEventRecord(e1, st));
          CHECK(cudaEventSynchronize(e1));
          CHECK(cudaEventElapsedTime(&ms, e0, e1));
          t.push_back(ms / calls);
        }
        std::sort(t.begin(), t.end());
        const double us = t[t.size() / 2] * 1e3;
        if (us < best_us) best_us = us, best_cps = cps, best_pdl = pdl;
        CHECK(cudaGraphExecDestroy(ge));
        CHECK(cudaGraphDestroy(g));
      }
    }
    char name[64];
    std::snprintf(name, sizeof name, "B=1 ctx=%d (%.1f MB)", keys, bytes / 1e6);
    const double gbs = bytes / best_us / 1e3;
    std::printf("%-28s %10.2f %10.1f %8.3f  %d CTAs/SM%s\n", name, best_us, gbs, gbs / copy_gbs, best_cps,
                best_pdl ? ", PDL" : "");
  }
  return 0;
}
