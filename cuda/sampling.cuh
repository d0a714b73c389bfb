// Device building blocks of the sampling kernels (sampling.cu): one CTA per row, a candidate buffer
// in shared memory, radix selection over order-preserving keys, warp-aggregated appends.
#pragma once
#include "common.cuh"
#include "ops/sampling.h"
#include "topk.cuh"

namespace tallow::cuda::sampling_dev {

using namespace tallow::sampling;
using u64 = unsigned long long;

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kVec = 8;                   // elements per thread per step (one or two 16-byte loads)
constexpr int kChunk = kThreads * kVec;   // elements per CTA step
constexpr int kCap = 8192;                // candidate buffer (x, index): 64 KiB
constexpr int kBins = 2048;               // radix digits of 11, 11 and 10 bits
constexpr int kStreamMaxK = 1024;         // top-k by streaming collection up to this k
constexpr int kStreamMinCap = kChunk + 2 * kStreamMaxK;

struct Smem {
  float bx[kCap];
  int32_t bi[kCap];
  u64 hist[kBins];
  u64 red64[32];
  float redf[32];
  int n;              // appended so far (more than the capacity: overflow, the extra ones dropped)
  uint32_t thr;       // streaming top-k: keys below this are not appended
  uint32_t sel_digit;
  u64 sel_above;
};

// The row as the kernels read it: raw logits (scaled by the caller), 16-byte loads when aligned.
template <class T>
struct RowRef {
  const T* row;
  int64_t n;
  bool vec_ok;
};

template <class T>
__device__ __forceinline__ void load8(const RowRef<T>& rr, int64_t i0, float (&v)[kVec]) {
  if (rr.vec_ok && i0 + kVec <= rr.n) {
    if constexpr (sizeof(T) == 4) {
      const float4 a = __ldg(reinterpret_cast<const float4*>(rr.row + i0));
      const float4 b = __ldg(reinterpret_cast<const float4*>(rr.row + i0 + 4));
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else {
      static_assert(Vec16<T>::N == kVec, "16-bit storage expected");
      const Vec16<T> p = load16(rr.row + i0);
#pragma unroll
      for (int j = 0; j < kVec; ++j) v[j] = to_float(p.v[j]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) v[j] = i0 + j < rr.n ? to_float(rr.row[i0 + j]) : 0.f;
  }
}

// f(raw, index, valid) for every element of the row; every thread makes the same number of calls
// (so f may use warp collectives). The next step's loads are issued before f runs on this one.
template <class T, class F>
__device__ __forceinline__ void visit_row(const RowRef<T>& rr, F&& f) {
  float cur[kVec], nxt[kVec];
  int64_t i0 = (int64_t)threadIdx.x * kVec;
  load8(rr, i0, cur);
  for (int64_t b = 0; b < rr.n; b += kChunk) {
    const bool more = b + kChunk < rr.n;
    if (more) load8(rr, i0 + kChunk, nxt);
#pragma unroll
    for (int j = 0; j < kVec; ++j) f(cur[j], i0 + j, i0 + j < rr.n);
    i0 += kChunk;
    if (more) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) cur[j] = nxt[j];
    }
  }
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
// min_p), e = expf(x - m), key float_bits(e), weight mass(e), target ceil(top_p * their mass);
// tokens with e < bound are left out of the histograms (bound <= the answer, see sampling.cu).
struct SelectArgs {
  int k = 0;
  float temp = 1.f;  // x = scaled_logit(raw, temp); 0: x = raw (-0 as +0)
  float m = 0.f;
  uint32_t tau_key = 0;
  float min_p = 0.f;
  float bound = 0.f;
  float top_p = 1.f;
};

// -0 becomes +0 either way, so order_key agrees with float comparisons (and with rank_key's ties).
__device__ __forceinline__ float to_x(float raw, float temp) {
  return temp > 0.f ? scaled_logit(raw, temp) : (raw == 0.f ? 0.f : raw);
}

// The largest key v whose elements with key >= v weigh at least the target; 0 when all of them
// together weigh less (count mode: fewer than k finite tokens, all kept). Three levels of 11, 11
// and 10 bits; each level is one pass over the source. A pass over the row (in_buf false) also
// collects the elements the next levels look at into the buffer; once they fit, the remaining
// levels run on the buffer. complete is set when the buffer then holds every element of the
// selection (the first level's collection fit).
template <bool kMass, class T>
__device__ uint32_t radix_select(Smem& s, const RowRef<T>& rr, int cap, bool& in_buf, bool& complete,
                                 const SelectArgs& a) {
  uint32_t prefix = 0;
  u64 above = 0, target = 0;
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
      target = kMass ? top_p_target(a.top_p, total) : (u64)a.k;
      if (total == 0 || total < target) return 0;
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

}  // namespace tallow::cuda::sampling_dev
