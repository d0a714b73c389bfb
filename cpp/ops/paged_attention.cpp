// Family status: CPU implementation complete and tested (tests/python/test_paged_attention.py,
// test_paged_attention_fp8.py).
// Paged attention and the KV-cache write on CPU (see paged_attention.h for the contracts).
//
// paged_attention, for every sequence b, kv head g and query i of b (position p = ctx_b + i,
// ctx_b = seq_lens[b] - n_b), over the query heads h = g * group .. (g + 1) * group - 1:
//   visible keys   j in [lo, p]   lo = 0, or max(0, p - W + 1) with a sliding window W
//   s_j            = <scale * q_h, k_j>, then softcap * tanh(s_j / softcap) when softcap > 0
//   out            = sum_j softmax(s)_j v_j
// Key j's rows are read through the block table: block table[j / block_size], row j % block_size.
//
// Work items are (sequence, block of queries, range of kv heads, key range). An item walks its
// key range in tiles of kTile keys (aligned to multiples of kTile; a tile may span several cache
// blocks). For each kv head, the tile's K and V rows are converted to f32 once (f16/bf16 caches;
// f32 rows are read in place) and shared by the head's group * nq query rows, four query heads
// at a time where the group allows (each loaded K/V vector feeds four rows). Each row keeps an
// online softmax (running max m, sum l, f32 accumulator) over the keys it can see in the tile, so
// masked keys cost nothing. The next tile's rows are prefetched while the current one is
// computed, key by key over all the item's heads (contiguous in the cache), which is what makes
// decode run near memory speed. When the items are few compared to the threads (small decode
// batches, short prefills), query blocks shrink, long key ranges are split (flash-decoding: each
// part leaves (m, l, acc) per row and a second pass merges them), and heads are divided.
#include "ops/paged_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "core/parallel.h"
#include "core/simd.h"
#include "ops/common.h"
#include "ops/rows.h"

#if defined(_MSC_VER) && !defined(__clang__)
#define PA_INLINE __forceinline
#define PA_PREFETCH(p) ((void)(p))
#define PA_SIMD_SUM(...) __pragma(omp simd reduction(+ : __VA_ARGS__))
#else
#define PA_INLINE inline __attribute__((always_inline))
#define PA_PREFETCH(p) __builtin_prefetch(p)
#define PA_PRAGMA(...) _Pragma(#__VA_ARGS__)
#define PA_SIMD_SUM(...) PA_PRAGMA(omp simd reduction(+ : __VA_ARGS__))
#endif

namespace tallow::ops {

namespace {

constexpr int64_t kTile = 64;         // keys per tile
constexpr int64_t kTargetRows = 64;   // query rows (query heads x queries) per kv head and item
constexpr int64_t kMaxQueryBlock = 32;
constexpr int64_t kMinSplitKeys = 256;  // fewest keys per part of a split key range

// ---- small views ------------------------------------------------------------------------------

// An i32/i64 tensor of rank 1 or 2 read in place (any strides).
struct IndexView {
  const void* data = nullptr;
  bool i32 = true;
  int64_t s0 = 0, s1 = 0;
  int64_t operator()(int64_t i, int64_t j = 0) const {
    const int64_t o = i * s0 + j * s1;
    return i32 ? (int64_t) static_cast<const int32_t*>(data)[o] : static_cast<const int64_t*>(data)[o];
  }
};

IndexView index_view(const Tensor& t) {
  return {t.data_ptr(), t.dtype() == DType::I32, t.dim() > 0 ? t.stride(0) : 0, t.dim() > 1 ? t.stride(1) : 0};
}

// One layer's cache: element strides of block, row and head; the head vector is contiguous.
struct CacheView {
  const void* base;
  int64_t sb, sr, sh;
};

CacheView cache_view(const Tensor& t) { return {t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)}; }

void check_index(const char* op, const Tensor& t, const char* name, int64_t ndim) {
  check_defined(op, t, name);
  check_dtype(op, t, name, {DType::I32, DType::I64});
  check_dim(op, t, name, ndim);
}


void check_kv_scale(const char* op, float s, const char* name) {
  TALLOW_CHECK(std::isfinite(s) && s > 0.0f, op, ": ", name, " must be finite and > 0, got ", s);
}

// Calls f(tag) with a value of the storage type of a KV-cache dtype (the float dtypes and fp8).
template <class F>
void dispatch_cache(const char* op, DType d, F&& f) {
  switch (d) {
    case DType::F32: return f(float{});
    case DType::F16: return f(f16_t{});
    case DType::BF16: return f(bf16_t{});
    case DType::F8E4M3: return f(f8e4m3_t{});
    default: throw TypeError(str_cat(op, ": unsupported cache dtype ", dtype_name(d)));
  }
}

// f8e4m3 -> f32 for all 256 codes (a table lookup instead of the branchy decode, in the hot loop).
const float* f8_table() {
  static const auto table = [] {
    std::vector<float> t(256);
    for (int i = 0; i < 256; ++i) t[(size_t)i] = f8e4m3_to_f32((uint8_t)i);
    return t;
  }();
  return table.data();
}

// ---- reshape_and_cache --------------------------------------------------------------------------

template <class S, class D>
TALLOW_SIMD_CLONES void convert_row(const S* TALLOW_RESTRICT a, D* TALLOW_RESTRICT o, int64_t n) {
  TALLOW_PRAGMA_SIMD
  for (int64_t d = 0; d < n; ++d) o[d] = from_f32<D>(to_f32(a[d]));
}

// FP8 rows hold x / scale (one f32 division, then one rounding to e4m3: nearest even, saturating).
template <class S>
void convert_row_f8(const S* TALLOW_RESTRICT a, f8e4m3_t* TALLOW_RESTRICT o, int64_t n, float scale) {
  for (int64_t d = 0; d < n; ++d) o[d] = from_f32<f8e4m3_t>(to_f32(a[d]) / scale);
}

template <class S, class D>
void write_rows(const Tensor& src, const Tensor& cache, const std::vector<int64_t>& slots, int64_t bs, float scale) {
  const int64_t T = src.size(0), H = src.size(1), n = src.size(2);
  const int64_t sst = src.stride(0), ssh = src.stride(1);
  const CacheView c = cache_view(cache);
  const S* sbase = static_cast<const S*>(src.data_ptr());
  D* cbase = static_cast<D*>(const_cast<void*>(c.base));
  parallel_rows(T * H, n, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t t = r / H, h = r % H, s = slots[(size_t)t];
      if (s < 0) continue;
      D* dst = cbase + (s / bs) * c.sb + (s % bs) * c.sr + h * c.sh;
      if constexpr (std::is_same_v<D, f8e4m3_t>) convert_row_f8<S>(sbase + t * sst + h * ssh, dst, n, scale);
      else convert_row<S, D>(sbase + t * sst + h * ssh, dst, n);
    }
  });
}

void write_cache(const char* op, const Tensor& src, const Tensor& cache, const std::vector<int64_t>& slots,
                 int64_t bs, float scale) {
  TALLOW_DISPATCH_FLOAT(op, src.dtype(), [&] {
    using S = scalar_t;
    dispatch_cache(op, cache.dtype(), [&](auto tag) { write_rows<S, decltype(tag)>(src, cache, slots, bs, scale); });
  });
}

// ---- paged attention ------------------------------------------------------------------------------

struct Problem {
  int64_t Hq, Hk, D, Dv, BS, group, window;
  float scale, softcap;  // scale includes k_scale for fp8 caches
  float vscale;          // v_scale for fp8 caches (1 otherwise), applied to the normalised output
  const void* q;
  int64_t qst, qsh;  // q strides of token and head
  CacheView k, v;
  IndexView table;
  void* out;  // contiguous [T, Hq, Dv]
};

struct Seq {
  int64_t q0, n, ctx;  // first row in q, number of queries, position of the first query
};

struct Item {
  int64_t b, g0, g1, i0, i1;  // sequence, kv heads [g0, g1), its queries [i0, i1)
  int64_t j0, j1;             // keys [j0, j1)
  int64_t part;          // -1: writes the output; else the first float of its partial results
  int64_t cost;
};

// A split item's parts (consecutive in the partial buffer) and where they merge to.
struct Merge {
  int64_t b, g0, g1, i0, i1, part, nparts;
};

// Keys visible to the query at position p: [lo, p].
inline int64_t visible_lo(const Problem& P, int64_t p) {
  return P.window > 0 ? std::max<int64_t>(0, p - P.window + 1) : 0;
}

struct Scratch {
  std::vector<float> qf, kf, vf, sc, m, l, acc;
  std::vector<const float*> kp, vp;
};

// Rows of one tile as f32 pointers: f32 cache rows in place, other dtypes converted into `buf`.
template <class C>
PA_INLINE void gather_rows(const Problem& P, const CacheView& c, int64_t n, int64_t b, int64_t g, int64_t t0,
                           int64_t t1, std::vector<float>& buf, std::vector<const float*>& ptrs) {
  const C* base = static_cast<const C*>(c.base) + g * c.sh;
  for (int64_t j = t0; j < t1; ++j) {
    const C* src = base + P.table(b, j / P.BS) * c.sb + (j % P.BS) * c.sr;
    if constexpr (std::is_same_v<C, float>) {
      ptrs[(size_t)(j - t0)] = src;
    } else {
      float* TALLOW_RESTRICT dst = buf.data() + (j - t0) * n;
      const C* TALLOW_RESTRICT s = src;
      if constexpr (std::is_same_v<C, f8e4m3_t>) {
        const float* lut = f8_table();
        for (int64_t d = 0; d < n; ++d) dst[d] = lut[s[d].bits];
      } else {
        TALLOW_PRAGMA_SIMD
        for (int64_t d = 0; d < n; ++d) dst[d] = to_f32(s[d]);
      }
      ptrs[(size_t)(j - t0)] = dst;
    }
  }
}

// Software prefetch of the next tile's K and V rows of an item's kv heads, key by key (the
// heads of one key are contiguous in the cache), issued one (key, head) row at a time while the
// current tile is computed. One head's consecutive keys are Hk * D elements apart, too far for
// the hardware prefetcher; and a burst of a whole tile's prefetches would stall until most lines
// arrived, with no work left to overlap.
struct Prefetcher {
  const char* k[kTile];  // head g0's row of each key of the next tile
  const char* v[kTile];
  int64_t kbytes = 0, vbytes = 0, khead = 0, vhead = 0;  // bytes of a row; bytes between heads
  int64_t nh = 0, total = 0, next = 0, j = 0, h = 0;

  template <class C>
  PA_INLINE void start(const Problem& P, int64_t b, int64_t g0, int64_t g1, int64_t t0, int64_t t1) {
    const C* kb = static_cast<const C*>(P.k.base) + g0 * P.k.sh;
    const C* vb = static_cast<const C*>(P.v.base) + g0 * P.v.sh;
    kbytes = P.D * (int64_t)sizeof(C);
    vbytes = P.Dv * (int64_t)sizeof(C);
    khead = P.k.sh * (int64_t)sizeof(C);
    vhead = P.v.sh * (int64_t)sizeof(C);
    const int64_t n = std::max<int64_t>(t1 - t0, 0);
    nh = g1 - g0;
    total = n * nh;
    next = j = h = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t blk = P.table(b, (t0 + i) / P.BS), row = (t0 + i) % P.BS;
      k[i] = reinterpret_cast<const char*>(kb + blk * P.k.sb + row * P.k.sr);
      v[i] = reinterpret_cast<const char*>(vb + blk * P.v.sb + row * P.v.sr);
    }
  }
  PA_INLINE void step(int64_t rows) {
    for (const int64_t end = std::min(total, next + rows); next < end; ++next) {
      const char* kr = k[j] + h * khead;
      const char* vr = v[j] + h * vhead;
      for (int64_t o = 0; o < kbytes; o += 64) PA_PREFETCH(kr + o);
      for (int64_t o = 0; o < vbytes; o += 64) PA_PREFETCH(vr + o);
      if (++h == nh) h = 0, ++j;
    }
  }
  PA_INLINE void finish() { step(total); }
};

// Dot products of query rows with key rows (length n), several at once: independent sums hide
// the FMA latency and each loaded q or k vector feeds more than one sum.
PA_INLINE void dot_1x4(const float* TALLOW_RESTRICT q, const float* TALLOW_RESTRICT k0, const float* TALLOW_RESTRICT k1,
                       const float* TALLOW_RESTRICT k2, const float* TALLOW_RESTRICT k3, int64_t n, float* s) {
  float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
  PA_SIMD_SUM(d0, d1, d2, d3)
  for (int64_t d = 0; d < n; ++d) {
    d0 += q[d] * k0[d];
    d1 += q[d] * k1[d];
    d2 += q[d] * k2[d];
    d3 += q[d] * k3[d];
  }
  s[0] = d0, s[1] = d1, s[2] = d2, s[3] = d3;
}

PA_INLINE float dot_1x1(const float* TALLOW_RESTRICT q, const float* TALLOW_RESTRICT k0, int64_t n) {
  float d0 = 0.0f;
  PA_SIMD_SUM(d0)
  for (int64_t d = 0; d < n; ++d) d0 += q[d] * k0[d];
  return d0;
}

// Four query rows (q, q + n, q + 2n, q + 3n) against two keys: s[r * ss + 0..1].
PA_INLINE void dot_4x2(const float* TALLOW_RESTRICT q, const float* TALLOW_RESTRICT k0, const float* TALLOW_RESTRICT k1,
                       int64_t n, float* s, int64_t ss) {
  const float *q0 = q, *q1 = q + n, *q2 = q + 2 * n, *q3 = q + 3 * n;
  float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f, b0 = 0.0f, b1 = 0.0f, b2 = 0.0f, b3 = 0.0f;
  PA_SIMD_SUM(a0, a1, a2, a3, b0, b1, b2, b3)
  for (int64_t d = 0; d < n; ++d) {
    const float x = k0[d], y = k1[d];
    a0 += q0[d] * x;
    a1 += q1[d] * x;
    a2 += q2[d] * x;
    a3 += q3[d] * x;
    b0 += q0[d] * y;
    b1 += q1[d] * y;
    b2 += q2[d] * y;
    b3 += q3[d] * y;
  }
  s[0] = a0, s[1] = b0, s[ss] = a1, s[ss + 1] = b1, s[2 * ss] = a2, s[2 * ss + 1] = b2, s[3 * ss] = a3,
  s[3 * ss + 1] = b3;
}

PA_INLINE void dot_4x1(const float* TALLOW_RESTRICT q, const float* TALLOW_RESTRICT k0, int64_t n, float* s,
                       int64_t ss) {
  const float *q0 = q, *q1 = q + n, *q2 = q + 2 * n, *q3 = q + 3 * n;
  float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
  PA_SIMD_SUM(a0, a1, a2, a3)
  for (int64_t d = 0; d < n; ++d) {
    const float x = k0[d];
    a0 += q0[d] * x;
    a1 += q1[d] * x;
    a2 += q2[d] * x;
    a3 += q3[d] * x;
  }
  s[0] = a0, s[ss] = a1, s[2 * ss] = a2, s[3 * ss] = a3;
}

// e^x for the softmax's exponents x <= 0, in f32 arithmetic that vectorises (std::exp does not
// without -ffast-math): x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes' expf polynomial
// (about 1 ulp), 2^n built in the exponent bits. Below -87.3 (2^-126) the result is 0.
PA_INLINE float exp_nonpos(float x) {
  const float xc = x < -87.3f ? -87.3f : x;
  const float t = xc * 1.44269504f + 12582912.0f;  // 1.5 * 2^23: round(x log2 e) lands in the low bits
  const float nf = t - 12582912.0f;
  const float r = (xc - nf * 0.693359375f) - nf * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t ti;
  std::memcpy(&ti, &t, 4);
  const int32_t bits = (ti - 0x4b400000 + 127) * (1 << 23);  // 2^n, n = ti - bits(1.5 * 2^23)
  float scale;
  std::memcpy(&scale, &bits, 4);
  return x < -87.3f ? 0.0f : p * scale;
}

// Online softmax step of one row over the scores w[0..n) of a tile: soft-caps them, updates the
// running max m and sum l, rescales the accumulator when m grows, and turns w into the weights
// exp(w - m) for the tile's V rows.
PA_INLINE void softmax_step(float* TALLOW_RESTRICT w, int64_t n, float softcap, float& m, float& l,
                            float* TALLOW_RESTRICT acc, int64_t Dv) {
  if (softcap > 0.0f) {
    const float inv = 1.0f / softcap;
    for (int64_t j = 0; j < n; ++j) w[j] = softcap * std::tanh(w[j] * inv);
  }
  float mt = w[0];
  for (int64_t j = 1; j < n; ++j) mt = mt < w[j] ? w[j] : mt;
  const float mnew = std::max(m, mt);
  if (mnew > m && l > 0.0f) {
    const float alpha = std::exp(m - mnew);
    l *= alpha;
    TALLOW_PRAGMA_SIMD
    for (int64_t d = 0; d < Dv; ++d) acc[d] *= alpha;
  }
  m = mnew;
  float lt = 0.0f;
  PA_SIMD_SUM(lt)
  for (int64_t j = 0; j < n; ++j) {
    w[j] = exp_nonpos(w[j] - mnew);
    lt += w[j];
  }
  l += lt;
}

// acc += sum_j w[j] v_j for one row, four keys per pass over acc.
PA_INLINE void pv_1(const float* TALLOW_RESTRICT w, const float* const* vp, int64_t n, float* TALLOW_RESTRICT acc,
                    int64_t Dv, Prefetcher& pf) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    pf.step(2);
    const float *TALLOW_RESTRICT v0 = vp[j], *TALLOW_RESTRICT v1 = vp[j + 1], *TALLOW_RESTRICT v2 = vp[j + 2],
                *TALLOW_RESTRICT v3 = vp[j + 3];
    const float w0 = w[j], w1 = w[j + 1], w2 = w[j + 2], w3 = w[j + 3];
    TALLOW_PRAGMA_SIMD
    for (int64_t d = 0; d < Dv; ++d) acc[d] += w0 * v0[d] + w1 * v1[d] + w2 * v2[d] + w3 * v3[d];
  }
  for (; j < n; ++j) {
    const float* TALLOW_RESTRICT v0 = vp[j];
    const float w0 = w[j];
    TALLOW_PRAGMA_SIMD
    for (int64_t d = 0; d < Dv; ++d) acc[d] += w0 * v0[d];
  }
}

// The same for four rows (weights w + r * ws, accumulators acc + r * Dv) sharing each V load.
PA_INLINE void pv_4(const float* TALLOW_RESTRICT w, int64_t ws, const float* const* vp, int64_t n,
                    float* TALLOW_RESTRICT acc, int64_t Dv, Prefetcher& pf) {
  float *a0 = acc, *a1 = acc + Dv, *a2 = acc + 2 * Dv, *a3 = acc + 3 * Dv;
  const float *w0 = w, *w1 = w + ws, *w2 = w + 2 * ws, *w3 = w + 3 * ws;
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) {
    pf.step(1);
    const float *TALLOW_RESTRICT x = vp[j], *TALLOW_RESTRICT y = vp[j + 1];
    const float c0 = w0[j], c1 = w1[j], c2 = w2[j], c3 = w3[j];
    const float e0 = w0[j + 1], e1 = w1[j + 1], e2 = w2[j + 1], e3 = w3[j + 1];
    TALLOW_PRAGMA_SIMD
    for (int64_t d = 0; d < Dv; ++d) {
      const float xv = x[d], yv = y[d];
      a0[d] += c0 * xv + e0 * yv;
      a1[d] += c1 * xv + e1 * yv;
      a2[d] += c2 * xv + e2 * yv;
      a3[d] += c3 * xv + e3 * yv;
    }
  }
  for (; j < n; ++j) {
    const float* TALLOW_RESTRICT x = vp[j];
    const float c0 = w0[j], c1 = w1[j], c2 = w2[j], c3 = w3[j];
    TALLOW_PRAGMA_SIMD
    for (int64_t d = 0; d < Dv; ++d) {
      const float xv = x[d];
      a0[d] += c0 * xv;
      a1[d] += c1 * xv;
      a2[d] += c2 * xv;
      a3[d] += c3 * xv;
    }
  }
}

// One work item: kv heads g in [g0, g1), queries i in [i0, i1), keys [j0, j1) (clipped per
// query to what it can see). Row r = ((g - g0) * nq + (i - i0)) * G + hh is query head g * G + hh
// of query i.
template <class Q, class C>
TALLOW_SIMD_CLONES void attend_item(const Problem& P, const Seq& s, const Item& it, Scratch& S, float* partial) {
  const int64_t D = P.D, Dv = P.Dv, G = P.group;
  const int64_t nq = it.i1 - it.i0, R = (it.g1 - it.g0) * nq * G;
  S.qf.resize((size_t)(R * D));
  S.m.assign((size_t)R, -std::numeric_limits<float>::infinity());
  S.l.assign((size_t)R, 0.0f);
  S.acc.assign((size_t)(R * Dv), 0.0f);
  S.sc.resize((size_t)(4 * kTile));
  S.kp.resize((size_t)kTile);
  S.vp.resize((size_t)kTile);
  if (!std::is_same_v<C, float>) {
    S.kf.resize((size_t)(kTile * D));
    S.vf.resize((size_t)(kTile * Dv));
  }
  // Query rows in f32, pre-multiplied by the scale.
  const Q* qbase = static_cast<const Q*>(P.q);
  for (int64_t g = it.g0; g < it.g1; ++g)
    for (int64_t i = it.i0; i < it.i1; ++i)
      for (int64_t hh = 0; hh < G; ++hh) {
        const Q* TALLOW_RESTRICT src = qbase + (s.q0 + i) * P.qst + (g * G + hh) * P.qsh;
        float* TALLOW_RESTRICT dst = S.qf.data() + (((g - it.g0) * nq + i - it.i0) * G + hh) * D;
        const float sc = P.scale;
        TALLOW_PRAGMA_SIMD
        for (int64_t d = 0; d < D; ++d) dst[d] = sc * to_f32(src[d]);
      }

  float* TALLOW_RESTRICT sc = S.sc.data();
  Prefetcher pf;
  for (int64_t t0 = it.j0, t1; t0 < it.j1; t0 = t1) {
    t1 = std::min(it.j1, (t0 / kTile + 1) * kTile);
    pf.start<C>(P, it.b, it.g0, it.g1, t1, std::min(it.j1, t1 + kTile));
    for (int64_t g = it.g0; g < it.g1; ++g) {
      gather_rows<C>(P, P.k, D, it.b, g, t0, t1, S.kf, S.kp);
      gather_rows<C>(P, P.v, Dv, it.b, g, t0, t1, S.vf, S.vp);
      for (int64_t i = it.i0; i < it.i1; ++i) {
        const int64_t p = s.ctx + i;
        const int64_t a = std::max(t0, visible_lo(P, p)), e = std::min(t1, p + 1);
        if (a >= e) continue;
        const int64_t n = e - a;
        const float* const* kp = S.kp.data() + (a - t0);  // kp[j]: key a + j's row
        const float* const* vp = S.vp.data() + (a - t0);
        // The query's G heads (rows r0 ..) see the same keys: four rows at a time, then one.
        const int64_t r0 = ((g - it.g0) * nq + i - it.i0) * G;
        int64_t hh = 0;
        for (; hh + 4 <= G; hh += 4) {
          const int64_t r = r0 + hh;
          const float* qv = S.qf.data() + r * D;
          int64_t j = 0;
          for (; j + 2 <= n; j += 2) {
            pf.step(1);
            dot_4x2(qv, kp[j], kp[j + 1], D, sc + j, kTile);
          }
          for (; j < n; ++j) dot_4x1(qv, kp[j], D, sc + j, kTile);
          for (int64_t k = 0; k < 4; ++k)
            softmax_step(sc + k * kTile, n, P.softcap, S.m[(size_t)(r + k)], S.l[(size_t)(r + k)],
                         S.acc.data() + (r + k) * Dv, Dv);
          pv_4(sc, kTile, vp, n, S.acc.data() + r * Dv, Dv, pf);
        }
        for (; hh < G; ++hh) {
          const int64_t r = r0 + hh;
          const float* qv = S.qf.data() + r * D;
          int64_t j = 0;
          for (; j + 4 <= n; j += 4) {
            pf.step(2);
            dot_1x4(qv, kp[j], kp[j + 1], kp[j + 2], kp[j + 3], D, sc + j);
          }
          for (; j < n; ++j) sc[j] = dot_1x1(qv, kp[j], D);
          softmax_step(sc, n, P.softcap, S.m[(size_t)r], S.l[(size_t)r], S.acc.data() + r * Dv, Dv);
          pv_1(sc, vp, n, S.acc.data() + r * Dv, Dv, pf);
        }
      }
    }
    pf.finish();
  }

  if (it.part >= 0) {  // one part of a split key range: leave (m, l, acc) per row for the merge
    for (int64_t r = 0; r < R; ++r) {
      float* dst = partial + it.part + r * (2 + Dv);
      dst[0] = S.m[(size_t)r];
      dst[1] = S.l[(size_t)r];
      std::copy(S.acc.begin() + r * Dv, S.acc.begin() + (r + 1) * Dv, dst + 2);
    }
    return;
  }
  Q* obase = static_cast<Q*>(P.out);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t hh = r % G, i = it.i0 + (r / G) % nq, g = it.g0 + r / (G * nq);
    const float l = S.l[(size_t)r], inv = l > 0.0f ? P.vscale / l : 0.0f;
    const float* TALLOW_RESTRICT av = S.acc.data() + r * Dv;
    Q* TALLOW_RESTRICT o = obase + ((s.q0 + i) * P.Hq + g * G + hh) * Dv;
    TALLOW_PRAGMA_SIMD
    for (int64_t d = 0; d < Dv; ++d) o[d] = from_f32<Q>(av[d] * inv);
  }
}

// Merges the parts of a split key range: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s.
template <class Q>
void merge_parts(const Problem& P, const Seq& s, const Merge& mg, const float* partial, std::vector<float>& acc) {
  const int64_t G = P.group, Dv = P.Dv, nq = mg.i1 - mg.i0, R = (mg.g1 - mg.g0) * nq * G, stride = R * (2 + Dv);
  acc.resize((size_t)Dv);
  Q* obase = static_cast<Q*>(P.out);
  for (int64_t r = 0; r < R; ++r) {
    float M = -std::numeric_limits<float>::infinity();
    for (int64_t k = 0; k < mg.nparts; ++k) M = std::max(M, partial[mg.part + k * stride + r * (2 + Dv)]);
    std::fill(acc.begin(), acc.end(), 0.0f);
    float L = 0.0f;
    if (M > -std::numeric_limits<float>::infinity()) {
      for (int64_t k = 0; k < mg.nparts; ++k) {
        const float* src = partial + mg.part + k * stride + r * (2 + Dv);
        if (src[1] <= 0.0f) continue;
        const float w = std::exp(src[0] - M);
        L += w * src[1];
        for (int64_t d = 0; d < Dv; ++d) acc[(size_t)d] += w * src[2 + d];
      }
    }
    const float inv = L > 0.0f ? P.vscale / L : 0.0f;
    const int64_t i = mg.i0 + (r / G) % nq, h = (mg.g0 + r / (G * nq)) * G + r % G;
    Q* o = obase + ((s.q0 + i) * P.Hq + h) * Dv;
    for (int64_t d = 0; d < Dv; ++d) o[d] = from_f32<Q>(acc[(size_t)d] * inv);
  }
}

// The work list. An item takes all kv heads of a block of queries (~kTargetRows rows per kv
// head), so the cache is read a whole token row (all heads) at a time. While there are fewer
// than about twice as many items as threads, query blocks shrink, then long key ranges are split
// (at least kMinSplitKeys keys a part), then the heads are divided between items.
void plan(const Problem& P, const std::vector<Seq>& seqs, int threads, std::vector<Item>& items,
          std::vector<Merge>& merges, int64_t& partial_floats) {
  const int64_t target = threads > 1 ? 2 * (int64_t)threads : 1;
  int64_t qb = std::clamp<int64_t>(kTargetRows / P.group, 1, kMaxQueryBlock);
  int64_t hg = P.Hk;  // kv heads per item
  // Items for query block qb_ and hg_ heads per item, with and without splitting keys by `factor`.
  auto count = [&](int64_t qb_, int64_t hg_, int64_t factor) {
    int64_t c = 0;
    for (const Seq& s : seqs)
      for (int64_t i0 = 0; i0 < s.n; i0 += qb_) {
        const int64_t len = s.ctx + std::min(s.n, i0 + qb_) - visible_lo(P, s.ctx + i0);
        c += ((P.Hk + hg_ - 1) / hg_) * std::clamp<int64_t>(len / kMinSplitKeys, 1, factor);
      }
    return c;
  };
  int64_t nitems = count(qb, hg, 1);
  while (nitems < target && qb > 1) {
    const int64_t smaller = count(qb / 2, hg, 1);
    if (smaller == nitems) break;  // only single-query (decode) sequences: blocks do not matter
    qb /= 2;
    nitems = smaller;
  }
  auto split_factor = [&] { return nitems < target ? (target + nitems - 1) / nitems : 1; };
  while (hg > 1 && count(qb, hg, split_factor()) < target) {
    hg = (hg + 1) / 2;
    nitems = count(qb, hg, 1);
  }
  const int64_t factor = split_factor();
  items.clear();
  merges.clear();
  partial_floats = 0;
  for (int64_t b = 0; b < (int64_t)seqs.size(); ++b) {
    const Seq& s = seqs[(size_t)b];
    for (int64_t i0 = 0; i0 < s.n; i0 += qb) {
      const int64_t i1 = std::min(s.n, i0 + qb);
      const int64_t j0 = visible_lo(P, s.ctx + i0), j1 = s.ctx + i1;  // keys any of the block's queries sees
      const int64_t len = j1 - j0;
      const int64_t nsplit = std::clamp<int64_t>(len / kMinSplitKeys, 1, factor);
      for (int64_t g0 = 0; g0 < P.Hk; g0 += hg) {
        const int64_t g1 = std::min(P.Hk, g0 + hg), rows = (g1 - g0) * (i1 - i0) * P.group;
        if (nsplit == 1) {
          items.push_back({b, g0, g1, i0, i1, j0, j1, -1, rows * len});
          continue;
        }
        merges.push_back({b, g0, g1, i0, i1, partial_floats, nsplit});
        int64_t lo = j0;
        for (int64_t k = 1; k <= nsplit; ++k) {
          int64_t hi = k == nsplit ? j1 : j0 + len * k / nsplit;
          hi = std::min(j1, (hi + kTile - 1) / kTile * kTile);  // parts end on tile boundaries
          items.push_back({b, g0, g1, i0, i1, lo, hi, partial_floats, rows * (hi - lo)});
          partial_floats += rows * (2 + P.Dv);
          lo = hi;
        }
      }
    }
  }
  // Longest first, so the dynamic schedule ends evenly.
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
}

template <class Q, class C>
void run_paged(const Problem& P, const std::vector<Seq>& seqs) {
  const int threads = get_num_threads();
  std::vector<Item> items;
  std::vector<Merge> merges;
  int64_t partial_floats = 0;
  plan(P, seqs, threads, items, merges, partial_floats);
  std::vector<float> partial((size_t)partial_floats);
  const int64_t n = (int64_t)items.size();
  std::atomic<int64_t> next{0};
  // One chunk per thread, each taking items off a shared counter (items differ a lot in cost).
  parallel_for(0, std::min<int64_t>(threads, n), 1, [&](int64_t, int64_t) {
    Scratch S;
    for (int64_t w; (w = next.fetch_add(1)) < n;) {
      const Item& it = items[(size_t)w];
      attend_item<Q, C>(P, seqs[(size_t)it.b], it, S, partial.data());
    }
  });
  if (merges.empty()) return;
  parallel_for(0, (int64_t)merges.size(), 1, [&](int64_t m0, int64_t m1) {
    std::vector<float> acc;
    for (int64_t w = m0; w < m1; ++w)
      merge_parts<Q>(P, seqs[(size_t)merges[(size_t)w].b], merges[(size_t)w], partial.data(), acc);
  });
}

}  // namespace

void check_kv_cache(const char* op, const Tensor& t, const char* name) {
  check_defined(op, t, name);
  TALLOW_CHECK_TYPE(t.dtype() == DType::F32 || t.dtype() == DType::F16 || t.dtype() == DType::BF16 ||
                        t.dtype() == DType::F8E4M3,
                    op, ": ", name, " must be float32, float16, bfloat16 or float8_e4m3, got ", dtype_name(t.dtype()),
                    " tensor of shape ", shape_str(t.shape()));
  TALLOW_CHECK(t.dim() == 4, op, ": ", name, " must be 4-D [num_blocks, block_size, num_kv_heads, head_dim], got shape ",
               shape_str(t.shape()));
  TALLOW_CHECK(t.stride(3) == 1 || t.size(3) <= 1, op, ": ", name, " of shape ", shape_str(t.shape()),
               " and strides ", shape_str(t.strides()), " needs a contiguous last dim");
}

void reshape_and_cache(const Tensor& k, const Tensor& v, const Tensor& k_cache, const Tensor& v_cache,
                       const Tensor& slot_mapping, float k_scale, float v_scale) {
  const char* op = "reshape_and_cache";
  check_defined(op, k, "k");
  check_defined(op, v, "v");
  check_float(op, k, "k");
  check_float(op, v, "v");
  check_kv_cache(op, k_cache, "k_cache");
  check_kv_cache(op, v_cache, "v_cache");
  check_index(op, slot_mapping, "slot_mapping", 1);
  TALLOW_CHECK(k.dim() == 3 && v.dim() == 3, op, ": k and v must be 3-D [T, num_kv_heads, head_dim], got k",
               shape_str(k.shape()), " v", shape_str(v.shape()));
  const int64_t T = k.size(0), Hk = k.size(1), D = k.size(2), Dv = v.size(2);
  TALLOW_CHECK(v.size(0) == T && v.size(1) == Hk, op, ": k and v must agree on tokens and heads: k",
               shape_str(k.shape()), " v", shape_str(v.shape()));
  TALLOW_CHECK(k_cache.size(2) == Hk && k_cache.size(3) == D, op, ": k", shape_str(k.shape()),
               " does not match k_cache", shape_str(k_cache.shape()), " (num_kv_heads and head_dim must agree)");
  TALLOW_CHECK(v_cache.size(0) == k_cache.size(0) && v_cache.size(1) == k_cache.size(1) && v_cache.size(2) == Hk &&
                   v_cache.size(3) == Dv,
               op, ": v", shape_str(v.shape()), " and v_cache", shape_str(v_cache.shape()), " do not match k_cache",
               shape_str(k_cache.shape()));
  TALLOW_CHECK(slot_mapping.size(0) == T, op, ": slot_mapping", shape_str(slot_mapping.shape()), " must have one slot per token of k",
               shape_str(k.shape()));
  for (const Tensor* t : {&v, &k_cache, &v_cache, &slot_mapping}) check_same_device(op, k, *t);
  check_kv_scale(op, k_scale, "k_scale");
  check_kv_scale(op, v_scale, "v_scale");
  if (!k.device().is_cpu())
    return device_op(&BackendOps::reshape_and_cache, op, k, {&k, &v, &k_cache, &v_cache, &slot_mapping})(
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale);

  const int64_t bs = k_cache.size(1), nslots = k_cache.size(0) * bs;
  std::vector<int64_t> slots((size_t)T);
  const IndexView sv = index_view(slot_mapping);
  for (int64_t t = 0; t < T; ++t) {
    slots[(size_t)t] = sv(t);
    TALLOW_CHECK(slots[(size_t)t] < nslots, op, ": slot_mapping[", t, "] = ", slots[(size_t)t],
                 " is out of range for k_cache", shape_str(k_cache.shape()), " (", nslots,
                 " slots; negative slots are skipped)");
  }
  if (T == 0 || Hk == 0) return;
  auto inner = [](const Tensor& t) { return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous(); };
  write_cache(op, inner(k), k_cache, slots, bs, k_scale);
  write_cache(op, inner(v), v_cache, slots, bs, v_scale);
}

Tensor paged_attention(const Tensor& q_in, const Tensor& k_cache, const Tensor& v_cache, const Tensor& block_tables,
                       const Tensor& seq_lens, const Tensor& query_start_loc, float scale, int64_t sliding_window,
                       float softcap, const std::optional<Tensor>& out, float k_scale, float v_scale,
                       bool settled_cache) {
  const char* op = "paged_attention";
  check_defined(op, q_in, "q");
  check_float(op, q_in, "q");
  check_dim(op, q_in, "q", 3);
  check_kv_cache(op, k_cache, "k_cache");
  check_kv_cache(op, v_cache, "v_cache");
  check_same_dtype(op, k_cache, "k_cache", v_cache, "v_cache");
  check_index(op, block_tables, "block_tables", 2);
  check_index(op, seq_lens, "seq_lens", 1);
  check_index(op, query_start_loc, "query_start_loc", 1);
  for (const Tensor* t : {&k_cache, &v_cache, &block_tables, &seq_lens, &query_start_loc})
    check_same_device(op, q_in, *t);
  const int64_t T = q_in.size(0), Hq = q_in.size(1), D = q_in.size(2);
  const int64_t NB = k_cache.size(0), BS = k_cache.size(1), Hk = k_cache.size(2), Dv = v_cache.size(3);
  TALLOW_CHECK(k_cache.size(3) == D, op, ": q", shape_str(q_in.shape()), " and k_cache", shape_str(k_cache.shape()),
               " have different head dims");
  TALLOW_CHECK(v_cache.size(0) == NB && v_cache.size(1) == BS && v_cache.size(2) == Hk, op, ": k_cache",
               shape_str(k_cache.shape()), " and v_cache", shape_str(v_cache.shape()),
               " must agree on blocks, block size and kv heads");
  TALLOW_CHECK(Hk > 0 && Hq > 0 && Hq % Hk == 0, op, ": query heads (", Hq, ", q", shape_str(q_in.shape()),
               ") must be a positive multiple of kv heads (", Hk, ", k_cache", shape_str(k_cache.shape()), ")");
  TALLOW_CHECK(D > 0 && BS > 0, op, ": head dim and block size must be positive: q", shape_str(q_in.shape()),
               " k_cache", shape_str(k_cache.shape()));
  TALLOW_CHECK(sliding_window >= 0, op, ": sliding_window must be >= 0 (0 = no window), got ", sliding_window);
  TALLOW_CHECK(softcap >= 0.0f && std::isfinite(softcap), op, ": softcap must be >= 0 (0 = none), got ", softcap);
  TALLOW_CHECK(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  check_kv_scale(op, k_scale, "k_scale");
  check_kv_scale(op, v_scale, "v_scale");
  const int64_t B = seq_lens.size(0), max_blocks = block_tables.size(1);
  TALLOW_CHECK(block_tables.size(0) == B && query_start_loc.size(0) == B + 1, op,
               ": block_tables must be [B, max_blocks], seq_lens [B] and query_start_loc [B + 1]; got block_tables",
               shape_str(block_tables.shape()), " seq_lens", shape_str(seq_lens.shape()), " query_start_loc",
               shape_str(query_start_loc.shape()));
  if (!q_in.device().is_cpu())
    return device_op(&BackendOps::paged_attention, op, q_in, {&q_in, &k_cache, &v_cache, &block_tables, &seq_lens})(
        q_in, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window, softcap, out, k_scale,
        v_scale, settled_cache);

  // Sequences, validated in full (every block id a sequence reads) before any work.
  const IndexView sl = index_view(seq_lens), qsl = index_view(query_start_loc), bt = index_view(block_tables);
  TALLOW_CHECK(qsl(0) == 0 && qsl(B) == T, op, ": query_start_loc must run from 0 to the number of query tokens (",
               T, ", q", shape_str(q_in.shape()), "), got ", qsl(0), " .. ", qsl(B));
  std::vector<Seq> seqs((size_t)B);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q0 = qsl(b), n = qsl(b + 1) - q0, len = sl(b);
    TALLOW_CHECK(n >= 0, op, ": query_start_loc must be non-decreasing, got query_start_loc[", b, "] = ", q0,
                 " > query_start_loc[", b + 1, "] = ", qsl(b + 1));
    TALLOW_CHECK(len >= n, op, ": seq_lens[", b, "] = ", len, " is less than its ", n,
                 " new tokens (query_start_loc[", b, " .. ", b + 1, "])");
    TALLOW_CHECK(len <= max_blocks * BS, op, ": seq_lens[", b, "] = ", len, " exceeds its block table (",
                 max_blocks, " blocks of ", BS, " tokens, block_tables", shape_str(block_tables.shape()), ")");
    if (n > 0) {
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, len - n - sliding_window + 1) / BS : 0;
      for (int64_t i = first; i < (len + BS - 1) / BS; ++i) {
        const int64_t id = bt(b, i);
        TALLOW_CHECK(id >= 0 && id < NB, op, ": block_tables[", b, ", ", i, "] = ", id,
                     " is out of range for k_cache", shape_str(k_cache.shape()), " (", NB, " blocks)");
      }
    }
    seqs[(size_t)b] = {q0, n, len - n};
  }

  const Tensor q = q_in.size(-1) <= 1 || q_in.stride(-1) == 1 ? q_in : q_in.contiguous();
  Tensor o = make_out(op, out, {T, Hq, Dv}, q.dtype(), q.device());
  if (o.numel() == 0) return o;
  // Scales apply to fp8 caches only: k_scale folds into the score scale, v_scale into the output.
  const bool f8 = k_cache.dtype() == DType::F8E4M3;
  const Problem P{Hq, Hk, D, Dv, BS, Hq / Hk, sliding_window, f8 ? scale * k_scale : scale, softcap,
                  f8 ? v_scale : 1.0f, q.data_ptr(), q.stride(0),
                  q.stride(1), cache_view(k_cache), cache_view(v_cache), bt, o.data_ptr()};
  TALLOW_DISPATCH_FLOAT(op, q.dtype(), [&] {
    using Q = scalar_t;
    dispatch_cache(op, k_cache.dtype(), [&](auto tag) { run_paged<Q, decltype(tag)>(P, seqs); });
  });
  return o;
}

}  // namespace tallow::ops
