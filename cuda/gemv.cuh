// Decode GEMV / skinny GEMM on CUDA (internal; host API, no CUDA headers so bindings can include it):
// out[M, N] (row stride ldo) = x[M, K] (row stride ldx) * w[N, K]^T (row stride ldw) (+ bias[N]) for
// f16/bf16 with M <= 16 rows, streaming w once at HBM bandwidth. See gemv.cu for the kernel.
#pragma once
#include <cstdint>
#include <string>

#include "core/dtype.h"
#include "pdl.cuh"

namespace tallow::cuda {

// A launch configuration. -1 in an override means "the heuristic's choice".
struct GemvConfig {
  int warps = -1;   // warps per CTA (1..16); they split the CTA's share of K
  int split = -1;   // CTAs per row tile (1..8), one thread-block cluster reducing through DSMEM (sm_90+)
  int rt = -1;      // 16-row tiles per warp (1, 2): x fragments reused across them
  int unroll = -1;  // 16-byte chunks per row per lane per step (2, 4, 8); halved until rt * unroll <= 8 (4 for M > 8)
  int policy = -1;  // weight loads: 0 ld.global.cs (evict-first), 1 ld.global.nc.L1::no_allocate.L2::256B
  int pdl = -1;     // 1: PDL under graph capture on sm_90 (measured slower: sweeps only); default, 0: never
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
// unknown keys or out-of-range values raise ValueError. Also sets KernelTuning::gemv_config (whose
// start-up value is TALLOW_GEMV_CONFIG).
void set_gemv_config(const std::string& spec);

}  // namespace tallow::cuda
