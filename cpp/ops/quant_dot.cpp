// Quantized dot products (quant_dot.h): activation quantization, the portable scalar kernels, the x86
// kernel sets (quant_dot_x86.h compiled for AVX2 and for AVX2 + VNNI) and the run-time choice.
// aarch64 runs the portable kernels: no NEON (vdotq) version yet, and no aarch64 compiler on the build
// machine to check one with.
#include "ops/quant_dot.h"

#include <algorithm>
#include <cmath>

#include "ops/gemm_kernel.h"  // gemm::isa_name(): follow the GEMM's kernel-set choice
#include "ops/quant_dot_blocks.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define TALLOW_QDOT_X86 1
#else
#define TALLOW_QDOT_X86 0
#endif

namespace tallow::ops::qdot {

// One W row against MR (<= 4) activation rows; out[m] = the dot products.
using RowFn = void (*)(const uint8_t* w, const uint8_t* const* act, int64_t nb, float* out);
constexpr int kMaxMR = 4;  // activation rows per pass over a W row (x86: 4 accumulators + 4 int sums)

namespace portable {

template <class B, int MR>
void dot_row(const uint8_t* w, const uint8_t* const* act, int64_t nb, float* out) {
  float acc[MR] = {};
  alignas(32) int8_t q[32];
  for (int64_t ib = 0; ib < nb; ++ib, w += B::kBytes) {
    if constexpr (B::kBlock == 32) {
      B::group_s(w, 0, q);
      const float d = B::d(w);
      for (int m = 0; m < MR; ++m) {
        const Act32* a = reinterpret_cast<const Act32*>(act[m]) + ib;
        int32_t s = 0;
        for (int j = 0; j < 32; ++j) s += q[j] * a->q[j];
        acc[m] += d * a->d * (float)s;
        if constexpr (B::kMin) acc[m] += B::m(w) * a->s;
      }
    } else {
      int16_t sc[16], mn[16];
      B::scales(w, sc, mn);
      int32_t isum[MR] = {};
      for (int g = 0; g < 8; ++g) {
        B::group_s(w, g, q);
        for (int m = 0; m < MR; ++m) {
          const int8_t* x = reinterpret_cast<const Act256*>(act[m])[ib].q + 32 * g;
          int32_t s0 = 0, s1 = 0;
          for (int j = 0; j < 16; ++j) s0 += q[j] * x[j], s1 += q[j + 16] * x[j + 16];
          isum[m] += sc[2 * g] * s0 + sc[2 * g + 1] * s1;
        }
      }
      for (int m = 0; m < MR; ++m) {
        const Act256* a = reinterpret_cast<const Act256*>(act[m]) + ib;
        acc[m] += B::d(w) * a->d * (float)isum[m];
        if constexpr (B::kMin) {
          int32_t ms = 0;
          for (int j = 0; j < 16; ++j) ms += mn[j] * a->bsums[j];
          acc[m] -= B::dmin(w) * a->d * (float)ms;
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m) out[m] = acc[m];
}

}  // namespace portable

#if TALLOW_QDOT_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,bmi,bmi2"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2")
#endif
namespace avx2 {
#define TALLOW_QDOT_VNNI 0
#include "ops/quant_dot_x86.h"
#undef TALLOW_QDOT_VNNI
}  // namespace avx2
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c,bmi,bmi2"))), \
                             apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c,bmi,bmi2")
#endif
namespace vnni {
#define TALLOW_QDOT_VNNI 1
#include "ops/quant_dot_x86.h"
#undef TALLOW_QDOT_VNNI
}  // namespace vnni
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif  // TALLOW_QDOT_X86

namespace {

enum class Set { Portable, Avx2, Vnni };

Set kernel_set() {
#if TALLOW_QDOT_X86
  const char* isa = gemm::isa_name();
  if (isa[0] == 'a' && isa[3] == '5' && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl"))
    return Set::Vnni;
  if (isa[0] == 'a') return Set::Avx2;  // "avx2", or "avx512" on a CPU without VNNI
#endif
  return Set::Portable;
}

template <class B>
RowFn pick(Set s, int mr) {
  static constexpr RowFn portable_fns[kMaxMR] = {portable::dot_row<B, 1>, portable::dot_row<B, 2>,
                                                 portable::dot_row<B, 3>, portable::dot_row<B, 4>};
#if TALLOW_QDOT_X86
  static constexpr RowFn avx2_fns[kMaxMR] = {avx2::dot_row<B, 1>, avx2::dot_row<B, 2>, avx2::dot_row<B, 3>,
                                             avx2::dot_row<B, 4>};
  static constexpr RowFn vnni_fns[kMaxMR] = {vnni::dot_row<B, 1>, vnni::dot_row<B, 2>, vnni::dot_row<B, 3>,
                                             vnni::dot_row<B, 4>};
  if (s == Set::Vnni) return vnni_fns[mr - 1];
  if (s == Set::Avx2) return avx2_fns[mr - 1];
#else
  (void)s;
#endif
  return portable_fns[mr - 1];
}

RowFn row_fn(DType t, Set s, int mr) {
  switch (t) {
    case DType::Q4_0: return pick<Q4_0B>(s, mr);
    case DType::Q4_1: return pick<Q4_1B>(s, mr);
    case DType::Q5_0: return pick<Q5_0B>(s, mr);
    case DType::Q5_1: return pick<Q5_1B>(s, mr);
    case DType::Q8_0: return pick<Q8_0B>(s, mr);
    case DType::IQ4_NL: return pick<IQ4_NLB>(s, mr);
    case DType::Q2_K: return pick<Q2_KB>(s, mr);
    case DType::Q3_K: return pick<Q3_KB>(s, mr);
    case DType::Q4_K: return pick<Q4_KB>(s, mr);
    case DType::Q5_K: return pick<Q5_KB>(s, mr);
    case DType::Q6_K: return pick<Q6_KB>(s, mr);
    case DType::IQ4_XS: return pick<IQ4_XSB>(s, mr);
    default: return nullptr;
  }
}

// d = max|x| / 127 and q = round(x / d) over n elements (0 for an all-zero block).
float quantize_block(const float* x, int n, int8_t* q) {
  float amax = 0.f;
  for (int j = 0; j < n; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
  for (int j = 0; j < n; ++j) q[j] = (int8_t)std::nearbyint(x[j] * id);
  return d;
}

}  // namespace

bool supported(DType w) { return row_fn(w, Set::Portable, 1) != nullptr; }

int64_t act_block(DType w) {
  switch (w) {
    case DType::Q2_K: case DType::Q3_K: case DType::Q4_K: case DType::Q5_K: case DType::Q6_K: case DType::IQ4_XS:
      return 256;
    default: return 32;
  }
}

int64_t act_row_bytes(DType w, int64_t K) {
  return act_block(w) == 256 ? K / 256 * (int64_t)sizeof(Act256) : K / 32 * (int64_t)sizeof(Act32);
}

void quantize_rows(DType w, const float* x, int64_t rsx, int64_t M, int64_t K, uint8_t* dst) {
  const int64_t rb = act_row_bytes(w, K);
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * rsx;
    if (act_block(w) == 256) {
      Act256* a = reinterpret_cast<Act256*>(dst + m * rb);
      for (int64_t ib = 0; ib < K / 256; ++ib) {
        a[ib].d = quantize_block(xr + 256 * ib, 256, a[ib].q);
        for (int j = 0; j < 16; ++j) {
          int s = 0;
          for (int l = 0; l < 16; ++l) s += a[ib].q[16 * j + l];
          a[ib].bsums[j] = (int16_t)s;
        }
      }
    } else {
      Act32* a = reinterpret_cast<Act32*>(dst + m * rb);
      for (int64_t ib = 0; ib < K / 32; ++ib) {
        a[ib].d = quantize_block(xr + 32 * ib, 32, a[ib].q);
        int s = 0;
        for (int l = 0; l < 32; ++l) s += a[ib].q[l];
        a[ib].s = a[ib].d * (float)s;
      }
    }
  }
}

void dot_rows(DType w, const uint8_t* wbase, int64_t wrs, int64_t n0, int64_t n1, const uint8_t* act, int64_t M,
              int64_t K, float* out, int64_t rso, const float* bias, int64_t bstride) {
  const Set s = kernel_set();
  RowFn fns[kMaxMR];
  for (int mr = 1; mr <= kMaxMR; ++mr) fns[mr - 1] = row_fn(w, s, mr);
  const int64_t nb = K / dtype_block_size(w), rb = act_row_bytes(w, K);
  const uint8_t* rows[kMaxMR];
  float r[kMaxMR];
  // W row outer: its blocks are read from memory once and stay in L1 for the passes over x's rows.
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = wbase + n * wrs;
    const float b = bias ? bias[n * bstride] : 0.f;
    for (int64_t m0 = 0; m0 < M; m0 += kMaxMR) {
      const int mr = (int)std::min<int64_t>(kMaxMR, M - m0);
      for (int i = 0; i < mr; ++i) rows[i] = act + (m0 + i) * rb;
      fns[mr - 1](wr, rows, nb, r);
      for (int i = 0; i < mr; ++i) out[(m0 + i) * rso + n] = r[i] + b;
    }
  }
}

const char* kernel_name() {
  switch (kernel_set()) {
    case Set::Vnni: return "avx512-vnni";
    case Set::Avx2: return "avx2";
    default: return "portable";
  }
}

}  // namespace tallow::ops::qdot
