// Sampling on CUDA (contracts and the RNG in cpp/ops/sampling.h): apply_penalties, sample_tokens,
// logprobs. Rows are streamed with 16-byte loads, several in flight per thread.
//
// sample_tokens is one launch of `split` CTAs of 512 threads per row (two CTAs per SM fit): split > 1
// (a thread-block cluster, sm_90+) when the batch is too small to fill the GPU with a CTA per row.
// Per row:
//   greedy        each CTA streams its share of the row once: argmax (NaN largest, first index);
//                 the cluster combines the CTAs' results through distributed shared memory.
//   no filters    each CTA streams its share once: argmax of x + g. One multiply bounds x from
//                 above; a token whose bound + kGumbelMax is below the CTA's best score so far (in
//                 shared memory) is skipped unhashed, one whose bound + gumbel_bound(h) is below it
//                 is skipped without the division and the logs. Both are exact (a skipped token
//                 can neither win nor tie), so a row's token does not depend on the split; the few
//                 tokens left compute x = logit / T and g as the CPU does.
//   top-k <= 1024 one pass collects the candidates into shared memory: tokens at or above a
//                 threshold, raised as the buffer fills to the k-th largest in the buffer (the
//                 k-th largest of a subset is at most the row's, so every token of the top-k, ties
//                 included, is collected). Max, top-k, min-p, top-p and the draw then run on the
//                 buffer. Split rows: each CTA collects its slice's top k, rank 0 gathers them.
//   min-p         likewise, collecting the tokens with x >= (running max) + log(min_p) - slack: a
//                 superset of the kept tokens, and of a top-k's kept ones, whatever k.
//   top-p alone   a pass for the max, then one pass that sums every token's exact mass and collects
//                 the 2048 largest x; when the nucleus threshold (from the exact total) lies above
//                 every token left out, the rest runs on the buffer. One CTA per row.
//   otherwise, or when the buffer overflows, on one CTA: a pass for the max (and, for top-p alone,
//                 the softmax sum S), then radix selects over the row: three levels (11, 11, 10
//                 bits of the key), each a histogram pass whose elements of the chosen bin are also
//                 collected; once they fit in the buffer, the next levels (and, when the first
//                 level's collection fit, the draw) run there. Top-p histograms skip tokens with
//                 e < (1 - top_p) S / (2 V): together they weigh less than (1 - top_p) S, so the
//                 threshold is above them. The last pass draws over the kept tokens.
//   The thresholds are those of the CPU: integer masses, the same keys, the same ties.
// No host synchronisation, no allocation but the output: graph-capturable.
#include <algorithm>
#include <atomic>

#include "launch.cuh"
#include "ops_cuda.h"
#include "sampling.cuh"

namespace tallow::cuda {

namespace {

using namespace sampling_dev;

std::atomic<int> g_cap{kCap};

// ---- draws ------------------------------------------------------------------------------------

// Which tokens a draw keeps (besides x > -inf).
struct Kept {
  bool inf_only = false;  // the max is +inf: the +inf tokens
  float m = 0.f;
  uint32_t tau_key = 0;
  float min_p = 0.f;
  bool top_p = false;
  uint32_t t_key = 0;
  __device__ __forceinline__ bool operator()(float x) const {
    if (inf_only) return x == INFINITY;
    if (order_key(x) < tau_key) return false;
    if (min_p <= 0.f && !top_p) return true;
    const float e = expf(x - m);
    return (min_p <= 0.f || e >= min_p) && (!top_p || float_bits(e) >= t_key);
  }
};
struct KeepAll {
  __device__ __forceinline__ bool operator()(float) const { return true; }
};

// x + gumbel_bound(h) < skip_below(best) proves x + g rounds below best: the bound's 1e-3 of
// slack covers the roundings while |best| < 2^13, the 2^-22 |best| (two ulps) beyond.
__device__ __forceinline__ float skip_below(float best) { return best - fabsf(best) * 0x1p-22f; }

// The draw's score of a kept token: +inf for x = +inf (those win, the first one), else x + g
// (finite: g < 17.4 cannot carry a finite x past FLT_MAX).
__device__ __forceinline__ float score(float x, uint32_t h) { return x == INFINITY ? INFINITY : x + gumbel_bits(h); }

// CTA `rank` of `split`: its share's best kept token as a score_key, block-uniform (0: none).
template <class T, class K>
__device__ u64 draw_slice(Smem& s, const T* row, bool vec, int64_t V, int split, int rank, const Scale& sc,
                          RowKey key, const K& kept) {
  if (threadIdx.x == 0) s.best = 0;
  __syncthreads();
  float bv = -INFINITY, thr = -INFINITY;  // thr: a score some token of this CTA reached (clamped)
  int64_t bi = -1;
  auto step = [&] {
    const uint32_t b = *reinterpret_cast<volatile uint32_t*>(&s.best);
    if (b) thr = fmaxf(thr, fminf(key_value(b), 1e38f));
  };
  // x + g <= upper + bound(h) (+ the bound's slack), so d > bound(h) means x + g < thr: skip. NaN
  // (raw NaN, or nothing reached yet) never skips. thr <= 1e38 keeps a token whose bound overflows
  // (x may be +inf) from ever being skipped. Hashes only when some element of the pack is within
  // kGumbelMax of thr, then branch-free.
  auto test = [&](const auto& f, int64_t i0) -> uint32_t {
    constexpr int M = sizeof(f) / sizeof(float);
    float d[M];
    bool near = false;
#pragma unroll
    for (int j = 0; j < M; ++j) {
      d[j] = thr - sc.upper(f[j]);
      near |= !(d[j] > kGumbelMax);
    }
    if (!near) return 0u;
    const uint32_t base = key.a * (uint32_t)i0 + key.c;  // token_bits(key, i0 + j) = hash32(base + a j)
    uint32_t bits = 0;
#pragma unroll
    for (int j = 0; j < M; ++j) {
      const float gb = gumbel_bound(hash32(base + key.a * (uint32_t)j));
      if (!(gb < d[j])) bits |= 1u << j;  // d > kGumbelMax > gb skips too
    }
    return bits;
  };
  auto slow = [&](int64_t i) {
    const float raw = to_float(row[i]);
    const uint32_t h = token_bits(key, i);
    const float d = thr - sc.upper(raw);  // again: thr may have risen since the pack's test
    if (d > kGumbelMax || gumbel_bound(h) < d) return;
    const float x = sc.exact(raw);
    if (!(x > -INFINITY) || !kept(x)) return;
    const float v = score(x, h);
    if (bi < 0 || v > bv) {  // this thread's indices increase: an equal score loses
      bv = v;
      bi = i;
      thr = fmaxf(thr, fminf(v, 1e38f));
      atomicMax(&s.best, order_key(v == 0.f ? 0.f : v));
    }
  };
  for_slice<T>(row, vec, V, split, rank, test, slow, step);
  return block_max_u64(bi < 0 ? 0ull : score_key(bv, bi), s.red64);
}

// The draw over the buffer (complete) or the whole row; -1 when nothing is kept.
template <class T>
__device__ int32_t draw(Smem& s, const RowRef<T>& rr, bool in_buf, int cap, const Scale& sc, RowKey key,
                        const Kept& kept) {
  u64 best;
  if (in_buf) {
    float bv = -INFINITY;
    int64_t bi = -1;
    visit_buf(s, cap, [&](float x, int64_t i, bool valid) {
      if (!valid || !(x > -INFINITY)) return;
      const uint32_t h = token_bits(key, i);
      if (bi >= 0 && x + gumbel_bound(h) < skip_below(bv)) return;  // cannot win or tie
      if (!kept(x)) return;
      const float v = score(x, h);
      if (bi < 0 || v > bv || (v == bv && i < bi)) bv = v, bi = i;
    });
    best = block_max_u64(bi < 0 ? 0ull : score_key(bv, bi), s.red64);
  } else {
    best = draw_slice(s, rr.row, rr.vec_ok, rr.n, 1, 0, sc, key, kept);
  }
  return best == 0 ? -1 : score_index(best);
}

// ---- greedy and the row max ---------------------------------------------------------------------

// CTA `rank`'s share: rank_key of its argmax (NaN largest, first index), block-uniform. A thread
// whose values are all -inf reports its first element.
template <class T>
__device__ u64 greedy_slice(Smem& s, const T* row, bool vec, int64_t V, int split, int rank) {
  float bv = -INFINITY;
  int32_t bi = -1, first = 0x7fffffff;  // V < 2^31
  for_slice<T>(
      row, vec, V, split, rank,
      [&](const auto& f, int64_t i0) {
        constexpr int M = sizeof(f) / sizeof(float);
        first = min(first, (int32_t)i0);
#pragma unroll
        for (int j = 0; j < M; ++j)
          if (f[j] > bv || (f[j] != f[j] && bv == bv)) bv = f[j], bi = (int32_t)i0 + j;
        return 0u;
      },
      [](int64_t) {}, [] {});
  if (bi < 0 && first != 0x7fffffff) bi = first;
  return block_max_u64(bi < 0 ? 0ull : (u64)rank_key(bv, bi), s.red64);
}

// The largest non-NaN raw logit of the row (-inf if none), block-uniform.
template <class T>
__device__ float row_max(Smem& s, const T* row, bool vec, int64_t V) {
  float mt = -INFINITY;
  for_slice<T>(
      row, vec, V, 1, 0,
      [&](const auto& f, int64_t) {
        constexpr int M = sizeof(f) / sizeof(float);
#pragma unroll
        for (int j = 0; j < M; ++j) mt = fmaxf(mt, f[j]);
        return 0u;
      },
      [](int64_t) {}, [] {});
  return block_max(mt, s.redf);
}

// ---- filtered rows ------------------------------------------------------------------------------

// min-p streaming: one pass collecting every token with x >= floor(max so far), where floor(m) =
// m + log(min_p) - slack lies below every x with expf(x - m) >= min_p (expf within 2 ulp, the
// roundings of the subtraction and of log: 1e-5 + 2^-18 (|m| + |log min_p|) covers them). The
// running max only rises, so the buffer ends holding a superset of the final min-p set, which is a
// top set of x (e is monotone in x): the draw, and a top-k over the buffer, are then exact.
// m_out: the exact max x. False when the buffer overflowed.
__device__ __forceinline__ float minp_floor(float m, float lnmp) {
  if (!(m > -INFINITY && m < INFINITY)) return m;
  return m + lnmp - (1e-5f + 0x1p-18f * (fabsf(m) + fabsf(lnmp)));
}

template <class T>
__device__ __noinline__ bool stream_minp(Smem& s, const RowRef<T>& rr, int cap, const Scale& sc, float lnmp,
                                         float& m_out, int64_t base = 0) {
  if (threadIdx.x == 0) s.n = 0, s.best = order_key(-INFINITY);
  __syncthreads();
  float mloc = -INFINITY;
  uint32_t published = order_key(-INFINITY);
  bool ok = true;
  stream_row(rr, [&](const float (&v)[kVec], int64_t i0) {
    // any max read here (others may be raising it) is some tokens' max, so its floor is valid
    const float thr_x = minp_floor(sc.exact(key_value(s.best)), lnmp);
    float xs[kVec];
    bool any = false;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      xs[j] = -INFINITY;
      if (i0 + j < rr.n) {
        mloc = fmaxf(mloc, v[j]);
        if (sc.upper(v[j]) >= thr_x) xs[j] = sc.exact(v[j]);
      }
      any |= xs[j] > -INFINITY && xs[j] >= thr_x;
    }
    if (__any_sync(0xffffffffu, any)) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) append(s, xs[j] > -INFINITY && xs[j] >= thr_x, xs[j], base + i0 + j, cap);
    }
    const uint32_t mk = order_key(mloc == 0.f ? 0.f : mloc);
    if (mk > published) {
      atomicMax(&s.best, mk);
      published = mk;
    }
    __syncthreads();
    const int n = s.n;
    const float floor_now = minp_floor(sc.exact(key_value(s.best)), lnmp);
    __syncthreads();  // every thread has read s.n and s.best
    if (n > cap - kChunk) {
      compact_if(s, cap, [&](float x) { return x >= floor_now; });
      if (s.n > cap - kChunk) ok = false;
      __syncthreads();
    }
    return ok;
  });
  m_out = sc.exact(key_value(s.best));
  return ok;
}

// top-k <= kStreamMaxK: the candidates in one pass (stream_collect); false when the buffer overflowed.
template <class T>
__device__ __noinline__ bool collect_topk(Smem& s, const RowRef<T>& rr, int cap, int k, const Scale& sc,
                                          int64_t base = 0) {
  return stream_collect(
      s, rr, cap, k, false,
      [&](float raw, float thr_x) { return sc.upper(raw) >= thr_x ? sc.exact(raw) : -INFINITY; }, base);
}

// top-p alone, m finite: one pass sums every token's exact mass and collects the kNucleusK largest
// x; true, with the threshold's key in t_key, when the threshold lies above every token left out.
template <class T>
__device__ __noinline__ bool collect_nucleus(Smem& s, const RowRef<T>& rr, int cap, const Scale& sc, float m, float p,
                                             uint32_t& t_key) {
  // Tokens below m - 32 have e < 2^-44: mass 0, never in the nucleus (its threshold carries mass).
  const float cut = m - 32.f;
  u64 tot = 0;
  const bool ok = stream_collect(s, rr, cap, kNucleusK, false, [&](float raw, float) {
    if (!(sc.upper(raw) >= cut)) return -INFINITY;
    const float x = sc.exact(raw);
    if (x > -INFINITY) tot += mass(expf(x - m));
    return x;
  });
  const u64 total = block_sum_u64(tot, s.red64);
  if (!ok) return false;
  // The buffer holds exactly the tokens with key >= thr (and mass > 0), so its cumulative masses
  // are the row's above every token left out, whose e are <= e_thr: a threshold t > e_thr found in
  // the buffer is the row's.
  SelectArgs a;
  a.m = m;
  a.top_p = p;
  a.total = total;
  bool in_buf = true, complete = true, found = false;
  const uint32_t thr = s.thr;
  t_key = radix_select<true>(s, rr, cap, in_buf, complete, a, &found);
  return found && (thr == 0 || t_key > float_bits(expf(key_value(thr) - m)));
}

// The fallback's first pass: the max x and, with want_s, the softmax sum S relative to it.
template <class T>
__device__ __noinline__ float row_stats(Smem& s, const RowRef<T>& rr, const Scale& sc, bool want_s, float& S) {
  float mt = -INFINITY, st = 0.f;
  visit_row(rr, [&](float raw, int64_t, bool valid) {
    const float x = sc.exact(raw);
    if (!valid || !(x > -INFINITY)) return;
    if (!want_s) {
      mt = fmaxf(mt, x);
    } else if (x > mt) {
      st = st * expf(mt - x) + 1.f;
      mt = x;
    } else {
      st += expf(x - mt);
    }
  });
  const float m = block_max(mt, s.redf);
  S = want_s ? block_sum(mt == -INFINITY ? 0.f : st * expf(mt - m), s.redf) : 0.f;
  return m;
}

// The max x over the buffer.
__device__ __noinline__ float buffer_max(Smem& s, int cap) {
  float mt = -INFINITY;
  visit_buf(s, cap, [&](float x, int64_t, bool valid) {
    if (valid) mt = fmaxf(mt, x);
  });
  return block_max(mt, s.redf);
}

template <bool kMass, class T>
__device__ __noinline__ uint32_t select_key(Smem& s, const RowRef<T>& rr, int cap, bool& in_buf, bool& complete,
                                            const SelectArgs& a) {
  return radix_select<kMass>(s, rr, cap, in_buf, complete, a);
}

template <class T>
__device__ __noinline__ int32_t draw_kept(Smem& s, const RowRef<T>& rr, bool in_buf, int cap, const Scale& sc,
                                          RowKey key, const Kept& kept) {
  return draw(s, rr, in_buf, cap, sc, key, kept);
}

// The filters and the draw once the row max x is known: on the buffer when complete (it holds
// every token the filters can keep), else by passes over the row. have_t: the top-p threshold key
// is already known (t_key). S: the softmax sum for the top-p bound, 0 if unknown. -1: nothing kept.
template <class T>
__device__ __noinline__ int32_t finish_row(Smem& s, const RowRef<T>& rr, int cap, const Scale& sc, int k, float p,
                                           float mp, RowKey key, float m, bool complete, float S, bool have_t,
                                           uint32_t t_key) {
  const int64_t V = rr.n;
  const bool use_k = k > 0 && k < V, use_p = p < 1.f, use_mp = mp > 0.f;
  if (!(m > -INFINITY)) return -1;
  Kept kept;
  kept.m = m;
  if (m == INFINITY) {
    kept.inf_only = true;
  } else {
    bool in_buf = complete;
    if (use_k) {
      SelectArgs a;
      a.k = k;
      a.temp = sc.temp;
      kept.tau_key = select_key<false>(s, rr, cap, in_buf, complete, a);
    }
    kept.min_p = mp;
    if (use_p) {
      kept.top_p = true;
      if (have_t) {
        kept.t_key = t_key;
      } else {
        in_buf = complete;  // a buffer holding only one bin of the top-k select is of no use here
        SelectArgs a;
        a.temp = sc.temp;
        a.m = m;
        a.tau_key = kept.tau_key;
        a.min_p = mp;
        a.top_p = p;
        // mass below the bound < V * bound * 2^44 <= (1 - p) * S' / 2 with S' >= 1 (the max), or
        // S' = S when S counts exactly the selection (top-p alone); S is f32, hence the 1/2 margin
        const float sl = (!use_k && !use_mp && S >= 1.f && S < INFINITY) ? S : 1.f;
        a.bound = (float)(0.5 * (1.0 - (double)p) * (double)sl / (double)V);
        kept.t_key = select_key<true>(s, rr, cap, in_buf, complete, a);
      }
    }
  }
  return draw_kept(s, rr, complete, cap, sc, key, kept);
}

// The token of a row with filters (see the file comment), on one CTA; -1 when nothing is kept.
// All threads of the CTA call it.
template <class T>
__device__ __noinline__ int32_t filtered_row(Smem& s, const RowRef<T>& rr, int cap, const Scale& sc, int k, float p,
                                             float mp, RowKey key) {
  const int64_t V = rr.n;
  const bool use_k = k > 0 && k < V, use_p = p < 1.f, use_mp = mp > 0.f;
  float m = -INFINITY, S = 0.f;
  bool have_m = false, complete = false, have_t = false;
  uint32_t t_key = 0;
  if (cap >= kStreamMinCap) {
    if (use_k && k <= kStreamMaxK) {
      complete = collect_topk(s, rr, cap, k, sc);
    } else if (use_mp) {
      float mm;
      complete = stream_minp(s, rr, cap, sc, logf(mp), mm);
      if (complete) m = mm, have_m = true;
    } else if (use_p && !use_k) {
      m = sc.exact(row_max(s, rr.row, rr.vec_ok, V));
      have_m = true;
      if (m > -INFINITY && m < INFINITY) complete = have_t = collect_nucleus(s, rr, cap, sc, m, p, t_key);
    }
  }
  if (!have_m) m = complete ? buffer_max(s, cap) : row_stats(s, rr, sc, use_p && !use_k && !use_mp, S);
  return finish_row(s, rr, cap, sc, k, p, mp, key, m, complete, S, have_t, t_key);
}

// Whether a filtered row runs split over the cluster (the single-pass collections).
__device__ __forceinline__ bool split_filters(int64_t V, int cap, int k, float mp) {
  return cap >= kStreamMinCap && ((k > 0 && k < V && k <= kStreamMaxK) || mp > 0.f);
}

// A filtered row over the `split` CTAs of a cluster: each collects the candidates of its slice
// (top-k <= kStreamMaxK: the slice's k largest, ties kept, which include every token of the row's
// top k; else min-p: the slice's tokens above the floor of its own max, which is at most the
// row's), then rank 0 gathers them from the others' shared memory (min-p: only those above the
// floor of the row's max) and finishes on the buffer. If any collection overflowed, rank 0 starts
// over alone. Returns the token on rank 0 (-1: nothing kept), -2 elsewhere. All threads of every
// CTA of the cluster call it.
template <class T>
__device__ __noinline__ int32_t filtered_row_split(Smem& s, const RowRef<T>& rr, int cap, const Scale& sc, int k,
                                                   float p, float mp, RowKey key, int split, int rank) {
  const int64_t V = rr.n;
  const bool top = k > 0 && k < V && k <= kStreamMaxK;
  const float lnmp = top ? 0.f : logf(mp);
  // slices of whole steps' worth of kVec elements: 16-byte aligned wherever the row is
  const int64_t per = ((V + split - 1) / split + kVec - 1) / kVec * kVec;
  const int64_t e0 = min(V, rank * per), e1 = min(V, e0 + per);
  const RowRef<T> sl{rr.row + e0, e1 - e0, rr.vec_ok};
  bool ok;
  if (top) {
    ok = collect_topk(s, sl, cap, k, sc, e0);
    if (ok) compact_topk(s, sl, cap, k);  // down to the slice's k largest (ties kept)
  } else {
    float unused;
    ok = stream_minp(s, sl, cap, sc, lnmp, unused, e0);
  }
  if (threadIdx.x == 0) s.ok = ok ? 1 : 0;
  cluster_arrive_release();  // every CTA's buffer, n, ok and max (s.best) are final and visible
  cluster_wait();
  bool all_ok = ok;
  float m = -INFINITY;
  if (rank == 0) {
    uint32_t mkey = s.best;  // min-p: the order key of the largest raw logit, over the slices
    for (int q = 1; q < split; ++q) {
      all_ok = all_ok && ld_cluster(cluster_addr(&s.ok, q)) != 0;
      if (!top) {
        const uint32_t b = ld_cluster(cluster_addr(&s.best, q));
        mkey = b > mkey ? b : mkey;
      }
    }
    float floor_x = -INFINITY;
    if (!top) {
      m = sc.exact(key_value(mkey));
      floor_x = minp_floor(m, lnmp);
    }
    if (all_ok) {
      for (int q = 1; q < split; ++q) {
        const int nq = min((int)ld_cluster(cluster_addr(&s.n, q)), cap);
        const uint32_t bx = cluster_addr(&s.bx[0], q), bi = cluster_addr(&s.bi[0], q);
        for (int j0 = 0; j0 < nq; j0 += kThreads) {
          const int j = j0 + (int)threadIdx.x;
          float x = 0.f;
          int32_t i = 0;
          bool take = false;
          if (j < nq) {
            x = __uint_as_float(ld_cluster(bx + 4u * (uint32_t)j));
            i = (int32_t)ld_cluster(bi + 4u * (uint32_t)j);
            take = x >= floor_x;
          }
          append(s, take, x, i, cap);
        }
      }
      __syncthreads();
      all_ok = s.n <= cap;
    }
  }
  cluster_arrive_release();  // rank 0 is done with the others' shared memory: they may exit
  cluster_wait();
  if (rank != 0) return -2;
  if (!all_ok) return filtered_row(s, rr, cap, sc, k, p, mp, key);
  if (top) m = buffer_max(s, cap);
  return finish_row(s, rr, cap, sc, k, p, mp, key, m, true, 0.f, false, 0u);
}

// ---- sample_tokens ----------------------------------------------------------------------------

template <class T>
__global__ void __launch_bounds__(kThreads, 2)
    sample_kernel(const T* __restrict__ logits, int64_t row_stride, int64_t V, const float* __restrict__ temperature,
                  const int32_t* __restrict__ top_k, const float* __restrict__ top_p, const float* __restrict__ min_p,
                  const int64_t* __restrict__ seeds, const int64_t* __restrict__ offsets, int cap, int split,
                  int32_t* __restrict__ out) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem& s = *reinterpret_cast<Smem*>(smem_raw);
  const int64_t r = blockIdx.x / (unsigned)split;
  const int rank = (int)(blockIdx.x % (unsigned)split);  // == the cluster rank: clusters are (split, 1, 1)
  const T* row = logits + r * row_stride;
  const bool vec = ((uintptr_t)row & 15) == 0;
  const float temp = temperature[r];
  const bool greedy = !(temp >= 1e-5f);  // NaN too: the CPU finds nothing finite and falls back to it
  const int k = top_k[r];
  const float p = top_p[r], mp = min_p[r];
  if (!greedy && ((k > 0 && k < V) || p < 1.f || mp > 0.f)) {
    const RowRef<T> rr{row, V, vec};
    int32_t tok;
    if (split > 1 && split_filters(V, cap, k, mp)) {
      tok = filtered_row_split(s, rr, cap, Scale(temp), k, p, mp, row_key(seeds[r], offsets[r]), split, rank);
      if (rank != 0) return;
    } else {
      if (rank != 0) return;  // the others exit at once
      tok = filtered_row(s, rr, cap, Scale(temp), k, p, mp, row_key(seeds[r], offsets[r]));
    }
    if (tok < 0) tok = (int32_t)key_index(greedy_slice(s, row, vec, V, 1, 0));  // nothing kept
    if (threadIdx.x == 0) out[r] = tok;
    return;
  }
  if (split > 1) cluster_arrive_relaxed();
  u64 best = greedy ? greedy_slice(s, row, vec, V, split, rank)
                    : draw_slice(s, row, vec, V, split, rank, Scale(temp), row_key(seeds[r], offsets[r]), KeepAll{});
  best = cluster_max(s, best, split, rank);
  if (rank != 0) return;
  int32_t tok;
  if (greedy)
    tok = (int32_t)key_index(best);
  else if (best != 0)
    tok = score_index(best);
  else  // nothing finite: the greedy argmax of the raw logits
    tok = (int32_t)key_index(greedy_slice(s, row, vec, V, 1, 0));
  if (threadIdx.x == 0) out[r] = tok;
}

// ---- logprobs ---------------------------------------------------------------------------------

template <class T>
__global__ void __launch_bounds__(kThreads, 2)
    logprobs_kernel(const T* __restrict__ logits, int64_t row_stride, int64_t V, const int32_t* __restrict__ token_ids,
                    int num_top, int cap, float* __restrict__ vals, int32_t* __restrict__ ids,
                    int32_t* __restrict__ ranks) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem& s = *reinterpret_cast<Smem*>(smem_raw);
  const int64_t r = blockIdx.x;
  const RowRef<T> rr{logits + r * row_stride, V, ((uintptr_t)(logits + r * row_stride) & 15) == 0};
  const int C = 1 + num_top;
  const int32_t t = token_ids[r];
  const bool t_ok = t >= 0 && t < V;
  const float xt = t_ok ? to_float(rr.row[t]) : NAN;
  float mt = -INFINITY, st = 0.f;
  u64 above = 0;
  bool nan = false;
  auto stats = [&](float x) {
    above += x > xt;
    if (x != x) {
      nan = true;
    } else if (x > mt) {
      st = (mt == -INFINITY ? 0.f : st * expf(mt - x)) + 1.f;
      mt = x;
    } else if (x > -INFINITY) {
      st += expf(x - mt);
    }
  };
  bool ok = false;
  if (num_top > 0 && cap >= kStreamMinCap) {
    ok = stream_collect(s, rr, cap, num_top, true, [&](float raw, float) {
      stats(raw);
      return raw != raw ? -INFINITY : to_x(raw, 0.f);
    });
  } else {
    visit_row(rr, [&](float x, int64_t, bool valid) {
      if (valid) stats(x);
    });
  }
  const float m = block_max(mt, s.redf);
  const float S = block_sum(mt == -INFINITY ? 0.f : st * expf(mt - m), s.redf);
  const bool any_nan = block_sum(nan ? 1.f : 0.f, s.redf) > 0.f;
  const u64 n_above = block_sum_u64(above, s.red64);
  const float lse = (any_nan || !(m > -INFINITY) || m == INFINITY) ? NAN : m + logf(S);
  if (threadIdx.x == 0) {
    vals[r * C] = t_ok ? xt - lse : NAN;
    ids[r * C] = t;
    ranks[r] = t_ok ? (int32_t)(1 + n_above) : 0;
  }
  if (num_top == 0) return;
  // top num_top in topk's order (rank_key): from the buffer when it holds them, else from the row
  const bool from_buf = ok && !any_nan && min(s.n, cap) >= num_top;
  u64 prev = ~0ull;
  for (int j = 0; j < num_top; ++j) {
    u64 best = 0;
    auto f = [&](float x, int64_t i, bool valid) {
      if (!valid) return;
      const u64 key = rank_key(x, i);
      if (key < prev && key > best) best = key;
    };
    if (from_buf)
      visit_buf(s, cap, f);
    else
      visit_row(rr, f);
    best = block_max_u64(best, s.red64);
    prev = best;
    if (threadIdx.x == 0) {
      const int64_t i = key_index(best);
      vals[r * C + 1 + j] = to_float(rr.row[i]) - lse;
      ids[r * C + 1 + j] = (int32_t)i;
    }
  }
}

// ---- apply_penalties --------------------------------------------------------------------------

__global__ void penalties_kernel(float* __restrict__ logits, int64_t V, const int32_t* __restrict__ token_ids,
                                 const int32_t* __restrict__ counts, int64_t L, int64_t total,
                                 const float* __restrict__ rep, const float* __restrict__ freq,
                                 const float* __restrict__ pres) {
  for (int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; q < total; q += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = q / L;
    const int32_t id = token_ids[q];
    if (id < 0 || id >= V) continue;  // padding, or out of range (skipped: no read-back on the decode path)
    const int32_t c = counts[q];
    float* p = logits + r * V + id;
    float v = *p;
    if (c < 0) {
      v = -INFINITY;
    } else {
      const float rp = rep[r];
      if (rp != 1.f) v = v > 0.f ? __fdiv_rn(v, rp) : __fmul_rn(v, rp);
      // the CPU's two roundings, not an FMA
      v = __fsub_rn(v, __fadd_rn(__fmul_rn(freq[r], (float)c), c > 0 ? pres[r] : 0.f));
    }
    *p = v;
  }
}

// One thread per 32-token word: a word of all ones (an unconstrained row) costs one load.
template <class T>
__global__ void token_bitmask_kernel(T* __restrict__ logits, int64_t rs, int64_t V, const int32_t* __restrict__ mask,
                                     int64_t W, int64_t words) {
  for (int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; q < words; q += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = q / W, w = q % W;
    const uint32_t bits = (uint32_t)mask[q];
    if (bits == 0xFFFFFFFFu || 32 * w >= V) continue;
    T* row = logits + r * rs + 32 * w;
    const int64_t left = V - 32 * w;
    const int end = left < 32 ? (int)left : 32;
    for (int k = 0; k < end; ++k)
      if (!(bits >> k & 1u)) row[k] = from_float<T>(-INFINITY);
  }
}

template <class K>
void set_smem(const char* op, K kernel) {
  TALLOW_CUDA_CHECK(op, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sizeof(Smem)));
}

// Compute capability major of the current device (cached per device).
int cc_major() {
  static std::atomic<int> majors[64] = {};
  int dev = 0;
  TALLOW_CUDA_CHECK("sample_tokens", cudaGetDevice(&dev));
  if (dev >= 64) dev = 63;
  int m = majors[dev].load();
  if (!m) {
    TALLOW_CUDA_CHECK("sample_tokens", cudaDeviceGetAttribute(&m, cudaDevAttrComputeCapabilityMajor, dev));
    majors[dev].store(m);
  }
  return m;
}

}  // namespace

void set_sampling_buffer_capacity(int n) { g_cap.store(n <= 0 || n > kCap ? kCap : n); }

void apply_penalties(const Tensor& logits, const Tensor& token_ids, const Tensor& token_counts,
                     const Tensor& repetition_penalty, const Tensor& frequency_penalty,
                     const Tensor& presence_penalty) {
  const char* op = "apply_penalties";
  const int64_t B = logits.size(0), V = logits.size(1), L = token_ids.size(1), total = B * L;
  if (total == 0) return;
  OpContext ctx(logits);
  penalties_kernel<<<grid_for(total, 256), 256, 0, ctx.stream>>>(
      logits.data<float>(), V, token_ids.data<int32_t>(), token_counts.data<int32_t>(), L, total,
      repetition_penalty.data<float>(), frequency_penalty.data<float>(), presence_penalty.data<float>());
  TALLOW_CUDA_CHECK_LAUNCH(op);
}

void apply_token_bitmask_(const Tensor& logits, const Tensor& bitmask) {
  const char* op = "apply_token_bitmask_";
  const int64_t B = logits.size(0), V = logits.size(1), W = bitmask.size(1), words = B * W;
  if (words == 0) return;
  OpContext ctx(logits);
  TALLOW_CUDA_DISPATCH_FLOAT(op, logits.dtype(), [&] {
    using T = scalar_t;
    token_bitmask_kernel<T><<<grid_for(words, 256), 256, 0, ctx.stream>>>(
        static_cast<T*>(logits.data_ptr()), logits.stride(0), V, bitmask.data<int32_t>(), W, words);
  });
  TALLOW_CUDA_CHECK_LAUNCH(op);
}

Tensor sample_tokens(const Tensor& logits, const Tensor& temperature, const Tensor& top_k, const Tensor& top_p,
                     const Tensor& min_p, const Tensor& seeds, const Tensor& offsets) {
  const char* op = "sample_tokens";
  const int64_t B = logits.size(0), V = logits.size(1);
  Tensor out = Tensor::empty({B}, DType::I32, logits.device());
  if (B == 0) return out;
  TALLOW_CHECK(B <= 0x7fffffffLL, op, ": too many rows (", B, ")");
  OpContext ctx(logits);
  // CTAs per row: as many as keep two CTAs per SM busy (the shared memory allows two), up to a
  // portable cluster; clusters need sm_90.
  int split = 1;
  if (cc_major() >= 9) split = (int)std::clamp<int64_t>(2LL * sm_count() / B, 1, kMaxSplit);
  TALLOW_CUDA_DISPATCH_FLOAT(op, logits.dtype(), [&] {
    using T = scalar_t;
    auto kernel = sample_kernel<T>;
    set_smem(op, kernel);
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3((unsigned)(B * split));
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = sizeof(Smem);
    cfg.stream = ctx.stream;
    cudaLaunchAttribute attr[1];
    if (split > 1) {
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = (unsigned)split;
      attr[0].val.clusterDim.y = 1;
      attr[0].val.clusterDim.z = 1;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
    }
    TALLOW_CUDA_CHECK(op, cudaLaunchKernelEx(&cfg, kernel, static_cast<const T*>(logits.data_ptr()), logits.stride(0),
                                             V, temperature.data<float>(), top_k.data<int32_t>(),
                                             top_p.data<float>(), min_p.data<float>(), seeds.data<int64_t>(),
                                             offsets.data<int64_t>(), g_cap.load(), split, out.data<int32_t>()));
  });
  TALLOW_CUDA_CHECK_LAUNCH(op);
  return out;
}

std::tuple<Tensor, Tensor, Tensor> logprobs(const Tensor& logits, const Tensor& token_ids, int64_t num_top) {
  const char* op = "logprobs";
  const int64_t B = logits.size(0), V = logits.size(1), C = 1 + num_top;
  Tensor vals = Tensor::empty({B, C}, DType::F32, logits.device());
  Tensor ids = Tensor::empty({B, C}, DType::I32, logits.device());
  Tensor ranks = Tensor::empty({B}, DType::I32, logits.device());
  if (B == 0) return {vals, ids, ranks};
  TALLOW_CHECK(B <= 0x7fffffffLL, op, ": too many rows (", B, ")");
  OpContext ctx(logits);
  TALLOW_CUDA_DISPATCH_FLOAT(op, logits.dtype(), [&] {
    using T = scalar_t;
    set_smem(op, logprobs_kernel<T>);
    logprobs_kernel<T><<<(unsigned)B, kThreads, sizeof(Smem), ctx.stream>>>(
        static_cast<const T*>(logits.data_ptr()), logits.stride(0), V, token_ids.data<int32_t>(), (int)num_top,
        g_cap.load(), vals.data<float>(), ids.data<int32_t>(), ranks.data<int32_t>());
  });
  TALLOW_CUDA_CHECK_LAUNCH(op);
  return {vals, ids, ranks};
}

}  // namespace tallow::cuda
