// Family status: CPU implementation complete and tested (tests/python/backend_ops/cases_attention.py).
// Reference attention over contiguous (non-paged) K/V: the baseline that paged and GPU kernels
// are checked against, so it is written to be read first and to be fast enough for small models
// second.
//
// For every (batch b, query head h, query i):
//   p       = Tk - Tq + i                      position of query i (the first Tk - Tq keys are a cached prefix)
//   kh      = h / (Hq / Hk)                    its K/V head (GQA; Hk == 1 is MQA, Hk == Hq is MHA)
//   s_j     = scale * <q_i, k_j>               for every visible key j, in f32
//   s_j     = softcap * tanh(s_j / softcap)    if softcap > 0 (on the scaled score, before masking)
//   out_i   = sum_j softmax(s)_j * v_j         f32 accumulation, one rounding to q's dtype at the end
//
// Visible keys form one contiguous range [lo, hi) per query:
//   causal          : j <= p                                 (hi = p + 1)
//   sliding_window W: p - W < j <= p, i.e. the last W keys up to and including the query itself.
//                     This is Hugging Face's sliding-window mask (kv_idx > q_idx - W and kv_idx <= q_idx)
//                     and vLLM's flash-attention window (left = W - 1, right = 0). A window always bounds
//                     keys from above at the query, so with a window `causal` makes no difference.
//   neither         : every key (0 <= j < Tk)
// A query that sees no key (Tk == 0, or Tq > Tk with a causal mask or a window, so p < 0) has an
// empty softmax; its output is defined as zeros (not NaN), matching what kernels that skip
// fully-masked rows produce.
//
// Work is split over (batch, query head, block of kQueryBlock queries). Within a block, the K/V
// rows the block can see are converted to f32 once into compact scratch and shared by the block's
// queries (for f32 this is a copy, which keeps the hot rows contiguous in cache). Scores are kept
// in a per-query buffer (two-pass softmax: max, then exp/sum), which is simpler to check than an
// online softmax and costs O(Tk) floats of scratch. The result for a query does not depend on how
// work is split, so it is the same for any thread count.
#include "ops/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/parallel.h"
#include "core/simd.h"
#include "ops/common.h"

// `omp simd` with a sum reduction (simd.h has the plain form only).
#if defined(_MSC_VER) && !defined(__clang__)
#define ATTN_SIMD_SUM(x) __pragma(omp simd reduction(+ : x))
#define ATTN_SIMD_SUM4(a, b, c, d) __pragma(omp simd reduction(+ : a, b, c, d))
#else
#define ATTN_PRAGMA(x) _Pragma(#x)
#define ATTN_SIMD_SUM(x) ATTN_PRAGMA(omp simd reduction(+ : x))
#define ATTN_SIMD_SUM4(a, b, c, d) ATTN_PRAGMA(omp simd reduction(+ : a, b, c, d))
#endif

namespace tallow::ops {

namespace {

constexpr int64_t kQueryBlock = 16;

// Strided view of one [B, T, H, D] operand (3-D inputs get B = 1 and a batch stride of 0).
// The last dim is contiguous (stride 1); strides count elements.
struct Operand {
  const void* base;  // first element
  int64_t sb, st, sh;
};

struct Problem {
  int64_t B, Tq, Tk, Hq, Hk, D, Dv;
  float scale, softcap;
  bool causal;
  int64_t window;
  Operand q, k, v;
  void* out;  // contiguous [B, Tq, Hq, Dv]
};

// Keys visible to the query at position p (see the comment at the top of the file).
inline void visible_range(const Problem& P, int64_t p, int64_t& lo, int64_t& hi) {
  lo = 0;
  hi = P.Tk;
  if (P.causal || P.window > 0) hi = std::min(hi, p + 1);
  if (P.window > 0) lo = std::max<int64_t>(lo, p - P.window + 1);
  if (hi < lo) hi = lo;  // empty
}

// One (batch, query head, query block) work item. `kbuf`/`vbuf`/`qf`/`scores`/`acc` are scratch.
template <class T>
TALLOW_SIMD_CLONES void attend_block(const Problem& P, int64_t b, int64_t h, int64_t i0, int64_t i1,
                                     std::vector<float>& kbuf, std::vector<float>& vbuf, std::vector<float>& qf,
                                     std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t D = P.D, Dv = P.Dv;
  const int64_t kh = h / (P.Hq / P.Hk);
  const T* qbase = static_cast<const T*>(P.q.base) + b * P.q.sb + h * P.q.sh;
  const T* kbase = static_cast<const T*>(P.k.base) + b * P.k.sb + kh * P.k.sh;
  const T* vbase = static_cast<const T*>(P.v.base) + b * P.v.sb + kh * P.v.sh;
  T* obase = static_cast<T*>(P.out) + (b * P.Tq * P.Hq + h) * Dv;
  const int64_t ost = P.Hq * Dv;  // output stride between queries

  // Keys any query of the block can see: lo grows and hi grows with the query position.
  int64_t blo, bhi, tmp;
  visible_range(P, P.Tk - P.Tq + i0, blo, tmp);
  visible_range(P, P.Tk - P.Tq + (i1 - 1), tmp, bhi);
  bhi = std::max(bhi, blo);

  // Copy (converting to f32) the K and V rows of keys [blo, bhi) into compact scratch, shared by
  // the block's queries: key j's rows are at kf + (j - blo) * D and vf + (j - blo) * Dv.
  const int64_t n = bhi - blo;
  kbuf.resize((size_t)std::max<int64_t>(n * D, 1));
  vbuf.resize((size_t)std::max<int64_t>(n * Dv, 1));
  for (int64_t j = 0; j < n; ++j) {
    const T* TALLOW_RESTRICT ks = kbase + (blo + j) * P.k.st;
    const T* TALLOW_RESTRICT vs = vbase + (blo + j) * P.v.st;
    float* TALLOW_RESTRICT kd = kbuf.data() + j * D;
    float* TALLOW_RESTRICT vd = vbuf.data() + j * Dv;
    TALLOW_PRAGMA_SIMD
    for (int64_t d = 0; d < D; ++d) kd[d] = to_f32(ks[d]);
    TALLOW_PRAGMA_SIMD
    for (int64_t d = 0; d < Dv; ++d) vd[d] = to_f32(vs[d]);
  }
  const float* kf = kbuf.data();
  const float* vf = vbuf.data();

  qf.resize((size_t)D);
  acc.resize((size_t)std::max<int64_t>(Dv, 1));
  float* TALLOW_RESTRICT qv = qf.data();
  float* TALLOW_RESTRICT av = acc.data();
  for (int64_t i = i0; i < i1; ++i) {
    T* o = obase + i * ost;
    int64_t lo, hi;
    visible_range(P, P.Tk - P.Tq + i, lo, hi);
    if (lo >= hi) {  // fully masked: defined as zeros
      for (int64_t d = 0; d < Dv; ++d) o[d] = from_f32<T>(0.0f);
      continue;
    }
    const T* qs = qbase + i * P.q.st;
    TALLOW_PRAGMA_SIMD
    for (int64_t d = 0; d < D; ++d) qv[d] = to_f32(qs[d]);
    const int64_t nk = hi - lo;
    const float* kr = kf + (lo - blo) * D;  // this query's first visible key, then nk rows
    const float* vr = vf + (lo - blo) * Dv;

    // Pass 1: dot products q.k_j, four keys at a time (independent sums hide FMA latency).
    scores.resize((size_t)nk);
    float* TALLOW_RESTRICT s = scores.data();
    int64_t j = 0;
    for (; j + 4 <= nk; j += 4) {
      const float *k0 = kr + j * D, *k1 = k0 + D, *k2 = k1 + D, *k3 = k2 + D;
      float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
      ATTN_SIMD_SUM4(d0, d1, d2, d3)
      for (int64_t d = 0; d < D; ++d) {
        d0 += qv[d] * k0[d];
        d1 += qv[d] * k1[d];
        d2 += qv[d] * k2[d];
        d3 += qv[d] * k3[d];
      }
      s[j] = d0, s[j + 1] = d1, s[j + 2] = d2, s[j + 3] = d3;
    }
    for (; j < nk; ++j) {
      const float* k0 = kr + j * D;
      float d0 = 0.0f;
      ATTN_SIMD_SUM(d0)
      for (int64_t d = 0; d < D; ++d) d0 += qv[d] * k0[d];
      s[j] = d0;
    }
    // Scale, soft-cap, and the maximum for a stable softmax.
    float m = -std::numeric_limits<float>::infinity();
    for (j = 0; j < nk; ++j) {
      float sc = s[j] * P.scale;
      if (P.softcap > 0.0f) sc = P.softcap * std::tanh(sc / P.softcap);
      s[j] = sc;
      m = std::max(m, sc);
    }
    // Pass 2: unnormalised weights w_j = exp(s_j - m), their sum l, and sum_j w_j v_j.
    float l = 0.0f;
    for (j = 0; j < nk; ++j) {
      s[j] = std::exp(s[j] - m);
      l += s[j];
    }
    for (int64_t d = 0; d < Dv; ++d) av[d] = 0.0f;
    for (j = 0; j + 4 <= nk; j += 4) {
      const float *v0 = vr + j * Dv, *v1 = v0 + Dv, *v2 = v1 + Dv, *v3 = v2 + Dv;
      const float w0 = s[j], w1 = s[j + 1], w2 = s[j + 2], w3 = s[j + 3];
      TALLOW_PRAGMA_SIMD
      for (int64_t d = 0; d < Dv; ++d) av[d] += w0 * v0[d] + w1 * v1[d] + w2 * v2[d] + w3 * v3[d];
    }
    for (; j < nk; ++j) {
      const float* v0 = vr + j * Dv;
      const float w0 = s[j];
      TALLOW_PRAGMA_SIMD
      for (int64_t d = 0; d < Dv; ++d) av[d] += w0 * v0[d];
    }
    const float inv = 1.0f / l;
    TALLOW_PRAGMA_SIMD
    for (int64_t d = 0; d < Dv; ++d) o[d] = from_f32<T>(av[d] * inv);
  }
}

Operand operand(const Tensor& t) {
  const bool batched = t.dim() == 4;
  const int64_t o = batched ? 1 : 0;
  return {t.data_ptr(), batched ? t.stride(0) : 0, t.stride(o), t.stride(o + 1)};
}

}  // namespace

Tensor attention(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, float scale, bool causal,
                 int64_t sliding_window, float softcap) {
  const char* op = "attention";
  check_defined(op, q_in, "q");
  check_defined(op, k_in, "k");
  check_defined(op, v_in, "v");
  check_float(op, q_in, "q");
  check_same_dtype(op, q_in, "q", k_in, "k");
  check_same_dtype(op, q_in, "q", v_in, "v");
  check_same_device(op, q_in, k_in);
  check_same_device(op, q_in, v_in);
  const int64_t nd = q_in.dim();
  TALLOW_CHECK((nd == 3 || nd == 4) && k_in.dim() == nd && v_in.dim() == nd, op,
               ": q, k, v must all be 3-D [T, H, D] or all 4-D [B, T, H, D], got q", shape_str(q_in.shape()), " k",
               shape_str(k_in.shape()), " v", shape_str(v_in.shape()));
  const int64_t o = nd - 3;  // index of the T dim
  const int64_t B = nd == 4 ? q_in.size(0) : 1;
  const int64_t Tq = q_in.size(o), Hq = q_in.size(o + 1), D = q_in.size(o + 2);
  const int64_t Tk = k_in.size(o), Hk = k_in.size(o + 1), Dv = v_in.size(o + 2);
  TALLOW_CHECK(nd == 3 || (k_in.size(0) == B && v_in.size(0) == B), op, ": batch sizes differ: q",
               shape_str(q_in.shape()), " k", shape_str(k_in.shape()), " v", shape_str(v_in.shape()));
  TALLOW_CHECK(k_in.size(o + 2) == D, op, ": q and k head dims differ: q", shape_str(q_in.shape()), " k",
               shape_str(k_in.shape()));
  TALLOW_CHECK(v_in.size(o) == Tk && v_in.size(o + 1) == Hk, op, ": k and v must agree on tokens and heads: k",
               shape_str(k_in.shape()), " v", shape_str(v_in.shape()));
  TALLOW_CHECK(Hq > 0 && Hk > 0 && Hq % Hk == 0, op, ": query heads (", Hq,
               ") must be a positive multiple of kv heads (", Hk, "): q", shape_str(q_in.shape()), " k",
               shape_str(k_in.shape()));
  TALLOW_CHECK(D > 0, op, ": head dim must be positive, got q", shape_str(q_in.shape()));
  TALLOW_CHECK(sliding_window >= 0, op, ": sliding_window must be >= 0 (0 = no window), got ", sliding_window);
  TALLOW_CHECK(softcap >= 0.0f, op, ": softcap must be >= 0 (0 = none), got ", softcap);
  TALLOW_CHECK(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  if (!q_in.device().is_cpu())
    return device_op(&BackendOps::attention, op, q_in, {&q_in, &k_in, &v_in})(q_in, k_in, v_in, scale, causal,
                                                                              sliding_window, softcap);

  // Any strides work as long as each head vector is contiguous; copy the rare operand that is not.
  auto inner = [](const Tensor& t) { return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous(); };
  const Tensor q = inner(q_in), k = inner(k_in), v = inner(v_in);

  Shape oshape = q.shape();
  oshape.back() = Dv;
  Tensor out = Tensor::empty(oshape, q.dtype(), q.device());
  if (out.numel() == 0) return out;

  const Problem P{B, Tq, Tk, Hq, Hk, D, Dv, scale, softcap, causal, sliding_window,
                  operand(q), operand(k), operand(v), out.data_ptr()};
  const int64_t nqb = (Tq + kQueryBlock - 1) / kQueryBlock;
  TALLOW_DISPATCH_FLOAT(op, q.dtype(), [&] {
    parallel_for(0, B * Hq * nqb, 1, [&](int64_t w0, int64_t w1) {
      std::vector<float> kbuf, vbuf, qf, scores, acc;
      for (int64_t w = w0; w < w1; ++w) {
        const int64_t qb = w % nqb, h = (w / nqb) % Hq, b = w / (nqb * Hq);
        const int64_t i0 = qb * kQueryBlock, i1 = std::min(Tq, i0 + kQueryBlock);
        attend_block<scalar_t>(P, b, h, i0, i1, kbuf, vbuf, qf, scores, acc);
      }
    });
  });
  return out;
}

}  // namespace tallow::ops
