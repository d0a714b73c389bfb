// Split-K GEMM for decode batches on CUDA (internal; host API, no CUDA headers so bindings can
// include it): out[M, N] (row stride ldo) = x[M, K] (row stride ldx) * w[N, K]^T (row stride ldw)
// (+ bias[N]) for f16/bf16 with up to 256 rows and few output columns, the K range cut among the
// CTAs of a thread-block cluster. See splitk_gemm.cu for the kernel and why.
#pragma once
#include <cstdint>

#include "core/dtype.h"

namespace tallow::cuda {

// True when splitk_gemm can run this product: f16/bf16, 1 <= M <= 256, K % 8 == 0 (16-byte rows),
// x/w base 16-byte aligned with row strides multiples of 8 elements and unit stride along K, ldo >= N,
// and a device of compute capability >= 9.0 (clusters).
bool splitk_supported(DType dt, int64_t M, int64_t N, int64_t K, const void* x, int64_t ldx, int64_t x_kstride,
                      const void* w, int64_t ldw, int64_t w_kstride, int64_t ldo);

// Launches on `stream` (a cudaStream_t); no synchronisation, no allocation: safe under graph capture.
// Deterministic: every output is reduced in a fixed order. Call only where splitk_supported() holds.
// split 0 picks the cluster size (1, 2, 4 or 8) from the shape; tests force others.
void splitk_gemm(DType dt, const void* x, int64_t ldx, int M, const void* w, int64_t ldw, const void* bias,
                 void* out, int64_t ldo, int64_t N, int64_t K, void* stream, int split = 0);

// Where linear sends products here (ops_cuda.h's linear): skinny_max_m() < M <= splitk_max_m() and
// N <= splitk_max_n(). TALLOW_SPLITK_MAX_M / TALLOW_SPLITK_MAX_N set them at start (0 turns it off).
int splitk_max_m();
void set_splitk_max_m(int m);
int64_t splitk_max_n();
void set_splitk_max_n(int64_t n);
// The cluster size linear asks for (0: the heuristic's; tests and A/B measurements set 1, 2, 4, 8).
int splitk_forced_split();
void set_splitk_forced_split(int split);

}  // namespace tallow::cuda
