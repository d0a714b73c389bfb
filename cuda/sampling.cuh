// Device building blocks of the sampling kernels (sampling.cu): row streaming with 16-byte loads,
// a candidate buffer in shared memory with warp-aggregated appends, radix selection over
// order-preserving keys, and the reduction of a row split over a thread-block cluster.
#pragma once
#include <cstring>
#include <type_traits>

#include "cluster.cuh"
#include "common.cuh"
#include "ops/sampling.h"
#include "topk.cuh"

namespace tallow::cuda::sampling_dev {

using namespace tallow::sampling;
using u64 = unsigned long long;

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kVec = 8;                   // elements per thread per step of the buffered passes
constexpr int kChunk = kThreads * kVec;   // elements per CTA step
constexpr int kCap = 8192;                // candidate buffer (x, index): 64 KiB
constexpr int kBins = 2048;               // radix digits of 11, 11 and 10 bits
constexpr int kStreamMaxK = 1024;         // top-k by streaming collection up to this k
constexpr int kNucleusK = 2048;           // top-p alone: the largest tokens collected by the mass pass
constexpr int kStreamMinCap = kChunk + 2 * kNucleusK;  // the single-pass modes need the whole buffer
constexpr int kMaxSplit = 8;              // CTAs per row: a portable thread-block cluster
constexpr int kUnroll = 4;                // 16-byte loads in flight per thread in the streaming loops

struct Smem {
  float bx[kCap];
  int32_t bi[kCap];
  u64 hist[kBins];
  u64 red64[32];
  float redf[32];
  u64 slots[kMaxSplit];  // cluster reduction: each CTA's result, in rank 0
  int n;                 // appended so far (more than the capacity: overflow, the extra ones dropped)
  uint32_t thr;          // streaming top-k: keys below this are not appended
  uint32_t best;         // draw: order key of the CTA's best score so far; min-p: of the max logit
  uint32_t sel_digit;
  u64 sel_above;
  int ok;                // split filtered rows: this CTA's collection fit
};

// ---- per-element helpers ------------------------------------------------------------------------

// x = scaled_logit(raw, T) exactly (a division), and an upper bound on it from one multiply:
// hi, lo = (1/T)(1 +- 2^-18), so raw * (raw > 0 ? hi : lo) >= x for every raw (the 2^-18 covers
// the three roundings, 2^-24 each; below the normal range the bound's slack is the 1e-3 of
// gumbel_bound). NaN stays NaN and -inf stays -inf; T = inf gives 0 (x = 0 for finite raw).
struct Scale {
  float temp, hi, lo;
  __device__ explicit Scale(float t) : temp(t) {
    const float inv = 1.f / t;
    hi = inv * (1.f + 0x1p-18f);
    lo = inv * (1.f - 0x1p-18f);
  }
  __device__ __forceinline__ float upper(float raw) const { return raw * (raw > 0.f ? hi : lo); }
  __device__ __forceinline__ float exact(float raw) const { return scaled_logit(raw, temp); }
};

// A draw score's key: larger = better, then the lower index (0 = nothing).
__device__ __forceinline__ u64 score_key(float v, int64_t i) {
  return ((u64)order_key(v == 0.f ? 0.f : v) << 32) | (u64)(0xffffffffu - (uint32_t)i);
}
__device__ __forceinline__ int32_t score_index(u64 k) { return (int32_t)(0xffffffffu - (uint32_t)(k & 0xffffffffu)); }

// ---- reductions ---------------------------------------------------------------------------------

__device__ __forceinline__ u64 warp_max_u64(u64 v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const u64 w = __shfl_xor_sync(0xffffffffu, v, o);
    v = w > v ? w : v;
  }
  return v;
}
__device__ __forceinline__ u64 warp_sum_u64(u64 v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
// Block reductions: every thread gets the result; safe to call back to back.
__device__ __forceinline__ u64 block_max_u64(u64 v, u64* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_max_u64(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  return warp_max_u64(lane < kWarps ? red[lane] : 0ull);
}
__device__ __forceinline__ u64 block_sum_u64(u64 v, u64* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum_u64(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  return warp_sum_u64(lane < kWarps ? red[lane] : 0ull);
}

// The largest of the split CTAs' block-uniform values, in every thread of rank 0 (others: their
// own). All threads of every CTA of the cluster call it, after cluster_arrive_relaxed() at the start.
__device__ __forceinline__ u64 cluster_max(Smem& s, u64 v, int split, int rank) {
  if (split == 1) return v;
  cluster_wait();
  if (threadIdx.x == 0) store_remote(&s.slots[rank], 0, v);
  cluster_arrive_release();
  cluster_wait();
  if (rank != 0) return v;
  u64 m = 0;
  for (int q = 0; q < split; ++q) m = s.slots[q] > m ? s.slots[q] : m;
  return m;
}

// ---- streaming over a row (the fast paths) ------------------------------------------------------

// The 16 / sizeof(T) elements of a 16-byte pack as floats (exact conversions).
template <class T>
__device__ __forceinline__ void unpack16(const uint4& q, float (&f)[16 / sizeof(T)]) {
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if constexpr (sizeof(T) == 4) {
      f[k] = __uint_as_float(w[k]);
    } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      f[2 * k] = __uint_as_float(w[k] << 16);  // little endian: element 2k is the low half
      f[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    } else {
      __half2 h;
      memcpy(&h, &w[k], 4);
      const float2 t = __half22float2(h);
      f[2 * k] = t.x;
      f[2 * k + 1] = t.y;
    }
  }
}

// For this thread's elements of CTA `rank`'s share of the row [0, V) (split shares of whole
// 16-byte packs; the last share also takes the tail), in increasing i: test(f, i0) on arrays f of
// consecutive raw values (a pack, or a single element) returns a bit per element that needs
// slow(i), which then runs for those elements in increasing i (slow's code appears once and
// rereads its element, in L1 by then, so the rare slow path costs no registers in the hot loop).
// kUnroll packs are loaded before any is tested; step() runs before each group (no barriers).
template <class T, class Test, class Slow, class Step>
__device__ __forceinline__ void for_slice(const T* row, bool vec, int64_t V, int split, int rank, Test&& test,
                                          Slow&& slow, Step&& step) {
  constexpr int N = 16 / sizeof(T);
  static_assert(kUnroll * N <= 32, "one bit per element of a group");
  if (vec) {
    const int64_t P = V / N, per = (P + split - 1) / split, p0 = rank * per;
    const int64_t p1 = p0 + per < P ? p0 + per : P;
    for (int64_t p = p0 + threadIdx.x; p < p1; p += (int64_t)kUnroll * kThreads) {
      step();
      uint4 q[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t pu = p + (int64_t)u * kThreads;
        if (pu < p1) q[u] = __ldg(reinterpret_cast<const uint4*>(row) + pu);
      }
      uint32_t hits = 0;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t pu = p + (int64_t)u * kThreads;
        if (pu < p1) {
          float f[N];
          unpack16<T>(q[u], f);
          hits |= test(f, pu * N) << (u * N);
        }
      }
      while (hits) {
        const int b = __ffs(hits) - 1;
        hits &= hits - 1;
        slow((p + (int64_t)(b / N) * kThreads) * N + b % N);
      }
    }
    if (rank == split - 1)
      for (int64_t i = P * N + threadIdx.x; i < V; i += kThreads) {
        step();
        const float f[1] = {to_float(row[i])};
        if (test(f, i)) slow(i);
      }
  } else {
    const int64_t per = (V + split - 1) / split, e0 = rank * per, e1 = e0 + per < V ? e0 + per : V;
    for (int64_t i = e0 + threadIdx.x; i < e1; i += kThreads) {
      step();
      const float f[1] = {to_float(row[i])};
      if (test(f, i)) slow(i);
    }
  }
}

// ---- the buffered passes ------------------------------------------------------------------------

// The row as the buffered passes read it: 16-byte loads when aligned.
template <class T>
struct RowRef {
  const T* row;
  int64_t n;
  bool vec_ok;
};

// One thread's kVec elements of a step, as loaded (converted when used, so loads stay in flight).
template <class T>
struct StepRaw {
  static constexpr int Q = (kVec * (int)sizeof(T) + 15) / 16;
  uint4 q[Q];
};

template <class T>
__device__ __forceinline__ void load_step(const RowRef<T>& rr, int64_t i0, StepRaw<T>& r) {
  if (rr.vec_ok && i0 + kVec <= rr.n) {
#pragma unroll
    for (int q = 0; q < StepRaw<T>::Q; ++q) r.q[q] = __ldg(reinterpret_cast<const uint4*>(rr.row + i0) + q);
  } else if (i0 < rr.n) {
    T* e = reinterpret_cast<T*>(r.q);
#pragma unroll
    for (int j = 0; j < kVec; ++j) e[j] = i0 + j < rr.n ? rr.row[i0 + j] : rr.row[i0];
  }
}

template <class T>
__device__ __forceinline__ void unpack_step(const StepRaw<T>& r, float (&v)[kVec]) {
  const T* e = reinterpret_cast<const T*>(r.q);
#pragma unroll
  for (int j = 0; j < kVec; ++j) v[j] = to_float(e[j]);
}

// body(v, i0) for every step of kChunk elements: v the thread's kVec raw values of elements
// i0 .. i0 + kVec - 1 (those >= n are padding). All threads run every step (body may synchronise);
// body returns false (uniformly) to stop. Two steps of loads stay in flight.
template <class T, class Body>
__device__ __forceinline__ void stream_row(const RowRef<T>& rr, Body&& body) {
  StepRaw<T> r0, r1, r2;
  int64_t i0 = (int64_t)threadIdx.x * kVec;
  load_step(rr, i0, r0);
  load_step(rr, i0 + kChunk, r1);
  for (int64_t b = 0; b < rr.n; b += kChunk) {
    load_step(rr, i0 + 2 * kChunk, r2);
    float v[kVec];
    unpack_step(r0, v);
    if (!body(v, i0)) return;
    i0 += kChunk;
    r0 = r1;
    r1 = r2;
  }
}

// f(raw, index, valid) for every element of the row; every thread makes the same number of calls
// (so f may use warp collectives).
template <class T, class F>
__device__ __forceinline__ void visit_row(const RowRef<T>& rr, F&& f) {
  stream_row(rr, [&](const float (&v)[kVec], int64_t i0) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) f(v[j], i0 + j, i0 + j < rr.n);
    return true;
  });
}

// f(x, index, valid) over the candidate buffer (warp-uniform like visit_row).
template <class F>
__device__ __forceinline__ void visit_buf(const Smem& s, int cap, F&& f) {
  const int n = min(s.n, cap);
  for (int j0 = 0; j0 < n; j0 += kThreads) {
    const int j = j0 + (int)threadIdx.x;
    const bool v = j < n;
    f(v ? s.bx[j] : 0.f, (int64_t)(v ? s.bi[j] : 0), v);
  }
}

// Appends (x, i) for the lanes with take (all 32 lanes must call); past cap only counts.
__device__ __forceinline__ void append(Smem& s, bool take, float x, int64_t i, int cap) {
  const unsigned mask = __ballot_sync(0xffffffffu, take);
  if (mask == 0) return;
  const int lane = threadIdx.x & 31, leader = __ffs(mask) - 1;
  int base = 0;
  if (lane == leader) base = atomicAdd(&s.n, __popc(mask));
  base = __shfl_sync(0xffffffffu, base, leader);
  if (take) {
    const int pos = base + __popc(mask & ((1u << lane) - 1u));
    if (pos < cap) {
      s.bx[pos] = x;
      s.bi[pos] = (int32_t)i;
    }
  }
}

// Keeps the buffer's elements with keep(x), in place, one block of kThreads elements at a time: a
// block's survivors land below its end, and the block was read before anything is written.
template <class P>
__device__ void compact_if(Smem& s, int cap, P&& keep) {
  const int n = min(s.n, cap);
  __syncthreads();  // every thread has read s.n
  if (threadIdx.x == 0) s.n = 0;
  __syncthreads();
  for (int j0 = 0; j0 < n; j0 += kThreads) {
    const int j = j0 + (int)threadIdx.x;
    float x = 0.f;
    int32_t i = 0;
    bool take = false;
    if (j < n) {
      x = s.bx[j];
      i = s.bi[j];
      take = keep(x);
    }
    __syncthreads();
    append(s, take, x, i, cap);
    __syncthreads();
  }
}

// The largest bin d of hist[0, nb) with above + sum(hist[d..]) >= target; writes s.sel_digit and
// s.sel_above = above + sum(hist[d+1..]). Each thread owns nb / kThreads consecutive bins.
__device__ __forceinline__ void scan_bins(Smem& s, int nb, u64 above, u64 target) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int per = nb / kThreads, lo = (int)threadIdx.x * per;
  if (threadIdx.x == 0) s.sel_digit = 0, s.sel_above = above;
  __syncthreads();  // hist complete; red64 free
  u64 mine = 0;
  for (int j = 0; j < per; ++j) mine += s.hist[lo + j];
  u64 incl = mine;  // suffix sum over this warp's lanes >= lane
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const u64 w = __shfl_down_sync(0xffffffffu, incl, o);
    if (lane + o < 32) incl += w;
  }
  if (lane == 0) s.red64[warp] = incl;
  __syncthreads();
  u64 base = above + (incl - mine);
  for (int w = warp + 1; w < kWarps; ++w) base += s.red64[w];
  if (base < target && base + mine >= target) {
    u64 acc = base;
    for (int j = per - 1; j >= 0; --j) {
      const u64 h = s.hist[lo + j];
      if (acc + h >= target) {
        s.sel_digit = (uint32_t)(lo + j);
        s.sel_above = acc;
        break;
      }
      acc += h;
    }
  }
  __syncthreads();
}

// What a radix selection looks at. Count mode (top-k): every finite x, key order_key(x), weight 1,
// target k. Mass mode (top-p): the tokens with order_key(x) >= tau_key and (min_p <= 0 or e >=
// min_p), e = expf(x - m), key float_bits(e), weight mass(e), target ceil(top_p * their mass), or
// ceil(top_p * total) when total (the mass of the whole selection, which the buffer may hold only
// the top of) is given; tokens with e < bound are left out of the histograms (bound <= the answer).
struct SelectArgs {
  int k = 0;
  float temp = 1.f;  // x = scaled_logit(raw, temp); 0: x = raw (-0 as +0)
  float m = 0.f;
  uint32_t tau_key = 0;
  float min_p = 0.f;
  float bound = 0.f;
  float top_p = 1.f;
  u64 total = 0;
};

// -0 becomes +0 either way, so order_key agrees with float comparisons (and with rank_key's ties).
__device__ __forceinline__ float to_x(float raw, float temp) {
  return temp > 0.f ? scaled_logit(raw, temp) : (raw == 0.f ? 0.f : raw);
}

// The largest key v whose elements with key >= v weigh at least the target; 0 when all of them
// together weigh less (count mode: fewer than k finite tokens, all kept; with a.total: the
// buffer's selection weighs less than the target, *found = false). Three levels of 11, 11 and 10
// bits; each level is one pass over the source. A pass over the row (in_buf false) also collects
// the elements the next levels look at into the buffer; once they fit, the remaining levels run on
// the buffer. complete is set when the buffer then holds every element of the selection (the first
// level's collection fit).
template <bool kMass, class T>
__device__ uint32_t radix_select(Smem& s, const RowRef<T>& rr, int cap, bool& in_buf, bool& complete,
                                 const SelectArgs& a, bool* found = nullptr) {
  uint32_t prefix = 0;
  u64 above = 0, target = 0;
  if (found) *found = true;
  for (int lvl = 0; lvl < 3; ++lvl) {
    const int sh = lvl == 0 ? 21 : (lvl == 1 ? 10 : 0);
    const int bits = lvl == 2 ? 10 : 11, nb = 1 << bits, up = sh + bits;
    for (int j = threadIdx.x; j < kBins; j += kThreads) s.hist[j] = 0;
    const bool collect = !in_buf;
    __syncthreads();  // the previous reader of s.n (visit_buf) is done
    if (collect && threadIdx.x == 0) s.n = 0;
    __syncthreads();
    u64 tot = 0;
    auto f = [&](float x, int64_t i, bool valid) {
      bool in = false, in_tot = false;
      uint32_t key = 0;
      u64 w = 1;
      if (valid && x > -INFINITY) {
        if constexpr (kMass) {
          const float e = expf(x - a.m);
          in_tot = order_key(x) >= a.tau_key && (a.min_p <= 0.f || e >= a.min_p);
          in = in_tot && e >= a.bound;
          key = float_bits(e);
          w = mass(e);
        } else {
          in_tot = in = true;
          key = order_key(x);
        }
        if (lvl > 0) in = in && (key >> up) == prefix;
      }
      if (lvl == 0 && in_tot) tot += w;
      if (in) atomicAdd(&s.hist[(key >> sh) & (uint32_t)(nb - 1)], w);
      if (collect) append(s, in, x, i, cap);
    };
    if (in_buf)
      visit_buf(s, cap, f);
    else
      visit_row(rr, [&](float raw, int64_t i, bool valid) { f(to_x(raw, a.temp), i, valid); });
    __syncthreads();
    if (lvl == 0) {
      const u64 total = block_sum_u64(tot, s.red64);
      if (kMass && a.total) {
        target = top_p_target(a.top_p, a.total);
        if (total < target) {
          if (found) *found = false;
          return 0;
        }
      } else {
        target = kMass ? top_p_target(a.top_p, total) : (u64)a.k;
        if (total == 0 || total < target) return 0;
      }
    }
    if (collect && s.n <= cap) {
      in_buf = true;
      if (lvl == 0) complete = true;
    }
    scan_bins(s, nb, above, target);
    prefix = (prefix << bits) | s.sel_digit;
    above = s.sel_above;
  }
  return prefix;
}

// Keeps the buffer's elements with key >= the k-th largest key (all when fewer than k) and raises
// the append threshold s.thr to it.
template <class T>
__device__ void compact_topk(Smem& s, const RowRef<T>& rr, int cap, int k) {
  bool in_buf = true, complete = true;
  SelectArgs a;
  a.k = k;
  const uint32_t tk = radix_select<false>(s, rr, cap, in_buf, complete, a);
  if (tk == 0) return;
  compact_if(s, cap, [&](float x) { return order_key(x) >= tk; });
  if (threadIdx.x == 0) s.thr = tk;
  __syncthreads();
}

// One pass over the row collecting into the buffer every token that can be among the k largest x
// (ties included): pol(raw, thr_x) returns the token's x (exact, never NaN) or -inf to leave it out;
// it is appended when x >= the current threshold thr_x. When the buffer fills up it is compacted to
// the k largest of what it holds, which raises the threshold: the k-th largest of a subset is at
// most the row's, so no token of the top k is ever left out, and the buffer ends as exactly the
// tokens with order_key(x) >= s.thr (0: every token pol returned). False when the buffer
// overflowed: then, with finish, the pass still runs to the end for pol's side effects; else it
// stops. Indices are stored plus base (rr may be a slice of the row).
template <class T, class Pol>
__device__ bool stream_collect(Smem& s, const RowRef<T>& rr, int cap, int k, bool finish, Pol&& pol,
                               int64_t base = 0) {
  if (threadIdx.x == 0) s.n = 0, s.thr = 0;
  __syncthreads();
  bool ok = true;
  stream_row(rr, [&](const float (&v)[kVec], int64_t i0) {
    const uint32_t thr = s.thr;  // changed only by compact_topk, between barriers
    const float thr_x = thr ? key_value(thr) : -INFINITY;
    float xs[kVec];
    bool any = false;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      xs[j] = i0 + j < rr.n ? pol(v[j], thr_x) : -INFINITY;
      any |= xs[j] > -INFINITY && xs[j] >= thr_x;
    }
    if (ok && __any_sync(0xffffffffu, any)) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) append(s, xs[j] > -INFINITY && xs[j] >= thr_x, xs[j], base + i0 + j, cap);
    }
    __syncthreads();
    const int n = s.n;
    __syncthreads();  // every thread has read s.n before anyone changes it
    if (ok && (n > cap - kChunk || (n >= kChunk / 2 && n >= 2 * k))) {
      compact_topk(s, rr, cap, k);
      if (s.n > cap - kChunk) ok = false;  // the next step might not fit
      __syncthreads();
    }
    return ok || finish;
  });
  return ok;
}

}  // namespace tallow::cuda::sampling_dev
