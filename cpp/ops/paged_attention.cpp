// Paged attention and the KV-cache write on CPU (see paged_attention.h for the contracts).
//
// paged_attention, for every sequence b, kv head g and query i of b (position p = ctx_b + i,
// ctx_b = seq_lens[b] - n_b), over the query heads h = g * group .. (g + 1) * group - 1:
//   visible keys   j in [lo, p]   lo = 0, or max(0, p - W + 1) with a sliding window W
//   s_j            = <scale * q_h, k_j>, then softcap * tanh(s_j / softcap) when softcap > 0
//   out            = sum_j softmax(s)_j v_j
// Key j's rows are read through the block table: block table[j / block_size], row j % block_size.
//
// Work items are (sequence, kv head, block of queries, key range). An item handles the
// group * nq query rows of its kv head together, walking its key range in tiles of kTile keys
// (aligned to multiples of kTile, a tile may span several cache blocks): the tile's K and V rows
// are converted to f32 once (f16/bf16 caches; f32 rows are read in place) and shared by all
// rows; each row keeps an online softmax (running max m, sum l, f32 accumulator) over the keys
// it can see in the tile, so masked keys cost nothing. When the items are few compared to the
// threads (small decode batches), query blocks shrink and then an item's key range is split
// (flash-decoding): each part leaves (m, l, acc) per row and a second pass merges them.
#include "ops/paged_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
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
#define PA_SIMD_SUM(x) __pragma(omp simd reduction(+ : x))
#define PA_SIMD_SUM4(a, b, c, d) __pragma(omp simd reduction(+ : a, b, c, d))
#else
#define PA_INLINE inline __attribute__((always_inline))
#define PA_PREFETCH(p) __builtin_prefetch(p)
#define PA_PRAGMA(x) _Pragma(#x)
#define PA_SIMD_SUM(x) PA_PRAGMA(omp simd reduction(+ : x))
#define PA_SIMD_SUM4(a, b, c, d) PA_PRAGMA(omp simd reduction(+ : a, b, c, d))
#endif

namespace tallow::ops {

namespace {

constexpr int64_t kTile = 64;         // keys per tile
constexpr int64_t kTargetRows = 64;   // query rows (heads x queries) per work item, at most
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

void check_cache(const char* op, const Tensor& t, const char* name) {
  check_defined(op, t, name);
  check_float(op, t, name);
  TALLOW_CHECK(t.dim() == 4, op, ": ", name, " must be 4-D [num_blocks, block_size, num_kv_heads, head_dim], got shape ",
               shape_str(t.shape()));
  TALLOW_CHECK(t.stride(3) == 1 || t.size(3) <= 1, op, ": ", name, " of shape ", shape_str(t.shape()),
               " and strides ", shape_str(t.strides()), " needs a contiguous last dim");
}

// ---- reshape_and_cache --------------------------------------------------------------------------

template <class S, class D>
TALLOW_SIMD_CLONES void write_rows(const Tensor& src, const Tensor& cache, const std::vector<int64_t>& slots,
                                   int64_t bs) {
  const int64_t T = src.size(0), H = src.size(1), n = src.size(2);
  const int64_t sst = src.stride(0), ssh = src.stride(1);
  const CacheView c = cache_view(cache);
  const S* sbase = static_cast<const S*>(src.data_ptr());
  D* cbase = static_cast<D*>(const_cast<void*>(c.base));
  parallel_rows(T * H, n, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t t = r / H, h = r % H, s = slots[(size_t)t];
      if (s < 0) continue;
      const S* TALLOW_RESTRICT a = sbase + t * sst + h * ssh;
      D* TALLOW_RESTRICT o = cbase + (s / bs) * c.sb + (s % bs) * c.sr + h * c.sh;
      TALLOW_PRAGMA_SIMD
      for (int64_t d = 0; d < n; ++d) o[d] = from_f32<D>(to_f32(a[d]));
    }
  });
}

void write_cache(const char* op, const Tensor& src, const Tensor& cache, const std::vector<int64_t>& slots,
                 int64_t bs) {
  TALLOW_DISPATCH_FLOAT(op, src.dtype(), [&] {
    using S = scalar_t;
    TALLOW_DISPATCH_FLOAT(op, cache.dtype(), [&] { write_rows<S, scalar_t>(src, cache, slots, bs); });
  });
}

// ---- paged attention ------------------------------------------------------------------------------

struct Problem {
  int64_t Hq, Hk, D, Dv, BS, group, window;
  float scale, softcap;
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
  int64_t b, g, i0, i1;  // sequence, kv head, its queries [i0, i1)
  int64_t j0, j1;        // keys [j0, j1)
  int64_t part;          // -1: writes the output; else the first float of its partial results
  int64_t cost;
};

// A split item's parts (consecutive in the partial buffer) and where they merge to.
struct Merge {
  int64_t b, g, i0, i1, part, nparts;
};

// Keys visible to the query at position p: [lo, p].
inline int64_t visible_lo(const Problem& P, int64_t p) {
  return P.window > 0 ? std::max<int64_t>(0, p - P.window + 1) : 0;
}

struct Scratch {
  std::vector<float> qf, kf, vf, sc, m, l, acc;
  std::vector<const float*> kp, vp;
};

// Four dot products of length n, with independent sums to hide FMA latency.
PA_INLINE void dot4(const float* TALLOW_RESTRICT q, const float* TALLOW_RESTRICT k0, const float* TALLOW_RESTRICT k1,
                    const float* TALLOW_RESTRICT k2, const float* TALLOW_RESTRICT k3, int64_t n, float* s) {
  float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
  PA_SIMD_SUM4(d0, d1, d2, d3)
  for (int64_t d = 0; d < n; ++d) {
    d0 += q[d] * k0[d];
    d1 += q[d] * k1[d];
    d2 += q[d] * k2[d];
    d3 += q[d] * k3[d];
  }
  s[0] = d0, s[1] = d1, s[2] = d2, s[3] = d3;
}

PA_INLINE float dot1(const float* TALLOW_RESTRICT q, const float* TALLOW_RESTRICT k0, int64_t n) {
  float d0 = 0.0f;
  PA_SIMD_SUM(d0)
  for (int64_t d = 0; d < n; ++d) d0 += q[d] * k0[d];
  return d0;
}

// Rows of one tile as f32 pointers: f32 cache rows in place, other dtypes converted into `buf`.
// Also prefetches the rows of the next tile (keys below `end`): one head's consecutive rows are
// Hk * D elements apart, too far apart for the hardware prefetcher to follow.
template <class C>
PA_INLINE void gather_rows(const Problem& P, const CacheView& c, int64_t n, int64_t b, int64_t g, int64_t t0,
                           int64_t t1, int64_t end, std::vector<float>& buf, std::vector<const float*>& ptrs) {
  const C* base = static_cast<const C*>(c.base) + g * c.sh;
  const int64_t row_bytes = n * (int64_t)sizeof(C);
  for (int64_t j = t0; j < t1; ++j) {
    if (j + kTile < end) {
      const int64_t jn = j + kTile;
      const char* next = reinterpret_cast<const char*>(base + P.table(b, jn / P.BS) * c.sb + (jn % P.BS) * c.sr);
      for (int64_t o = 0; o < row_bytes; o += 64) PA_PREFETCH(next + o);
    }
    const int64_t blk = P.table(b, j / P.BS);
    const C* src = base + blk * c.sb + (j % P.BS) * c.sr;
    if constexpr (std::is_same_v<C, float>) {
      ptrs[(size_t)(j - t0)] = src;
    } else {
      float* TALLOW_RESTRICT dst = buf.data() + (j - t0) * n;
      const C* TALLOW_RESTRICT s = src;
      TALLOW_PRAGMA_SIMD
      for (int64_t d = 0; d < n; ++d) dst[d] = to_f32(s[d]);
      ptrs[(size_t)(j - t0)] = dst;
    }
  }
}

// One work item: query rows r = (i - i0) * group + hh for queries i in [i0, i1) and the group's
// heads hh, over keys [j0, j1) (clipped per row to what the row can see).
template <class Q, class C>
TALLOW_SIMD_CLONES void attend_item(const Problem& P, const Seq& s, const Item& it, Scratch& S, float* partial) {
  const int64_t D = P.D, Dv = P.Dv, G = P.group;
  const int64_t nq = it.i1 - it.i0, R = nq * G;
  S.qf.resize((size_t)(R * D));
  S.m.assign((size_t)R, -std::numeric_limits<float>::infinity());
  S.l.assign((size_t)R, 0.0f);
  S.acc.assign((size_t)(R * Dv), 0.0f);
  S.sc.resize((size_t)kTile);
  S.kp.resize((size_t)kTile);
  S.vp.resize((size_t)kTile);
  if (!std::is_same_v<C, float>) {
    S.kf.resize((size_t)(kTile * D));
    S.vf.resize((size_t)(kTile * Dv));
  }
  // Query rows in f32, pre-multiplied by the scale.
  const Q* qbase = static_cast<const Q*>(P.q);
  for (int64_t i = it.i0; i < it.i1; ++i)
    for (int64_t hh = 0; hh < G; ++hh) {
      const Q* TALLOW_RESTRICT src = qbase + (s.q0 + i) * P.qst + (it.g * G + hh) * P.qsh;
      float* TALLOW_RESTRICT dst = S.qf.data() + ((i - it.i0) * G + hh) * D;
      const float sc = P.scale;
      TALLOW_PRAGMA_SIMD
      for (int64_t d = 0; d < D; ++d) dst[d] = sc * to_f32(src[d]);
    }

  float* TALLOW_RESTRICT sc = S.sc.data();
  for (int64_t t0 = it.j0, t1; t0 < it.j1; t0 = t1) {
    t1 = std::min(it.j1, (t0 / kTile + 1) * kTile);
    gather_rows<C>(P, P.k, D, it.b, it.g, t0, t1, it.j1, S.kf, S.kp);
    gather_rows<C>(P, P.v, Dv, it.b, it.g, t0, t1, it.j1, S.vf, S.vp);
    for (int64_t i = it.i0; i < it.i1; ++i) {
      const int64_t p = s.ctx + i;
      const int64_t a = std::max(t0, visible_lo(P, p)), e = std::min(t1, p + 1);
      if (a >= e) continue;
      const int64_t n = e - a;
      const float* const* kp = S.kp.data() + (a - t0);  // kp[j]: key a + j's row
      const float* const* vp = S.vp.data() + (a - t0);
      for (int64_t hh = 0; hh < G; ++hh) {
        const int64_t r = (i - it.i0) * G + hh;
        const float* qv = S.qf.data() + r * D;
        // Scores of keys a .. e - 1 (sc[j - a]).
        int64_t j = 0;
        for (; j + 4 <= n; j += 4) dot4(qv, kp[j], kp[j + 1], kp[j + 2], kp[j + 3], D, sc + j);
        for (; j < n; ++j) sc[j] = dot1(qv, kp[j], D);
        if (P.softcap > 0.0f) {
          const float cap = P.softcap, inv = 1.0f / P.softcap;
          for (j = 0; j < n; ++j) sc[j] = cap * std::tanh(sc[j] * inv);
        }
        float mt = sc[0];
        for (j = 1; j < n; ++j) mt = std::max(mt, sc[j]);
        // Online softmax: rescale what came before when the running max grows.
        float& m = S.m[(size_t)r];
        float& l = S.l[(size_t)r];
        float* TALLOW_RESTRICT av = S.acc.data() + r * Dv;
        const float mnew = std::max(m, mt);
        if (mnew > m && l > 0.0f) {
          const float alpha = std::exp(m - mnew);
          l *= alpha;
          TALLOW_PRAGMA_SIMD
          for (int64_t d = 0; d < Dv; ++d) av[d] *= alpha;
        }
        m = mnew;
        float lt = 0.0f;
        for (j = 0; j < n; ++j) {
          sc[j] = std::exp(sc[j] - mnew);
          lt += sc[j];
        }
        l += lt;
        for (j = 0; j + 4 <= n; j += 4) {
          const float *TALLOW_RESTRICT v0 = vp[j], *TALLOW_RESTRICT v1 = vp[j + 1], *TALLOW_RESTRICT v2 = vp[j + 2],
                      *TALLOW_RESTRICT v3 = vp[j + 3];
          const float w0 = sc[j], w1 = sc[j + 1], w2 = sc[j + 2], w3 = sc[j + 3];
          TALLOW_PRAGMA_SIMD
          for (int64_t d = 0; d < Dv; ++d) av[d] += w0 * v0[d] + w1 * v1[d] + w2 * v2[d] + w3 * v3[d];
        }
        for (; j < n; ++j) {
          const float* TALLOW_RESTRICT v0 = vp[j];
          const float w0 = sc[j];
          TALLOW_PRAGMA_SIMD
          for (int64_t d = 0; d < Dv; ++d) av[d] += w0 * v0[d];
        }
      }
    }
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
  for (int64_t i = it.i0; i < it.i1; ++i)
    for (int64_t hh = 0; hh < G; ++hh) {
      const int64_t r = (i - it.i0) * G + hh;
      const float l = S.l[(size_t)r], inv = l > 0.0f ? 1.0f / l : 0.0f;
      const float* TALLOW_RESTRICT av = S.acc.data() + r * Dv;
      Q* TALLOW_RESTRICT o = obase + ((s.q0 + i) * P.Hq + it.g * G + hh) * Dv;
      TALLOW_PRAGMA_SIMD
      for (int64_t d = 0; d < Dv; ++d) o[d] = from_f32<Q>(av[d] * inv);
    }
}

// Merges the parts of a split key range: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s.
template <class Q>
void merge_parts(const Problem& P, const Seq& s, const Merge& mg, const float* partial, std::vector<float>& acc) {
  const int64_t G = P.group, Dv = P.Dv, R = (mg.i1 - mg.i0) * G, stride = R * (2 + Dv);
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
    const float inv = L > 0.0f ? 1.0f / L : 0.0f;
    const int64_t i = mg.i0 + r / G, h = mg.g * G + r % G;
    Q* o = obase + ((s.q0 + i) * P.Hq + h) * Dv;
    for (int64_t d = 0; d < Dv; ++d) o[d] = from_f32<Q>(acc[(size_t)d] * inv);
  }
}

// The work list: query blocks sized for ~kTargetRows rows, shrunk and then split over keys
// while there are fewer items than twice the threads.
void plan(const Problem& P, const std::vector<Seq>& seqs, int threads, std::vector<Item>& items,
          std::vector<Merge>& merges, int64_t& partial_floats) {
  const int64_t target = 2 * (int64_t)threads;
  int64_t qb = std::clamp<int64_t>(kTargetRows / P.group, 1, kMaxQueryBlock);
  auto count = [&](int64_t qb_) {
    int64_t c = 0;
    for (const Seq& s : seqs) c += P.Hk * ((s.n + qb_ - 1) / qb_);
    return c;
  };
  int64_t nitems = count(qb);
  while (nitems < target && qb > 1) {
    const int64_t smaller = count(qb / 2);
    if (smaller == nitems) break;  // only single-query (decode) sequences: blocks do not matter
    qb /= 2;
    nitems = smaller;
  }
  const int64_t factor = nitems > 0 && nitems < target && threads > 1 ? (target + nitems - 1) / nitems : 1;
  items.clear();
  merges.clear();
  partial_floats = 0;
  for (int64_t b = 0; b < (int64_t)seqs.size(); ++b) {
    const Seq& s = seqs[(size_t)b];
    for (int64_t i0 = 0; i0 < s.n; i0 += qb) {
      const int64_t i1 = std::min(s.n, i0 + qb);
      const int64_t j0 = visible_lo(P, s.ctx + i0), j1 = s.ctx + i1;  // keys any of the block's queries sees
      const int64_t rows = (i1 - i0) * P.group, len = j1 - j0;
      const int64_t nsplit = std::clamp<int64_t>(len / kMinSplitKeys, 1, factor);
      for (int64_t g = 0; g < P.Hk; ++g) {
        if (nsplit == 1) {
          items.push_back({b, g, i0, i1, j0, j1, -1, rows * len});
          continue;
        }
        merges.push_back({b, g, i0, i1, partial_floats, nsplit});
        int64_t lo = j0;
        for (int64_t k = 1; k <= nsplit; ++k) {
          int64_t hi = k == nsplit ? j1 : j0 + len * k / nsplit;
          hi = std::min(j1, (hi + kTile - 1) / kTile * kTile);  // parts end on tile boundaries
          items.push_back({b, g, i0, i1, lo, hi, partial_floats, rows * (hi - lo)});
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

void reshape_and_cache(const Tensor& k, const Tensor& v, const Tensor& k_cache, const Tensor& v_cache,
                       const Tensor& slot_mapping) {
  const char* op = "reshape_and_cache";
  check_defined(op, k, "k");
  check_defined(op, v, "v");
  check_float(op, k, "k");
  check_float(op, v, "v");
  check_cache(op, k_cache, "k_cache");
  check_cache(op, v_cache, "v_cache");
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
  if (!k.device().is_cpu()) unsupported_device(op, k);

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
  write_cache(op, inner(k), k_cache, slots, bs);
  write_cache(op, inner(v), v_cache, slots, bs);
}

Tensor paged_attention(const Tensor& q_in, const Tensor& k_cache, const Tensor& v_cache, const Tensor& block_tables,
                       const Tensor& seq_lens, const Tensor& query_start_loc, float scale, int64_t sliding_window,
                       float softcap, const std::optional<Tensor>& out) {
  const char* op = "paged_attention";
  check_defined(op, q_in, "q");
  check_float(op, q_in, "q");
  check_dim(op, q_in, "q", 3);
  check_cache(op, k_cache, "k_cache");
  check_cache(op, v_cache, "v_cache");
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
  const int64_t B = seq_lens.size(0), max_blocks = block_tables.size(1);
  TALLOW_CHECK(block_tables.size(0) == B && query_start_loc.size(0) == B + 1, op,
               ": block_tables must be [B, max_blocks], seq_lens [B] and query_start_loc [B + 1]; got block_tables",
               shape_str(block_tables.shape()), " seq_lens", shape_str(seq_lens.shape()), " query_start_loc",
               shape_str(query_start_loc.shape()));
  if (!q_in.device().is_cpu()) unsupported_device(op, q_in);

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
  const Problem P{Hq, Hk, D, Dv, BS, Hq / Hk, sliding_window, scale, softcap, q.data_ptr(), q.stride(0),
                  q.stride(1), cache_view(k_cache), cache_view(v_cache), bt, o.data_ptr()};
  TALLOW_DISPATCH_FLOAT(op, q.dtype(), [&] {
    using Q = scalar_t;
    TALLOW_DISPATCH_FLOAT(op, k_cache.dtype(), [&] { run_paged<Q, scalar_t>(P, seqs); });
  });
  return o;
}

}  // namespace tallow::ops
