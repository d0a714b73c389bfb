// CPU GEMM with f32 accumulation for f32/f16/bf16 operands: C = A·B (+ bias), any strides, batched.
//
// This header has two parts.
//  * The shared part (include guard): the Problem description and the entry point gemm::run(), which
//    picks the kernel set for the CPU it runs on (AVX-512, AVX2+FMA or portable) at first use.
//  * The kernel body (when TALLOW_GEMM_BODY is defined): included once per ISA by gemm_kernel.cpp inside
//    a `#pragma GCC target` region and its own namespace, so every function and template in it is compiled
//    for that ISA. (target_clones cannot do this: the register tile must differ per ISA — 12x32 floats
//    in 32 zmm registers, 6x16 in 16 ymm registers.)
//
// Algorithm (the BLIS scheme). The "B side" is packed to f32 panels of NR columns ([K][NR] each) — for one
// GEMM by all threads together, up to NCB columns at a time; the "A side" is packed per task to f32
// micro-panels of MR rows ([MR][kc], row-major, so K-contiguous rows are a plain copy). The micro-kernel
// keeps an MR x NR tile of f32 accumulators in registers, broadcasting A and loading B vectors. A task is
// (block of <= MC rows, group of panels <= NCT columns): it walks K in KC slabs, accumulating in an f32 tile
// that the epilogue adds the bias to and rounds to the output dtype. Tasks split rows and columns, never K,
// so every output is summed in the same order whatever the thread count. Batches of many GEMMs run one
// whole GEMM per task instead. Which operand plays "A" is chosen by packing cost: C^T = B^T·A^T is used
// when that moves the transposing pack to the smaller operand (linear's x·W^T with M < N: W rows become
// A micro-panels, copied; x is transposed into B panels, W x W blocks in registers).
// Small M (decode: M <= 16, or <= 8 for row-major B) skips packing: with B columns K-contiguous (linear
// weights) each output is a dot product streamed over W once, converting f16/bf16 on the fly; with B rows
// N-contiguous, an axpy sweep. The same holds for small N through C^T.
#ifndef TALLOW_OPS_GEMM_KERNEL_SHARED_H
#define TALLOW_OPS_GEMM_KERNEL_SHARED_H
#include <cstdint>
#include <cstdlib>
#include <cstring>
#if defined(_MSC_VER)
#include <malloc.h>
#endif
#include <initializer_list>
#include <new>
#include <type_traits>

namespace tallow::ops::gemm {

enum class Elt : int { F32, F16, BF16 };

// C[i, j] = sum_k A[i, k] * B[k, j] (+ bias), for i < M, j < N. Element (i, k) of A is at
// a + i*rsa + k*csa (in elements of the dtype), likewise B and C; all of one dtype, f32 accumulation.
struct Problem {
  int64_t M = 0, N = 0, K = 0;
  const void* a = nullptr;
  int64_t rsa = 0, csa = 0;
  const void* b = nullptr;
  int64_t rsb = 0, csb = 0;
  void* c = nullptr;
  int64_t rsc = 0, csc = 0;
  const void* bias = nullptr;  // dtype as the rest
  int bias_mode = 0;           // 0: none, 1: bias[j] (per column), 2: bias[i] (per row)
  int64_t bias_stride = 1;
  // Batched: `batch` problems, the k-th at element offsets aoff[k], boff[k], coff[k] (nullptr: all 0).
  int64_t batch = 1;
  const int64_t* aoff = nullptr;
  const int64_t* boff = nullptr;
  const int64_t* coff = nullptr;
};

// Runs the problem on the CPU thread pool with the best kernel set for this CPU.
void run(Elt elt, const Problem& p);
// Name of the kernel set run() uses ("avx512", "avx2", "portable"). The environment variable
// TALLOW_GEMM_ISA (read at first use) or set_isa() picks a lower one, for tests and comparisons.
const char* isa_name();
// Returns false (and changes nothing) when this CPU or build lacks that kernel set.
bool set_isa(const char* name);

inline void* aligned_malloc(size_t bytes) {
#if defined(_MSC_VER)
  return _aligned_malloc(bytes, 64);
#else
  return std::aligned_alloc(64, bytes);  // bytes is a multiple of 64
#endif
}
inline void aligned_free(void* p) {
#if defined(_MSC_VER)
  _aligned_free(p);
#else
  std::free(p);
#endif
}

// Grow-only, 64-byte aligned f32 scratch buffers, one set per thread (slot 0..3).
inline float* scratch(int slot, int64_t n) {
  struct Buf {
    float* p = nullptr;
    int64_t cap = 0;
    ~Buf() { aligned_free(p); }
  };
  static thread_local Buf bufs[4];
  Buf& b = bufs[slot];
  if (n > b.cap) {
    aligned_free(b.p);
    const int64_t cap = ((n + 1023) / 1024) * 1024;
    b.p = static_cast<float*>(aligned_malloc((size_t)cap * sizeof(float)));
    if (!b.p) throw std::bad_alloc();
    b.cap = cap;
  }
  return b.p;
}

}  // namespace tallow::ops::gemm

#endif  // TALLOW_OPS_GEMM_KERNEL_SHARED_H

// ---------------------------------------------------------------------------------------------------------
// Kernel body: TALLOW_GEMM_ISA is 512, 256 or 0 (portable); included inside a namespace by gemm_kernel.cpp.
#ifdef TALLOW_GEMM_BODY

// ---- vector abstraction -------------------------------------------------------------------------------
#if TALLOW_GEMM_ISA == 512
using vec = __m512;
constexpr int W = 16;
constexpr int MR = 12, NV = 2;  // 24 accumulators of 32 zmm
static inline vec vzero() { return _mm512_setzero_ps(); }
static inline vec vbcast(float x) { return _mm512_set1_ps(x); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vld(const float* p) { return _mm512_loadu_ps(p); }
static inline vec vld(const bf16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline vec vld(const f16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
static inline void vst(float* p, vec v) { _mm512_storeu_ps(p, v); }
static inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
#define TALLOW_GEMM_HAS_TRANSPOSE 1
// r[i][c] -> r[c][i] for a W x W block.
static inline void transpose_block(vec r[W]) {
  vec t[W];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  for (int m = 0; m < 4; ++m) {
    t[m] = _mm512_shuffle_f32x4(r[m], r[4 + m], 0x88);
    t[4 + m] = _mm512_shuffle_f32x4(r[m], r[4 + m], 0xdd);
    t[8 + m] = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0x88);
    t[12 + m] = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0xdd);
  }
  for (int m = 0; m < 4; ++m) {
    r[m] = _mm512_shuffle_f32x4(t[m], t[8 + m], 0x88);
    r[8 + m] = _mm512_shuffle_f32x4(t[m], t[8 + m], 0xdd);
    r[4 + m] = _mm512_shuffle_f32x4(t[4 + m], t[12 + m], 0x88);
    r[12 + m] = _mm512_shuffle_f32x4(t[4 + m], t[12 + m], 0xdd);
  }
}
#elif TALLOW_GEMM_ISA == 256
using vec = __m256;
constexpr int W = 8;
constexpr int MR = 6, NV = 2;  // 12 accumulators of 16 ymm
static inline vec vzero() { return _mm256_setzero_ps(); }
static inline vec vbcast(float x) { return _mm256_set1_ps(x); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec vld(const float* p) { return _mm256_loadu_ps(p); }
static inline vec vld(const bf16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline vec vld(const f16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
static inline void vst(float* p, vec v) { _mm256_storeu_ps(p, v); }
static inline float vsum(vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#define TALLOW_GEMM_HAS_TRANSPOSE 1
static inline void transpose_block(vec r[W]) {
  vec t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {
    u[4 * h] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0x44);
    u[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0xee);
    u[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
    u[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xee);
  }
  for (int m = 0; m < 4; ++m) {
    r[m] = _mm256_permute2f128_ps(u[m], u[4 + m], 0x20);
    r[4 + m] = _mm256_permute2f128_ps(u[m], u[4 + m], 0x31);
  }
}
#elif (defined(__GNUC__) || defined(__clang__)) && !defined(TALLOW_GEMM_NO_VECTOR_EXT)
// Portable: 4-wide GCC/Clang vector extension (SSE2 on x86-64, NEON on Arm).
typedef float vec __attribute__((vector_size(16)));
constexpr int W = 4;
constexpr int MR = 6, NV = 2;
static inline vec vzero() { return vec{0.f, 0.f, 0.f, 0.f}; }
static inline vec vbcast(float x) { return vec{x, x, x, x}; }
static inline vec vfma(vec a, vec b, vec c) { return a * b + c; }
static inline vec vadd(vec a, vec b) { return a + b; }
static inline vec vld(const float* p) { vec v; std::memcpy(&v, p, sizeof v); return v; }
template <class T> static inline vec vld(const T* p) {
  return vec{to_f32(p[0]), to_f32(p[1]), to_f32(p[2]), to_f32(p[3])};
}
static inline void vst(float* p, vec v) { std::memcpy(p, &v, sizeof v); }
static inline float vsum(vec v) { return (v[0] + v[1]) + (v[2] + v[3]); }
#else
// Plain C++ (other compilers): 4 floats the optimiser may vectorise.
struct vec {
  float v[4];
};
constexpr int W = 4;
constexpr int MR = 4, NV = 2;
static inline vec vzero() { return vec{{0.f, 0.f, 0.f, 0.f}}; }
static inline vec vbcast(float x) { return vec{{x, x, x, x}}; }
static inline vec vfma(vec a, vec b, vec c) {
  for (int i = 0; i < 4; ++i) c.v[i] += a.v[i] * b.v[i];
  return c;
}
static inline vec vadd(vec a, vec b) {
  for (int i = 0; i < 4; ++i) a.v[i] += b.v[i];
  return a;
}
template <class T> static inline vec vld(const T* p) {
  return vec{{to_f32(p[0]), to_f32(p[1]), to_f32(p[2]), to_f32(p[3])}};
}
static inline void vst(float* p, vec v) { std::memcpy(p, v.v, sizeof v.v); }
static inline float vsum(vec v) { return (v.v[0] + v.v[1]) + (v.v[2] + v.v[3]); }
#endif

constexpr int NR = NV * W;             // micro-tile columns
constexpr int64_t KC = 256;              // K slab
constexpr int64_t MC = MR * (120 / MR);  // rows of A packed per slab (~120)
constexpr int64_t NCT = 512;             // columns of the f32 C tile per task (multiple of NR)
constexpr int64_t NCB = 2048;            // columns of B packed at a time (K x NCB floats, shared)
// At most this many rows: GEMV paths, no packing (dot products over K-contiguous B columns; axpy sweeps
// over N-contiguous B rows, which re-read B per 4 rows and so give way to packing sooner). Measured
// crossovers with the packed GEMM at K = N = 2048 on AVX-512.
constexpr int64_t kSmallM = 16;
constexpr int64_t kSmallMAxpy = 8;

static inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
static inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// Threads worth using for `flops` of work: below ~2 MFLOP (~10 microseconds on one core) waking the
// pool costs more than it saves.
static inline int useful_threads(double flops) { return flops < (double)(1 << 21) ? 1 : get_num_threads(); }

// fn(begin, end) over [0, n) on the thread pool, or inline when threads == 1.
template <class F>
static inline void for_range(int threads, int64_t n, F&& fn) {
  if (threads <= 1) fn(0, n);
  else parallel_for(0, n, 1, fn);
}

// ---- packing ------------------------------------------------------------------------------------------

// n elements from src (stride s) to f32 dst.
template <class T>
static inline void load_row(const T* TALLOW_RESTRICT src, int64_t s, float* TALLOW_RESTRICT dst, int64_t n) {
  if (s == 1) {
    int64_t i = 0;
    for (; i + W <= n; i += W) vst(dst + i, vld(src + i));
    for (; i < n; ++i) dst[i] = to_f32(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = to_f32(src[i * s]);
  }
}

// A rows [i0, i0+mc) x cols [k0, k0+kc) -> micro-panels of MR rows, each [MR][kc]; rows past mc are zero.
template <class T>
static void pack_a(const T* a, int64_t rsa, int64_t csa, int64_t i0, int64_t mc, int64_t k0, int64_t kc, float* ap) {
  const int64_t mp = round_up(mc, MR);
  if (csa == 1 || rsa != 1) {
    for (int64_t r = 0; r < mp; ++r) {
      float* dst = ap + r * kc;
      if (r < mc) load_row(a + (i0 + r) * rsa + k0 * csa, csa, dst, kc);
      else std::memset(dst, 0, sizeof(float) * kc);
    }
  } else {  // columns contiguous: read MR consecutive rows of each column
    for (int64_t p = 0; p < mp; p += MR) {
      float* dst = ap + p * kc;
      const int64_t rows = mc - p < MR ? mc - p : MR;
      for (int64_t k = 0; k < kc; ++k) {
        const T* src = a + (i0 + p) + (k0 + k) * csa;
        for (int64_t r = 0; r < rows; ++r) dst[r * kc + k] = to_f32(src[r]);
        for (int64_t r = rows; r < MR; ++r) dst[r * kc + k] = 0.f;
      }
    }
  }
}

// B rows [0, K) x cols [j0, j0+nc) -> panels of NR columns, each [K][NR] (panel q at bp + q*K*NR); columns
// past nc are zero. Packs panels [q0, q1) only, so threads can share the work.
template <class T>
static void pack_b(const T* b, int64_t rsb, int64_t csb, int64_t K, int64_t j0, int64_t nc, int64_t q0, int64_t q1,
                   float* bp) {
  if (csb == 1) {
    // Rows contiguous: read each row across all the panels, write each panel's row k.
    for (int64_t k = 0; k < K; ++k) {
      const T* src = b + k * rsb + j0;
      for (int64_t q = q0; q < q1; ++q) {
        float* d = bp + q * K * NR + k * NR;
        const int64_t c0 = q * NR, cols = nc - c0 < NR ? nc - c0 : NR;
        if (cols == NR) {
#pragma GCC unroll 4
          for (int v = 0; v < NV; ++v) vst(d + v * W, vld(src + c0 + v * W));
        } else {
          for (int64_t j = 0; j < cols; ++j) d[j] = to_f32(src[c0 + j]);
          for (int64_t j = cols; j < NR; ++j) d[j] = 0.f;
        }
      }
    }
    return;
  }
  // Transposing pack (columns K-contiguous, e.g. x^T): W x W blocks transposed in registers where the ISA
  // has it; blocks of KB k keep the destination in L1.
  constexpr int64_t KB = 64;
  for (int64_t q = q0; q < q1; ++q) {
    float* dst = bp + q * K * NR;
    const int64_t c0 = q * NR, cols = nc - c0 < NR ? nc - c0 : NR;
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
      const int64_t kn = K - k0 < KB ? K - k0 : KB;
      int64_t j = 0;
#ifdef TALLOW_GEMM_HAS_TRANSPOSE
      if (rsb == 1) {
        for (; j + W <= cols; j += W) {
          const T* src = b + k0 + (j0 + c0 + j) * csb;
          float* d = dst + k0 * NR + j;
          int64_t k = 0;
          for (; k + W <= kn; k += W) {
            vec r[W];
#pragma GCC unroll 16
            for (int i = 0; i < W; ++i) r[i] = vld(src + i * csb + k);
            transpose_block(r);
#pragma GCC unroll 16
            for (int i = 0; i < W; ++i) vst(d + (k + i) * NR, r[i]);
          }
          for (; k < kn; ++k)
            for (int i = 0; i < W; ++i) d[k * NR + i] = to_f32(src[i * csb + k]);
        }
      }
#endif
      for (; j < cols; ++j) {
        const T* src = b + k0 * rsb + (j0 + c0 + j) * csb;
        float* d = dst + k0 * NR + j;
        if (rsb == 1) {
          for (int64_t k = 0; k < kn; ++k) d[k * NR] = to_f32(src[k]);
        } else {
          for (int64_t k = 0; k < kn; ++k) d[k * NR] = to_f32(src[k * rsb]);
        }
      }
      for (j = cols; j < NR; ++j)
        for (int64_t k = 0; k < kn; ++k) dst[(k0 + k) * NR + j] = 0.f;
    }
  }
}

// ---- micro-kernel -------------------------------------------------------------------------------------

// C[MR][NR] (row stride ldc) = (accumulate ? C : 0) + A[MR][kc] (row stride lda) * B[kc][NR].
static inline void micro_kernel(int64_t kc, const float* TALLOW_RESTRICT A, int64_t lda,
                                const float* TALLOW_RESTRICT B, float* TALLOW_RESTRICT C, int64_t ldc,
                                bool accumulate) {
  vec acc[MR][NV];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = accumulate ? vld(C + i * ldc + v * W) : vzero();
  for (int64_t k = 0; k < kc; ++k) {
    vec bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = vld(B + k * NR + v * W);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const vec av = vbcast(A[i * lda + k]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = vfma(av, bv[v], acc[i][v]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) vst(C + i * ldc + v * W, acc[i][v]);
}

// ---- epilogue: f32 tile (+ bias) -> C in the output dtype ---------------------------------------------

template <class T>
static void store_tile(const Problem& p, T* c, const T* bias, const float* tile, int64_t ldt, int64_t i0,
                       int64_t mc, int64_t j0, int64_t nc) {
  if (p.csc == 1 || p.rsc != 1) {
    for (int64_t i = 0; i < mc; ++i) {
      const float* t = tile + i * ldt;
      T* o = c + (i0 + i) * p.rsc + j0 * p.csc;
      const float bi = p.bias_mode == 2 ? to_f32(bias[(i0 + i) * p.bias_stride]) : 0.f;
      if (p.bias_mode == 1) {
        const T* bj = bias + j0 * p.bias_stride;
        const int64_t bs = p.bias_stride;
        if (p.csc == 1) {
          TALLOW_PRAGMA_SIMD
          for (int64_t j = 0; j < nc; ++j) o[j] = from_f32<T>(t[j] + to_f32(bj[j * bs]));
        } else {
          for (int64_t j = 0; j < nc; ++j) o[j * p.csc] = from_f32<T>(t[j] + to_f32(bj[j * bs]));
        }
      } else if (p.csc == 1) {
        TALLOW_PRAGMA_SIMD
        for (int64_t j = 0; j < nc; ++j) o[j] = from_f32<T>(t[j] + bi);
      } else {
        for (int64_t j = 0; j < nc; ++j) o[j * p.csc] = from_f32<T>(t[j] + bi);
      }
    }
  } else {  // rows of C contiguous (C^T = B^T A^T was computed): write down columns
    for (int64_t j = 0; j < nc; ++j) {
      T* o = c + i0 + (j0 + j) * p.csc;
      const float bj = p.bias_mode == 1 ? to_f32(bias[(j0 + j) * p.bias_stride]) : 0.f;
      for (int64_t i = 0; i < mc; ++i) {
        const float bi = p.bias_mode == 2 ? to_f32(bias[(i0 + i) * p.bias_stride]) : 0.f;
        o[i] = from_f32<T>(tile[i * ldt + j] + bi + bj);
      }
    }
  }
}

// ---- packed GEMM --------------------------------------------------------------------------------------

// C rows [i0, i0+mc) x panels [q0, q1) of a packed B block (K x ncb at column j0) -> C, through an f32 tile.
template <class T>
static void compute_block(const Problem& p, const T* a, T* c, const float* bp, int64_t j0, int64_t ncb, int64_t i0,
                          int64_t mc, int64_t q0, int64_t q1) {
  const int64_t K = p.K;
  const int64_t nk = ceil_div(K, KC), kc_max = round_up(ceil_div(K, nk), 8);
  const int64_t width = (q1 - q0) * NR;
  float* ap = scratch(1, round_up(mc, MR) * kc_max);
  float* tile = scratch(2, round_up(mc, MR) * width);
  for (int64_t k0 = 0; k0 < K; k0 += kc_max) {
    const int64_t kc = K - k0 < kc_max ? K - k0 : kc_max;
    pack_a(a, p.rsa, p.csa, i0, mc, k0, kc, ap);
    // B micro-panels (kc x NR) stay in L1 while the A micro-panels stream from L2.
    for (int64_t q = q0; q < q1; ++q)
      for (int64_t ir = 0; ir < mc; ir += MR)
        micro_kernel(kc, ap + ir * kc, kc, bp + q * K * NR + k0 * NR, tile + ir * width + (q - q0) * NR, width, k0 > 0);
  }
  const int64_t c0 = q0 * NR, nc = (ncb - c0 < width ? ncb - c0 : width);
  store_tile<T>(p, c, static_cast<const T*>(p.bias), tile, width, i0, mc, j0 + c0, nc);
}

// Splits M into nmb blocks of MR-multiples (balanced over the threads) and each B block's panels into ng groups.
struct Split {
  int64_t mc, nmb, ng;
};
static inline Split split_work(int64_t M, int64_t npanels, int64_t tasks_wanted, int threads) {
  int64_t nmb = ceil_div(M, MC);
  int64_t ng = ceil_div(npanels * NR, NCT);  // keep the f32 tile within L2
  if (nmb * ng < tasks_wanted) ng = ceil_div(tasks_wanted, nmb);
  if (ng > npanels) ng = npanels;
  if (nmb * ng < tasks_wanted) nmb = ceil_div(tasks_wanted, ng);
  if (threads > 1 && (nmb * ng) % threads) nmb = round_up(nmb * ng, threads) / ng;  // whole rounds
  int64_t mc = round_up(ceil_div(M, nmb), MR);
  if (mc > MC) mc = MC;
  nmb = ceil_div(M, mc);
  return {mc, nmb, ng};
}

// One GEMM of a batch on all threads: B blocks packed once, cooperatively; A packed per task.
template <class T>
static void packed_shared(const Problem& p, int64_t bt, int threads) {
  const T* a = static_cast<const T*>(p.a) + (p.aoff ? p.aoff[bt] : 0);
  const T* b = static_cast<const T*>(p.b) + (p.boff ? p.boff[bt] : 0);
  T* c = static_cast<T*>(p.c) + (p.coff ? p.coff[bt] : 0);
  const int64_t K = p.K;
  // B block width. Each block re-reads all of A, so with few rows (A small next to B) the blocks are kept
  // small enough (~2 MiB packed) to stay in cache between packing and use; with many rows, wide blocks
  // (up to NCB columns, ~16 MiB) stream A fewer times.
  int64_t ncb_small = (int64_t(512) << 10) / K / NR * NR;
  if (ncb_small < NR) ncb_small = NR;
  int64_t ncb_max;
  if (p.M < 2 * ncb_small) {
    ncb_max = ncb_small;
  } else {
    ncb_max = (int64_t(4) << 20) / K / NR * NR;
    if (ncb_max > NCB) ncb_max = NCB;
    if (ncb_max < NCT) ncb_max = NCT;
  }
  if (ncb_max > round_up(p.N, NR)) ncb_max = round_up(p.N, NR);
  float* bp = scratch(0, K * ncb_max);  // this thread's buffer, shared with the workers below
  for (int64_t j0 = 0; j0 < p.N; j0 += ncb_max) {
    const int64_t ncb = p.N - j0 < ncb_max ? p.N - j0 : ncb_max, npanels = ceil_div(ncb, NR);
    for_range(threads, npanels, [&](int64_t q0, int64_t q1) { pack_b(b, p.rsb, p.csb, K, j0, ncb, q0, q1, bp); });
    const Split sp = split_work(p.M, npanels, threads > 1 ? 2 * threads : 1, threads);
    for_range(threads, sp.nmb * sp.ng, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t ib = t / sp.ng, g = t % sp.ng;
        const int64_t i0 = ib * sp.mc, mc = p.M - i0 < sp.mc ? p.M - i0 : sp.mc;
        const int64_t q0 = npanels * g / sp.ng, q1 = npanels * (g + 1) / sp.ng;
        if (mc > 0 && q0 < q1) compute_block<T>(p, a, c, bp, j0, ncb, i0, mc, q0, q1);
      }
    });
  }
}

// Many GEMMs (batch >= 2 x threads): each task runs whole GEMMs of the batch on one thread.
template <class T>
static void packed_batched(const Problem& p, int threads) {
  for_range(threads, p.batch, [&](int64_t b0, int64_t b1) {
    for (int64_t bt = b0; bt < b1; ++bt) {
      const T* a = static_cast<const T*>(p.a) + (p.aoff ? p.aoff[bt] : 0);
      const T* b = static_cast<const T*>(p.b) + (p.boff ? p.boff[bt] : 0);
      T* c = static_cast<T*>(p.c) + (p.coff ? p.coff[bt] : 0);
      const int64_t ncb_max = NCT < round_up(p.N, NR) ? NCT : round_up(p.N, NR);
      float* bp = scratch(0, p.K * ncb_max);
      for (int64_t j0 = 0; j0 < p.N; j0 += ncb_max) {
        const int64_t ncb = p.N - j0 < ncb_max ? p.N - j0 : ncb_max, npanels = ceil_div(ncb, NR);
        pack_b(b, p.rsb, p.csb, p.K, j0, ncb, 0, npanels, bp);
        for (int64_t i0 = 0; i0 < p.M; i0 += MC)
          compute_block<T>(p, a, c, bp, j0, ncb, i0, p.M - i0 < MC ? p.M - i0 : MC, 0, npanels);
      }
    }
  });
}

template <class T>
static void run_packed(const Problem& p) {
  const int threads = useful_threads(2.0 * p.M * p.N * p.K * p.batch);
  if (p.batch >= 2 * (int64_t)threads) return packed_batched<T>(p, threads);
  const int per_gemm = useful_threads(2.0 * p.M * p.N * p.K);
  for (int64_t bt = 0; bt < p.batch; ++bt) packed_shared<T>(p, bt, per_gemm);
}

// ---- small M, B columns K-contiguous (linear's weight): dot products -----------------------------------

// out[i][j] for RM rows of x (f32, row stride ldx) and RN columns of B (rows of w, stride ldw), over K.
template <class T, int RM, int RN>
static inline void dot_tile(int64_t K, const float* x, int64_t ldx, const T* w, int64_t ldw, float* out /*[RM][RN]*/) {
  vec acc[RM][RN];
#pragma GCC unroll 8
  for (int m = 0; m < RM; ++m)
#pragma GCC unroll 8
    for (int n = 0; n < RN; ++n) acc[m][n] = vzero();
  int64_t k = 0;
  for (; k + W <= K; k += W) {
    vec wv[RN];
#pragma GCC unroll 8
    for (int n = 0; n < RN; ++n) wv[n] = vld(w + n * ldw + k);
#pragma GCC unroll 8
    for (int m = 0; m < RM; ++m) {
      const vec xv = vld(x + m * ldx + k);
#pragma GCC unroll 8
      for (int n = 0; n < RN; ++n) acc[m][n] = vfma(xv, wv[n], acc[m][n]);
    }
  }
  for (int m = 0; m < RM; ++m)
    for (int n = 0; n < RN; ++n) {
      float s = vsum(acc[m][n]);
      for (int64_t kk = k; kk < K; ++kk) s += x[m * ldx + kk] * to_f32(w[n * ldw + kk]);
      out[m * RN + n] = s;
    }
}

// Rows of x (M <= kSmallM) against columns [j0, j1) of B (rows of w): each tile of RN rows of w is read
// from memory once and reused from cache for every group of up to 4 rows of x.
template <class T>
static void dot_cols(const Problem& p, T* c, const T* bias, int64_t M, int64_t K, const float* x, int64_t ldx,
                     const T* b, int64_t j0, int64_t j1) {
  constexpr int RN1 = W >= 16 ? 8 : 4;  // w rows per tile for a single row of x (more streams in flight)
  constexpr int RN = W >= 16 ? 4 : 2;   // w rows per tile otherwise (4 x RN accumulators + RN + 1 registers)
  float r[4 * RN1];
  auto emit = [&](int64_t i0, int rm, int64_t j, int rn) {
    for (int m = 0; m < rm; ++m)
      for (int n = 0; n < rn; ++n) {
        const int64_t i = i0 + m, jj = j + n;
        float v = r[m * rn + n];
        if (p.bias_mode == 1) v += to_f32(bias[jj * p.bias_stride]);
        else if (p.bias_mode == 2) v += to_f32(bias[i * p.bias_stride]);
        c[i * p.rsc + jj * p.csc] = from_f32<T>(v);
      }
  };
  auto tile = [&](int64_t j, auto rn_tag) {
    constexpr int rn = decltype(rn_tag)::value;
    const T* w = b + j * p.csb;
    int64_t i = 0;
    for (; i + 4 <= M; i += 4) {
      dot_tile<T, 4, rn>(K, x + i * ldx, ldx, w, p.csb, r);
      emit(i, 4, j, rn);
    }
    switch (M - i) {
      case 3: dot_tile<T, 3, rn>(K, x + i * ldx, ldx, w, p.csb, r); emit(i, 3, j, rn); break;
      case 2: dot_tile<T, 2, rn>(K, x + i * ldx, ldx, w, p.csb, r); emit(i, 2, j, rn); break;
      case 1: dot_tile<T, 1, rn>(K, x + i * ldx, ldx, w, p.csb, r); emit(i, 1, j, rn); break;
      default: break;
    }
  };
  int64_t j = j0;
  if (M == 1)
    for (; j + RN1 <= j1; j += RN1) tile(j, std::integral_constant<int, RN1>{});
  for (; j + RN <= j1; j += RN) tile(j, std::integral_constant<int, RN>{});
  for (; j < j1; ++j) tile(j, std::integral_constant<int, 1>{});
}

// ---- small M, B rows N-contiguous: axpy over rows of B ----------------------------------------------------

constexpr int kAxpyNB = W >= 16 ? 4 : 2;  // vectors of columns per sweep (4 x NB accumulators)

template <class T, int RM>
static void axpy_rows(const Problem& p, T* c, const T* bias, int64_t K, const float* x, int64_t ldx, int64_t i0,
                      const T* b, int64_t j0, int64_t j1) {
  constexpr int NB = kAxpyNB;
  const float* xr = x + i0 * ldx;
  auto emit = [&](int64_t j, const float* t, int64_t n, int64_t ldt) {
    for (int m = 0; m < RM; ++m)
      for (int64_t q = 0; q < n; ++q) {
        const int64_t i = i0 + m, jj = j + q;
        float v = t[m * ldt + q];
        if (p.bias_mode == 1) v += to_f32(bias[jj * p.bias_stride]);
        else if (p.bias_mode == 2) v += to_f32(bias[i * p.bias_stride]);
        c[i * p.rsc + jj * p.csc] = from_f32<T>(v);
      }
  };
  float t[RM * NB * W];
  int64_t j = j0;
  for (; j + NB * W <= j1; j += NB * W) {
    vec acc[RM][NB];
    for (int m = 0; m < RM; ++m)
      for (int v = 0; v < NB; ++v) acc[m][v] = vzero();
    for (int64_t k = 0; k < K; ++k) {
      const T* br = b + k * p.rsb + j;
      vec bv[NB];
#pragma GCC unroll 4
      for (int v = 0; v < NB; ++v) bv[v] = vld(br + v * W);
#pragma GCC unroll 4
      for (int m = 0; m < RM; ++m) {
        const vec xv = vbcast(xr[m * ldx + k]);
#pragma GCC unroll 4
        for (int v = 0; v < NB; ++v) acc[m][v] = vfma(xv, bv[v], acc[m][v]);
      }
    }
    for (int m = 0; m < RM; ++m)
      for (int v = 0; v < NB; ++v) vst(t + m * NB * W + v * W, acc[m][v]);
    emit(j, t, NB * W, NB * W);
  }
  for (; j + W <= j1; j += W) {
    vec acc[RM];
    for (int m = 0; m < RM; ++m) acc[m] = vzero();
    for (int64_t k = 0; k < K; ++k) {
      const vec bv = vld(b + k * p.rsb + j);
      for (int m = 0; m < RM; ++m) acc[m] = vfma(vbcast(xr[m * ldx + k]), bv, acc[m]);
    }
    for (int m = 0; m < RM; ++m) vst(t + m * W, acc[m]);
    emit(j, t, W, W);
  }
  if (j < j1) {
    const int64_t n = j1 - j;
    for (int m = 0; m < RM; ++m)
      for (int64_t q = 0; q < n; ++q) t[m * W + q] = 0.f;
    for (int64_t k = 0; k < K; ++k) {
      const T* br = b + k * p.rsb + j;
      for (int m = 0; m < RM; ++m) {
        const float xv = xr[m * ldx + k];
        for (int64_t q = 0; q < n; ++q) t[m * W + q] += xv * to_f32(br[q]);
      }
    }
    emit(j, t, n, W);
  }
}

template <class T, bool kDot>
static void run_small(const Problem& p) {
  const int threads = useful_threads(2.0 * p.M * p.N * p.K * p.batch);
  const int64_t N = p.N, K = p.K, M = p.M;
  const int64_t quantum = kDot ? 8 : kAxpyNB * W;  // columns per unit of work
  int64_t nchunks = ceil_div(4 * (int64_t)threads, p.batch);
  const int64_t max_chunks = ceil_div(N, quantum);
  if (nchunks > max_chunks) nchunks = max_chunks;
  if (nchunks < 1) nchunks = 1;
  const int64_t chunk = round_up(ceil_div(N, nchunks), kDot ? 8 : kAxpyNB * W);
  nchunks = ceil_div(N, chunk);
  for_range(threads, p.batch * nchunks, [&](int64_t t0, int64_t t1) {
    // A rows as f32 with unit column stride: used in place when they already are, else converted once
    // per batch per call.
    constexpr bool kF32 = std::is_same_v<T, float>;
    float* xbuf = nullptr;
    const float* x = nullptr;
    int64_t ldx = K, x_batch = -1;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t bt = t / nchunks, j0 = (t % nchunks) * chunk, j1 = j0 + chunk < N ? j0 + chunk : N;
      const T* a = static_cast<const T*>(p.a) + (p.aoff ? p.aoff[bt] : 0);
      const T* b = static_cast<const T*>(p.b) + (p.boff ? p.boff[bt] : 0);
      T* c = static_cast<T*>(p.c) + (p.coff ? p.coff[bt] : 0);
      if (bt != x_batch) {
        if (kF32 && p.csa == 1) {
          x = reinterpret_cast<const float*>(a), ldx = p.rsa;
        } else {
          if (!xbuf) xbuf = scratch(3, M * K);
          for (int64_t i = 0; i < M; ++i) load_row(a + i * p.rsa, p.csa, xbuf + i * K, K);
          x = xbuf, ldx = K;
        }
        x_batch = bt;
      }
      const T* bias = static_cast<const T*>(p.bias);
      if constexpr (kDot) {
        dot_cols<T>(p, c, bias, M, K, x, ldx, b, j0, j1);
      } else {
        // Sweeps of a few vectors of columns (K x sweep of B stays in cache) outside, row groups inside.
        constexpr int64_t SW = kAxpyNB * W;
        for (int64_t js = j0; js < j1; js += SW) {
          const int64_t je = js + SW < j1 ? js + SW : j1;
          int64_t i = 0;
          auto rows = [&](auto rm_tag) {
            constexpr int RM = decltype(rm_tag)::value;
            axpy_rows<T, RM>(p, c, bias, K, x, ldx, i, b, js, je);
            i += RM;
          };
          for (; i + 4 <= M;) rows(std::integral_constant<int, 4>{});
          if (M - i == 3) rows(std::integral_constant<int, 3>{});
          else if (M - i == 2) rows(std::integral_constant<int, 2>{});
          else if (M - i == 1) rows(std::integral_constant<int, 1>{});
        }
      }
    }
  });
}

// ---- entry --------------------------------------------------------------------------------------------

static inline Problem transposed(const Problem& p) {
  Problem q = p;
  q.M = p.N;
  q.N = p.M;
  q.a = p.b, q.rsa = p.csb, q.csa = p.rsb;
  q.b = p.a, q.rsb = p.csa, q.csb = p.rsa;
  q.rsc = p.csc, q.csc = p.rsc;
  q.aoff = p.boff, q.boff = p.aoff;
  q.bias_mode = p.bias_mode == 1 ? 2 : p.bias_mode == 2 ? 1 : 0;
  return q;
}

// Relative cost of the packing that orientation p needs (copying packs count 1, transposing ones 4).
static inline double pack_cost(const Problem& p) {
  const double a_passes = (double)ceil_div(p.N, NCT);  // A is packed once per group of <= NCT columns
  const double m_pad = (double)round_up(p.M, MR) / (double)p.M, n_pad = (double)round_up(p.N, NR) / (double)p.N;
  const double a = (double)p.M * p.K * a_passes * (p.csa == 1 ? 1.0 : 4.0);
  const double b = (double)p.K * p.N * (p.csb == 1 ? 1.0 : 4.0);
  // Padding wastes micro-kernel work; weigh it against packing by its share of the flops.
  const double flops = 2.0 * p.M * p.N * p.K * m_pad * n_pad;
  return a + b + flops / 64.0;
}

template <class T>
static void run_t(const Problem& p0) {
  if (p0.batch == 0 || p0.M == 0 || p0.N == 0) return;
  if (p0.K == 0) {  // empty sum: C = bias or 0
    for (int64_t bt = 0; bt < p0.batch; ++bt) {
      T* c = static_cast<T*>(p0.c) + (p0.coff ? p0.coff[bt] : 0);
      const T* bias = static_cast<const T*>(p0.bias);
      for (int64_t i = 0; i < p0.M; ++i)
        for (int64_t j = 0; j < p0.N; ++j) {
          const float v = p0.bias_mode == 1 ? to_f32(bias[j * p0.bias_stride])
                          : p0.bias_mode == 2 ? to_f32(bias[i * p0.bias_stride]) : 0.f;
          c[i * p0.rsc + j * p0.csc] = from_f32<T>(v);
        }
    }
    return;
  }
  const Problem pt = transposed(p0);
  // GEMV paths (no packing) when one side is a few rows (decode): stream the other operand once.
  for (const Problem* q : {&p0, &pt}) {
    if (q->M <= kSmallM && q->rsb == 1 && q->K > 1) return run_small<T, true>(*q);
    if (q->M <= kSmallMAxpy && q->csb == 1) return run_small<T, false>(*q);
  }
  if (pack_cost(pt) < 0.8 * pack_cost(p0)) run_packed<T>(pt);
  else run_packed<T>(p0);
}

void run(Elt elt, const Problem& p) {
  switch (elt) {
    case Elt::F32: return run_t<float>(p);
    case Elt::F16: return run_t<f16_t>(p);
    case Elt::BF16: return run_t<bf16_t>(p);
  }
}

#undef TALLOW_GEMM_HAS_TRANSPOSE
#endif  // TALLOW_GEMM_BODY
