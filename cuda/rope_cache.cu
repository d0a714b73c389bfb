// rope_and_cache on CUDA (contract in cpp/ops/rope_cache.h): per-head q/k RMSNorm, rotary embedding
// in place and the K/V cache write of every token in ONE launch, replacing up to five (rms_norm on q,
// rms_norm on k, rotary_embedding, reshape_and_cache's K and V kernels).
//
// Two kernels, the same arithmetic. The warp kernel (below rope_cache_kernel; the default where
// rows are one 16-byte pack a lane and no pack straddles the rotary part's edges) gives each warp
// rows of one token and exchanges NeoX partners by shuffles. The block kernel takes every other
// layout (and all of them with TALLOW_ROPE_WARP=0):
// A block takes a token (grid-stride); its rows are the token's Hq q heads, Hk k heads and Hk v
// heads, one row per group of G lanes (G = the power of two >= the row's 16-byte packs, at most 32),
// every row of the token in flight at once for decode-sized blocks. A lane loads its packs of the
// row (pack p = lane + i * G), the group reduces the sum of squares with xor shuffles, the lane
// normalises its packs, rounds them to q's dtype and stages them in shared memory, and after a
// sync rotates its elements reading the partners of its pairs from the staged row (and cos/sin from
// the token's cos_sin_cache row, loaded with the first rows and staged too). q/k rows
// are written back in place; k and v rows go to the cache slot (converted, fp8: e4m3(x / scale)).
//
// Bit-exactness with the composition (CUDA rms_norm, rotary_embedding, reshape_and_cache):
// - norm: rms_norm's register kernel with 32 threads (rows of <= 32 packs: f16/bf16 D <= 256, f32
//   D <= 128) sums x*x per lane with FMAs in pack order, then a 32-lane xor butterfly; the group
//   butterfly here adds the same partial sums in the same order (the lanes past the row's packs only
//   add exact zeros there), and 1/sqrt(ss / D + eps) and x * inv * (w + w_add) are the same IEEE
//   operations. Longer rows: rms_norm splits the sum over more threads (a few f32 ulps in 1/rms).
// - rotation: a*c - b*s and b*c + a*s are contracted into FMAs by the compiler; rotary_embedding's
//   kernels (nvcc 13, sm_90) compute a' = fma(a, c, -(b*s)) always, and b' = fma(b, c, a*s) in their
//   vectorised variants (and f32 interleaved) but fma(a, s, b*c) in the scalar ones. Both are pinned
//   here with intrinsics and chosen the way rotary_embedding chooses its variant. Another compiler
//   may contract rope.cu differently: then a rotated element differs by at most one rounding of one
//   product (<= 1 ulp of the dtype where the result does not cancel).
// - cache: the same conversion of the same rounded value.
//
// Positions and slots are checked on the device and read back before the launch (IndexError /
// ValueError as on the CPU) unless the stream is capturing or index checks are off; unchecked
// out-of-range positions leave a row unrotated (still normed and cached, as the composition does)
// and out-of-range slots are skipped. Under capture on sm_90+ the kernel is launched with PDL
// (pdl.cuh): it reads its first token's position and cos/sin row before waiting for the previous
// kernel (the position is checked again after the wait), then lets its dependents launch.
#include <array>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "core/tuning.h"
#include "launch.cuh"
#include "pdl.cuh"
#include "norm.cuh"
#include "ops_cuda.h"
#include "paged_attention.cuh"

namespace tallow::cuda {

namespace {

constexpr int kMaxPacks = 4;     // 16-byte packs per lane: D <= 4 * 32 * 16 / sizeof(T)
constexpr int kCsPerThread = 4;  // cos/sin values a thread stages: blockDim.x >= rot / 4

struct RopeCacheArgs {
  void* q;
  void* k;
  const void* v;
  int64_t qst, qsh, kst, ksh, vst, vsh;  // element strides of token and head
  const void* qw;                        // norm weights [D] (contiguous); null: no norm
  const void* kw;
  float eps, w_add;
  IndexArg pos;
  const float* cs;  // cos_sin_cache [max_pos, rot]
  int64_t cs_stride, max_pos;
  int half, rot;
  bool neox, b_first;  // b_first: b' = fma(b, c, a*s), else fma(a, s, b*c)
  bool packed;         // rotate whole packs (rotate_pack) where they lie inside the rotary part
  void* kc;
  void* vc;
  CacheArg kca, vca;
  IndexArg slots;
  int64_t bs, nslots;
  float k_scale, v_scale;
  int64_t T;
  int Hq, Hk, D, nv, G, np;
};

// V elements of a cache dtype, stored with the widest aligned access up to 16 bytes.
template <class C, int V>
struct alignas(V * sizeof(C) > 16 ? 16 : V * sizeof(C)) CachePack {
  C v[V];
};

template <class T>
__device__ __forceinline__ float staged(const T* row, int e) {
  return to_float(row[e]);
}

// Element e of a row (value x, already rounded to T) after the rotation; partners from the staged
// `row`, cos/sin from the token's staged cos_sin_cache row `cs`.
template <class T>
__device__ __forceinline__ T rotate(const RopeCacheArgs& a, const T* row, int e, T xt, const float* cs) {
  if (e >= a.rot) return xt;  // partial rotary: untouched
  const float x = to_float(xt);
  int i;
  float pa, pb;  // the pair (a, b); x is a (first) or b (second)
  bool first;
  if (a.neox) {
    first = e < a.half;
    i = first ? e : e - a.half;
    pa = first ? x : staged(row, i);
    pb = first ? staged(row, e + a.half) : x;
  } else {
    first = (e & 1) == 0;
    i = e >> 1;
    pa = first ? x : staged(row, e - 1);
    pb = first ? staged(row, e + 1) : x;
  }
  const float c = cs[i], s = cs[a.half + i];
  if (first) return from_float<T>(__fmaf_rn(pa, c, -__fmul_rn(pb, s)));
  return from_float<T>(a.b_first ? __fmaf_rn(pb, c, __fmul_rn(pa, s)) : __fmaf_rn(pa, s, __fmul_rn(pb, c)));
}

// rotate() for a whole pack: elements e0 .. e0 + V - 1, all in the rotary part and (neox) on one side
// of `half`. The same operations per element, without rotate()'s per-element index arithmetic and
// branches (the kernel is instruction-bound at prefill sizes).
template <class T, int V>
__device__ __forceinline__ void rotate_pack(const RopeCacheArgs& a, const T* row, int e0, Pack<T, V>& y,
                                            const float* cs) {
  if (a.neox) {
    const bool first = e0 < a.half;
    const int i0 = first ? e0 : e0 - a.half, partner = first ? e0 + a.half : i0;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float x = to_float(y.v[j]), other = staged(row, partner + j);
      const float c = cs[i0 + j], s = cs[a.half + i0 + j];
      if (first) {
        y.v[j] = from_float<T>(__fmaf_rn(x, c, -__fmul_rn(other, s)));
      } else {  // (pa, pb) = (other, x)
        y.v[j] = from_float<T>(a.b_first ? __fmaf_rn(x, c, __fmul_rn(other, s)) : __fmaf_rn(other, s, __fmul_rn(x, c)));
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < V; j += 2) {
      const float pa = to_float(y.v[j]), pb = to_float(y.v[j + 1]);
      const int i = (e0 + j) >> 1;
      const float c = cs[i], s = cs[a.half + i];
      y.v[j] = from_float<T>(__fmaf_rn(pa, c, -__fmul_rn(pb, s)));
      y.v[j + 1] = from_float<T>(a.b_first ? __fmaf_rn(pb, c, __fmul_rn(pa, s)) : __fmaf_rn(pa, s, __fmul_rn(pb, c)));
    }
  }
}

// NP: packs per lane held in registers (1: rows of <= 32 packs, the common case; else kMaxPacks).
template <class T, class C, int NP>
__global__ void __launch_bounds__(NP == 1 ? 1024 : 512) rope_cache_kernel(const RopeCacheArgs a) {
  constexpr int V = 16 / sizeof(T);
  using P = Pack<T, V>;
  using CP = CachePack<C, V>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // Speculation (PDL): the block's first token's position and cos/sin values are read before waiting
  // for the previous kernel (they are host uploads and a constant table on the decode path, not that
  // kernel's outputs), and the position is read again after the wait, in flight with the rows: on a
  // difference the cos/sin values are loaded again. Dependents launch after the wait (before it, their
  // CTAs would take SMs the previous kernel may still need).
  const int64_t t_spec = blockIdx.x;
  int64_t ps_spec = -1;
  float cv_spec[kCsPerThread];
  if (t_spec < a.T) {
    ps_spec = a.pos(t_spec);
#pragma unroll
    for (int j = 0; j < kCsPerThread; ++j) {
      const int c = threadIdx.x + j * blockDim.x;
      if (ps_spec >= 0 && ps_spec < a.max_pos && c < a.rot) cv_spec[j] = __ldg(a.cs + ps_spec * a.cs_stride + c);
    }
  }
  pdl_wait();  // before reading q/k/v or slots, and before the first write
  pdl_launch_dependents();
  const int G = a.G, lane = threadIdx.x & (G - 1), grp = threadIdx.x / G, ngrp = blockDim.x / G;
  T* stage = reinterpret_cast<T*>(smem_raw) + (size_t)grp * G * a.np * V;
  float* cs_s = reinterpret_cast<float*>(smem_raw + (size_t)blockDim.x * a.np * 16);  // the token's cos/sin row
  const int rot_rows = a.Hq + a.Hk, rows = rot_rows + a.Hk;
  const bool norm = a.qw != nullptr;
  for (int64_t t = blockIdx.x; t < a.T; t += gridDim.x) {
    const int64_t ps = a.pos(t);
    const bool rope_ok = ps >= 0 && ps < a.max_pos;
    // The cos/sin row (blockDim.x * kCsPerThread >= rot): loaded now, in flight with the first rows'
    // loads, staged in shared memory before the first rotation.
    float cv[kCsPerThread];
    const bool spec_ok = t == t_spec && ps == ps_spec;
#pragma unroll
    for (int j = 0; j < kCsPerThread; ++j) {
      const int c = threadIdx.x + j * blockDim.x;
      if (rope_ok && c < a.rot) cv[j] = spec_ok ? cv_spec[j] : __ldg(a.cs + ps * a.cs_stride + c);
    }
    const int64_t slot = a.slots(t);
    const bool store = slot >= 0 && slot < a.nslots;
    const int64_t blk = store ? slot / a.bs : 0, brow = store ? slot % a.bs : 0;
    // Uniform over the block: every lane reaches every __syncwarp and shuffle.
    for (int r0 = 0; r0 < rows; r0 += ngrp) {
      const int r = r0 + grp;
      const bool active = r < rows, is_q = r < a.Hq, is_v = r >= rot_rows;
      const int h = is_q ? r : is_v ? r - rot_rows : r - a.Hq;
      T* row = nullptr;
      if (active)
        row = is_q ? static_cast<T*>(a.q) + t * a.qst + h * a.qsh
                   : is_v ? const_cast<T*>(static_cast<const T*>(a.v)) + t * a.vst + h * a.vsh
                          : static_cast<T*>(a.k) + t * a.kst + h * a.ksh;
      P x[NP];
#pragma unroll
      for (int i = 0; i < NP; ++i) {
        const int p = lane + i * G;
        if (active && i < a.np && p < a.nv) x[i] = *reinterpret_cast<const P*>(row + (int64_t)p * V);
      }
      if (norm) {
        const T* w = static_cast<const T*>(is_q ? a.qw : a.kw);
        P wp[NP];
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < NP; ++i) {
          const int p = lane + i * G;
          if (active && !is_v && i < a.np && p < a.nv) {
            wp[i] = *reinterpret_cast<const P*>(w + (int64_t)p * V);
#pragma unroll
            for (int j = 0; j < V; ++j) {
              const float f = to_float(x[i].v[j]);
              acc = __fmaf_rn(f, f, acc);
            }
          }
        }
        for (int o = G >> 1; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        const float inv = 1.0f / sqrtf(acc / (float)a.D + a.eps);
#pragma unroll
        for (int i = 0; i < NP; ++i) {
          const int p = lane + i * G;
          if (active && !is_v && i < a.np && p < a.nv) {
#pragma unroll
            for (int j = 0; j < V; ++j)
              x[i].v[j] = from_float<T>(
                  __fmul_rn(__fmul_rn(to_float(x[i].v[j]), inv), __fadd_rn(to_float(wp[i].v[j]), a.w_add)));
          }
        }
      }
      if (active && !is_v) {
#pragma unroll
        for (int i = 0; i < NP; ++i) {
          const int p = lane + i * G;
          if (i < a.np && p < a.nv) *reinterpret_cast<P*>(stage + p * V) = x[i];
        }
      }
      if (r0 == 0) {  // uniform: the first rows of the token
#pragma unroll
        for (int j = 0; j < kCsPerThread; ++j) {
          const int c = threadIdx.x + j * blockDim.x;
          if (rope_ok && c < a.rot) cs_s[c] = cv[j];
        }
        __syncthreads();  // also orders the stage for the warp
      } else {
        __syncwarp();
      }
      if (active) {
        C* dst = nullptr;
        float scale = 1.f;
        if (store && !is_q) {
          const CacheArg& ca = is_v ? a.vca : a.kca;
          dst = static_cast<C*>(is_v ? a.vc : a.kc) + blk * ca.sb + brow * ca.sr + h * ca.sh;
          scale = is_v ? a.v_scale : a.k_scale;
        }
#pragma unroll
        for (int i = 0; i < NP; ++i) {
          const int p = lane + i * G;
          if (i >= a.np || p >= a.nv) continue;
          P y = x[i];
          if (!is_v) {
            const int e0 = p * V;
            if (rope_ok && a.packed && e0 + V <= a.rot) {
              rotate_pack<T, V>(a, stage, e0, y, cs_s);
            } else if (rope_ok) {
#pragma unroll
              for (int j = 0; j < V; ++j) y.v[j] = rotate<T>(a, stage, e0 + j, x[i].v[j], cs_s);
            }
            *reinterpret_cast<P*>(row + (int64_t)p * V) = y;
          }
          if (dst) {
            CP out;
#pragma unroll
            for (int j = 0; j < V; ++j) out.v[j] = cache_value<C>(y.v[j], scale);
            *reinterpret_cast<CP*>(dst + (int64_t)p * V) = out;
          }
        }
      }
      __syncwarp();  // the stage is rewritten by the next row
    }
    __syncthreads();  // cs_s is rewritten by the next token
  }
}

// The warp kernel: rows of one 16-byte pack a lane (np == 1), every pack wholly inside or outside
// the rotary part, 16-byte-aligned cos/sin rows. Each warp takes 32 / G rows of one token, with no
// shared memory and no block barrier, so a warp waiting on its loads holds up no other (at prefill
// sizes the block kernel's phases, all loads then all stores behind a barrier, left the memory
// system idle between them). A NeoX pair's partner pack lies half / V lanes away in the same group:
// it comes by shuffles instead of through shared memory. Each lane loads the cos/sin values of its
// own pack (L1/L2 hits after the token's first warp). The arithmetic is rotate_pack's, so the
// results are the block kernel's, bit for bit. PDL as there: the first token's position and cos/sin
// values are read before the wait and checked after it.
constexpr int kWarpKernelThreads = 256;

// N floats from p into v: 16-byte loads where N % 4 == 0 (p 16-byte aligned), else 8-byte ones.
template <int N>
__device__ __forceinline__ void load_floats(const float* p, float* v) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const float4 f = __ldg(reinterpret_cast<const float4*>(p + i));
      v[i] = f.x, v[i + 1] = f.y, v[i + 2] = f.z, v[i + 3] = f.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; i += 2) {
      const float2 f = __ldg(reinterpret_cast<const float2*>(p + i));
      v[i] = f.x, v[i + 1] = f.y;
    }
  }
}

// R: rows a lane takes of its token (every R-th warp row slot); their loads are all in flight before
// the first is used, and they share the token's position, slot and cos/sin values.
// Register bounds per R: one row a lane fits four CTAs an SM (a decode step's rows in one wave).
template <class T, class C, bool NEOX, int R>
__global__ void __launch_bounds__(kWarpKernelThreads, R == 1 ? 4 : R == 2 ? 3 : 2)
    rope_cache_warp_kernel(const RopeCacheArgs a) {
  constexpr int V = 16 / sizeof(T);
  constexpr int N = NEOX ? V : V / 2;  // cos (and sin) values of a pack
  using P = Pack<T, V>;
  using CP = CachePack<C, V>;
  const int G = a.G, lane = threadIdx.x & 31, sub = lane & (G - 1), rpw = 32 / G;
  const int rows = a.Hq + 2 * a.Hk, rot_rows = a.Hq + a.Hk, wpt = (rows + rpw * R - 1) / (rpw * R);
  const int64_t units = a.T * wpt, wstride = (int64_t)gridDim.x * (blockDim.x / 32);
  const int e0 = sub * V;
  const bool in_row = sub < a.nv, rot_pack = in_row && e0 < a.rot;
  const bool first = NEOX ? e0 < a.half : true;
  const int i0 = NEOX ? (first ? e0 : e0 - a.half) : e0 / 2;  // the pack's first cos/sin index
  const int d = NEOX ? a.half / V : 0;                          // lanes to the partner pack
  const int src = rot_pack && NEOX ? (first ? lane + d : lane - d) : lane;
  float c[N], sn[N];
  auto load_cs = [&](int64_t ps) {
    const float* row = a.cs + ps * a.cs_stride;
    load_floats<N>(row + i0, c);
    load_floats<N>(row + a.half + i0, sn);
  };
  int64_t u = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  int64_t ps_spec = -1;
  if (u < units) {
    ps_spec = a.pos(u / wpt);
    if (rot_pack && ps_spec >= 0 && ps_spec < a.max_pos) load_cs(ps_spec);
  }
  pdl_wait();  // before reading q/k/v or slots, and before the first write
  pdl_launch_dependents();
  const bool norm = a.qw != nullptr;
  for (bool spec = true; u < units; u += wstride, spec = false) {
    const int64_t t = u / wpt;
    const int64_t ps = a.pos(t);
    const bool rope_ok = ps >= 0 && ps < a.max_pos;
    if (rot_pack && rope_ok && !(spec && ps == ps_spec)) load_cs(ps);
    const int64_t slot = a.slots(t);
    const bool store = slot >= 0 && slot < a.nslots;
    T* row[R];
    P x[R];
    int h[R];
    bool active[R], is_q[R], is_v[R];
#pragma unroll
    for (int k = 0; k < R; ++k) {  // every row's load in flight first
      const int r = ((int)(u % wpt) * R + k) * rpw + lane / G;
      active[k] = r < rows && in_row, is_q[k] = r < a.Hq, is_v[k] = r >= rot_rows;
      h[k] = is_q[k] ? r : is_v[k] ? r - rot_rows : r - a.Hq;
      row[k] = is_q[k] ? static_cast<T*>(a.q) + t * a.qst + h[k] * a.qsh
                       : is_v[k] ? const_cast<T*>(static_cast<const T*>(a.v)) + t * a.vst + h[k] * a.vsh
                                 : static_cast<T*>(a.k) + t * a.kst + h[k] * a.ksh;
      x[k] = P{};  // defined also where shuffled from a lane with no pack
      if (active[k]) x[k] = *reinterpret_cast<const P*>(row[k] + e0);
    }
#pragma unroll
    for (int k = 0; k < R; ++k) {
      const bool qk = active[k] && !is_v[k];
      if (norm) {  // the block kernel's norm with NP = 1 (lanes past the row add exact zeros)
        P wp;
        float acc = 0.f;
        if (qk) {
          wp = *reinterpret_cast<const P*>(static_cast<const T*>(is_q[k] ? a.qw : a.kw) + e0);
#pragma unroll
          for (int j = 0; j < V; ++j) {
            const float f = to_float(x[k].v[j]);
            acc = __fmaf_rn(f, f, acc);
          }
        }
        for (int o = G >> 1; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        const float inv = 1.0f / sqrtf(acc / (float)a.D + a.eps);
        if (qk) {
#pragma unroll
          for (int j = 0; j < V; ++j)
            x[k].v[j] = from_float<T>(
                __fmul_rn(__fmul_rn(to_float(x[k].v[j]), inv), __fadd_rn(to_float(wp.v[j]), a.w_add)));
        }
      }
      P y = x[k];
      const bool rotate = qk && rot_pack && rope_ok;
      if constexpr (NEOX) {  // every lane shuffles (src = lane where nothing rotates)
        P other;
        const uint32_t* xw = reinterpret_cast<const uint32_t*>(&x[k]);
        uint32_t* ow = reinterpret_cast<uint32_t*>(&other);
#pragma unroll
        for (int w = 0; w < 4; ++w) ow[w] = __shfl_sync(0xffffffffu, xw[w], src);
        if (rotate) {
#pragma unroll
          for (int j = 0; j < V; ++j) {
            const float xv = to_float(x[k].v[j]), ov = to_float(other.v[j]);
            y.v[j] = first ? from_float<T>(__fmaf_rn(xv, c[j], -__fmul_rn(ov, sn[j])))
                           : from_float<T>(a.b_first ? __fmaf_rn(xv, c[j], __fmul_rn(ov, sn[j]))
                                                     : __fmaf_rn(ov, sn[j], __fmul_rn(xv, c[j])));
          }
        }
      } else if (rotate) {
#pragma unroll
        for (int j = 0; j < V; j += 2) {
          const float pa = to_float(x[k].v[j]), pb = to_float(x[k].v[j + 1]);
          const float cj = c[j / 2], sj = sn[j / 2];
          y.v[j] = from_float<T>(__fmaf_rn(pa, cj, -__fmul_rn(pb, sj)));
          y.v[j + 1] = from_float<T>(a.b_first ? __fmaf_rn(pb, cj, __fmul_rn(pa, sj)) : __fmaf_rn(pa, sj, __fmul_rn(pb, cj)));
        }
      }
      if (active[k]) {
        if (!is_v[k]) *reinterpret_cast<P*>(row[k] + e0) = y;
        if (store && !is_q[k]) {
          const CacheArg& ca = is_v[k] ? a.vca : a.kca;
          C* dst = static_cast<C*>(is_v[k] ? a.vc : a.kc) + (slot / a.bs) * ca.sb + (slot % a.bs) * ca.sr + h[k] * ca.sh;
          const float scale = is_v[k] ? a.v_scale : a.k_scale;
          CP out;
#pragma unroll
          for (int j = 0; j < V; ++j) out.v[j] = cache_value<C>(y.v[j], scale);
          *reinterpret_cast<CP*>(dst + e0) = out;
        }
      }
    }
  }
}

__global__ void check_indices_kernel(IndexArg pos, IndexArg slots, int64_t T, int64_t max_pos, int64_t nslots,
                                     int* flag) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < T; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t p = pos(i);
    if (p < 0 || p >= max_pos) atomicOr(flag, 1);
    if (slots(i) >= nslots) atomicOr(flag, 2);
  }
}

IndexArg index_arg(const Tensor& t) { return {t.data_ptr(), t.dtype() == DType::I32, t.stride(0), 0}; }

// Rows aligned to `align` bytes: the base and every stride but the last dim's (of dims of size > 1).
bool rows_aligned(const Tensor& t, size_t align) {
  if (!aligned_to(t.data_ptr(), align)) return false;
  for (int64_t d = 0; d + 1 < t.dim(); ++d)
    if (t.size(d) > 1 && (t.stride(d) * t.element_size()) % (int64_t)align != 0) return false;
  return true;
}

template <class F>
void dispatch_cache(const char* op, DType d, F&& f) {
  switch (d) {
    case DType::F32: return f(float{});
    case DType::F16: return f(__half{});
    case DType::BF16: return f(__nv_bfloat16{});
    case DType::F8E4M3: return f(F8E4M3{});
    default: throw TypeError(str_cat(op, ": unsupported cache dtype ", dtype_name(d), " on CUDA"));
  }
}

}  // namespace

bool rope_and_cache(const Tensor& positions, const Tensor& q, const Tensor& k, const Tensor& v,
                    const Tensor& cos_sin_cache, bool neox, const Tensor& k_cache, const Tensor& v_cache,
                    const Tensor& slot_mapping, const std::optional<Tensor>& q_norm_weight,
                    const std::optional<Tensor>& k_norm_weight, float norm_eps, bool gemma_norm, float k_scale,
                    float v_scale) {
  const char* op = "rope_and_cache";
  OpContext ctx(q);
  const int64_t T = positions.size(0), Hq = q.size(1), Hk = k.size(1), D = q.size(2);
  const int64_t max_pos = cos_sin_cache.size(0), rot = cos_sin_cache.size(1);
  const int64_t bs = k_cache.size(1), nslots = k_cache.size(0) * bs;
  const IndexArg pos = index_arg(positions), slots = index_arg(slot_mapping);
  if (T > 0 && index_checks() && !is_capturing(ctx.stream)) {
    DeviceFlag flag(q, ctx.stream);
    check_indices_kernel<<<grid_for(T, 256), 256, 0, ctx.stream>>>(pos, slots, T, max_pos, nslots, flag.ptr());
    TALLOW_CUDA_CHECK_LAUNCH(op);
    const int f = flag.read();
    TALLOW_CHECK_INDEX(!(f & 1), op, ": a position is out of range of cos_sin_cache of shape ",
                       shape_str(cos_sin_cache.shape()), " (valid positions are 0 .. ", max_pos - 1, ")");
    TALLOW_CHECK(!(f & 2), op, ": a slot in slot_mapping is out of range for k_cache", shape_str(k_cache.shape()),
                 " (", nslots, " slots; negative slots are skipped)");
  }
  if (T == 0 || Hq + 2 * Hk == 0) return true;

  // The layouts the kernel takes; anything else runs the composition (the caller).
  const int64_t V = 16 / q.element_size(), nv = D / V;
  const bool norm = q_norm_weight.has_value();
  if (v.dtype() != q.dtype() || k_cache.dtype() != v_cache.dtype() || v.size(2) != D || D % V != 0 || nv == 0)
    return false;
  int64_t G = 1;
  while (G < nv && G < 32) G *= 2;
  const int64_t np = ceil_div(nv, G);
  if (np > kMaxPacks || !rows_aligned(q, 16) || !rows_aligned(k, 16) || !rows_aligned(v, 16)) return false;
  const size_t calign = (size_t)std::min<int64_t>(16, V * k_cache.element_size());
  for (const Tensor* c : {&k_cache, &v_cache})
    if (!rows_aligned(*c, calign)) return false;
  Tensor qw, kw;
  if (norm) {
    auto prep = [](const Tensor& w) { return w.stride(0) == 1 && aligned_to(w.data_ptr(), 16) ? w : contiguous(w); };
    qw = prep(*q_norm_weight);
    kw = prep(*k_norm_weight);
    if (!aligned_to(qw.data_ptr(), 16) || !aligned_to(kw.data_ptr(), 16)) return false;
  }

  // Which FMA contraction rotary_embedding's kernel would use for b' (see the top of this file).
  const int64_t half = rot / 2, vr = 8 / q.element_size();
  const bool rope_vec = half % vr == 0 && cos_sin_cache.stride(0) % vr == 0 &&
                        aligned_to(cos_sin_cache.data_ptr(), (size_t)vr * sizeof(float));
  const bool b_first = rope_vec || (!neox && q.dtype() == DType::F32);

  RopeCacheArgs a{};
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.qst = q.stride(0), a.qsh = q.stride(1), a.kst = k.stride(0), a.ksh = k.stride(1);
  a.vst = v.stride(0), a.vsh = v.stride(1);
  a.qw = norm ? qw.data_ptr() : nullptr;
  a.kw = norm ? kw.data_ptr() : nullptr;
  a.eps = norm_eps;
  a.w_add = gemma_norm ? 1.f : 0.f;
  a.pos = pos;
  a.cs = cos_sin_cache.data<float>();
  a.cs_stride = cos_sin_cache.stride(0);
  a.max_pos = max_pos;
  a.half = (int)half;
  a.rot = (int)rot;
  a.neox = neox;
  a.b_first = b_first;
  // Whole-pack rotation needs every pack on one side of `half` (neox).
  a.packed = !neox || half % V == 0;
  a.kc = k_cache.data_ptr();
  a.vc = v_cache.data_ptr();
  a.kca = {k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)};
  a.vca = {v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)};
  a.slots = slots;
  a.bs = bs;
  a.nslots = nslots;
  a.k_scale = k_scale;
  a.v_scale = v_scale;
  a.T = T;
  a.Hq = (int)Hq, a.Hk = (int)Hk, a.D = (int)D, a.nv = (int)nv, a.G = (int)G, a.np = (int)np;
  TALLOW_CHECK(Hq + 2 * Hk < ((int64_t)1 << 30), op, ": too many heads: q", shape_str(q.shape()), " k",
               shape_str(k.shape()));

  // Every row of a token at once where it fits (decode is latency-bound). Shared memory: the staged
  // rows (threads * np * 16 bytes, <= 32 KiB) and the token's cos/sin row.
  const int64_t rows = Hq + 2 * Hk, max_threads = np == 1 ? 1024 : 512;
  const int64_t min_threads = std::max<int64_t>(32, (ceil_div(rot, kCsPerThread) + 31) / 32 * 32);
  const int threads = (int)std::min<int64_t>(max_threads, std::max<int64_t>(min_threads, (rows * G + 31) / 32 * 32));
  const size_t smem = (size_t)threads * np * 16 + (size_t)rot * sizeof(float);
  const unsigned blocks = (unsigned)std::min<int64_t>(T, (int64_t)1 << 20);
  // PDL under capture on sm_90+: the launch and the position -> cos/sin loads then overlap the qkv
  // projection's tail (H100, Llama-3-8B batch-1 decode: 167.7 -> 168.5 tok/s, cuda/README.md).
  const bool pdl = pdl_capable(ctx.stream);
  // The warp kernel where its layout holds (see above); KernelTuning::rope_warp off (tests, A/B runs)
  // keeps the block kernel.
  const KernelTuning& tune = kernel_tuning();
  const bool warp = tune.rope_warp && np == 1 && a.packed && rot % V == 0 && aligned_to(a.cs, 16) &&
                    a.cs_stride % 4 == 0;
  // Rows a lane takes (R): the fewest that put the whole grid in one wave (latency-bound sizes: a
  // decode step), else two (bandwidth-bound: more loads in flight a warp; H100, bench_rope_cache.py:
  // 8,192 tokens 134 -> 112 us with one -> two, four no better). KernelTuning::rope_rows pins it.
  const int64_t row_slots = ceil_div(rows, 32 / G), wpb = kWarpKernelThreads / 32;
  auto units_for = [&](int r) { return T * ceil_div(row_slots, (int64_t)r); };
  int R = 2;
  if (tune.rope_rows == 1 || tune.rope_rows == 2 || tune.rope_rows == 4) {
    R = (int)tune.rope_rows;
  } else if (warp) {
    static const std::array<int, 3> per_sm = [] {  // resident CTAs an SM of each R (bf16, the common case)
      std::array<int, 3> n{};
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n[0], rope_cache_warp_kernel<__nv_bfloat16, __nv_bfloat16, true, 1>,
                                                    kWarpKernelThreads, 0);
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n[1], rope_cache_warp_kernel<__nv_bfloat16, __nv_bfloat16, true, 2>,
                                                    kWarpKernelThreads, 0);
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n[2], rope_cache_warp_kernel<__nv_bfloat16, __nv_bfloat16, true, 4>,
                                                    kWarpKernelThreads, 0);
      return n;
    }();
    const int64_t sms = sm_count();
    if (ceil_div(units_for(1), wpb) <= per_sm[0] * sms) R = 1;
    else if (ceil_div(units_for(2), wpb) <= per_sm[1] * sms) R = 2;
    else if (ceil_div(units_for(4), wpb) <= per_sm[2] * sms) R = 4;
  }
  const unsigned warp_blocks = (unsigned)std::min<int64_t>(ceil_div(units_for(R), wpb), (int64_t)1 << 20);
  TALLOW_CUDA_DISPATCH_FLOAT(op, q.dtype(), [&] {
    using S = scalar_t;
    dispatch_cache(op, k_cache.dtype(), [&](auto ctag) {
      using C = decltype(ctag);
      if (warp) {
        auto kernel = neox ? (R == 4 ? rope_cache_warp_kernel<S, C, true, 4>
                              : R == 2 ? rope_cache_warp_kernel<S, C, true, 2> : rope_cache_warp_kernel<S, C, true, 1>)
                           : (R == 4 ? rope_cache_warp_kernel<S, C, false, 4>
                              : R == 2 ? rope_cache_warp_kernel<S, C, false, 2> : rope_cache_warp_kernel<S, C, false, 1>);
        TALLOW_CUDA_CHECK(op, launch_kernel(kernel, dim3(warp_blocks), dim3(kWarpKernelThreads), 0, ctx.stream,
                                            pdl, a));
        return;
      }
      auto kernel = np == 1 ? rope_cache_kernel<S, C, 1> : rope_cache_kernel<S, C, kMaxPacks>;
      TALLOW_CUDA_CHECK(op, launch_kernel(kernel, dim3(blocks), dim3(threads), smem, ctx.stream, pdl, a));
    });
  });
  TALLOW_CUDA_CHECK_LAUNCH(op);
  return true;
}

}  // namespace tallow::cuda
