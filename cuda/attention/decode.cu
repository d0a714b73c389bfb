// Paged decode attention: split-KV ("flash-decoding") on tensor cores (contract in decode.cuh).
//
// Grid (split, kv head, sequence), 4 warps a CTA. A CTA attends the query heads of one kv head's
// GQA group (up to 16: the rows of the mma's A operand, zero-padded) over one split of the
// sequence's visible keys, so each K/V row is read from HBM once per step. Warps take 16-key tiles
// of the split in turn and keep their own online softmax (f32; scores in the log2 domain).
//
// Operands go from global memory straight into mma.sync m16n8k16 fragments, with 16-byte loads:
// the contraction index of S = Q K^T (head dim) and the column index of O = P V (head dim again)
// are permuted so that each lane's share of a K or V row is contiguous in memory.
//  * S: B operand = K^T. Lane (g, t) holds key g of each 8-key n-tile. Its 4 values of k-step kt
//    are K[key][d .. d + 3], d = 16 kt0 + 4 t gs + 4 (kt - kt0), where the k-steps are cut into
//    groups (kt0, gs) of one 16-byte load per lane (2 k-steps at 16 bits, 4 at fp8; smaller
//    powers of two at the end). Q's A fragments (staged in shared memory once per CTA) use the
//    same d for k = 2t, 2t+1 (d, d+1) and k = 2t+8, 2t+9 (d+2, d+3).
//  * O: B operand = V. Lane (g, t) holds keys 2t, 2t+1, 2t+8, 2t+9 of the tile (the keys of its
//    P fragment), and for each key D/8 values: value index v is column g of n-tile v, at
//    d = 8 v0 + g w + (v - v0) for the segment (v0, w) of v (segments: one 16-byte load each).
// fp8 values are converted to q's type (exact) as fragments are built; k_scale is folded into the
// score scale and v_scale into the output.
//
// Splits: the host picks the grid's split count from shapes only (batch, kv heads, the block
// table's width as the longest context, SM count, occupancy); each sequence then cuts its own
// visible range [lo, hi) into at most that many splits of >= min_split keys, so CTAs beyond its
// length exit at once and no split lies before a sliding window. With one split a CTA writes the
// output; else it leaves (m, l, unnormalised O) per head and decode_merge_kernel combines them.
// A split's block ids (<= kMaxTable) are staged in shared memory; entries at or past
// ceil(seq_len / block_size) are never read.
#include "attention/decode.cuh"

#include <cuda_fp8.h>

#include <algorithm>
#include <cstdlib>
#include <type_traits>

#include "launch.cuh"

namespace tallow::cuda {

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kTile = 16;         // keys per warp step: two 8-key n-tiles of S, one k-step of P V
constexpr int kMaxGroup = 16;     // query heads per kv head (the mma's 16 rows)
constexpr int kMaxTable = 1024;   // block ids of one split in shared memory
constexpr int kMaxSplits = 256;   // splits per (token, kv head); bounds the merge's shared memory
constexpr int kDefaultMinSplit = 128;
constexpr int64_t kCtaOverheadKeys = 128;          // a CTA's fixed cost, in keys streamed (split planning)
constexpr int64_t kMaxPartialBytes = 128ll << 20;  // scratch for split results
constexpr float kLog2e = 1.4426950408889634f;

struct Fp8 {  // storage tag of float8_e4m3 caches
  uint8_t bits;
};

struct DecodeParams {
  const void* q;
  int64_t qst, qsh;  // q strides of token and head (elements)
  const void* k;
  const void* v;
  int64_t ksb, ksr, ksh, vsb, vsr, vsh;  // cache strides of block, row, head (elements)
  const int32_t* bt;
  int64_t bt_s0, bt_s1;
  const int32_t* seq_lens;
  int64_t sl_s;
  const int32_t* qsl;
  int64_t qsl_s;
  void* out;        // [T, Hq, D]
  float* part_o;    // [T, Hk, nsplit, G, D]: unnormalised split outputs
  float* part_ml;   // [T, Hk, nsplit, G, 2]: (max in log2 units, sum of weights)
  int64_t T, B, Hq, Hk, NB, max_blocks, window;
  int G, bs_shift, nsplit, min_split;
  float qk_scale;       // scale (times k_scale for fp8)
  float qk_scale_log2;  // qk_scale * log2(e)
  float softcap;
  float out_scale;      // v_scale for fp8, else 1
};

// Size of the group starting at unit `at` when n units are cut greedily into powers of two <= maxg
// (so each group starts at a multiple of its size).
__host__ __device__ constexpr int greedy_group(int n, int maxg, int at) {
  int s = maxg;
  while (s > n - at && s > 1) s >>= 1;
  return s;
}

// The output column of value index v (n-tile v) held by column n of the tile.
template <int NV, int MAXW>
__device__ __forceinline__ int v_column(int v, int n) {
  int at = 0, w = greedy_group(NV, MAXW, 0);
#pragma unroll
  for (int it = 0; it < 8 && v >= at + w; ++it) {
    at += w;
    w = greedy_group(NV, MAXW, at);
  }
  return 8 * at + n * w + (v - at);
}

template <int AT, int N, int MAXG, class F>
__device__ __forceinline__ void for_groups(F&& f) {
  if constexpr (AT < N) {
    constexpr int S = greedy_group(N, MAXG, AT);
    f(std::integral_constant<int, AT>{}, std::integral_constant<int, S>{});
    for_groups<AT + S, N, MAXG>(f);
  }
}

template <int BYTES>
__device__ __forceinline__ void load_words(const void* p, uint32_t* w) {
  if constexpr (BYTES == 16) {
    const uint4 x = __ldg(static_cast<const uint4*>(p));
    w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w;
  } else if constexpr (BYTES == 8) {
    const uint2 x = __ldg(static_cast<const uint2*>(p));
    w[0] = x.x, w[1] = x.y;
  } else if constexpr (BYTES == 4) {
    w[0] = __ldg(static_cast<const unsigned int*>(p));
  } else {
    static_assert(BYTES == 2, "load width");
    w[0] = __ldg(static_cast<const unsigned short*>(p));
  }
}

template <int BYTES>
__device__ __forceinline__ void load_or_zero(const void* p, uint32_t* w) {
  if (p) {
    load_words<BYTES>(p, w);
  } else {
#pragma unroll
    for (int i = 0; i < (BYTES + 3) / 4; ++i) w[i] = 0;
  }
}

template <class Q>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<Q, __half>) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

// Two e4m3 values (low 16 bits; the lower byte first) as two Q values (exact).
template <class Q>
__device__ __forceinline__ uint32_t fp8x2_to(uint32_t two) {
  const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(two & 0xffffu), __NV_E4M3);
  if constexpr (std::is_same_v<Q, __half>) {
    return (uint32_t)r.x | ((uint32_t)r.y << 16);
  } else {
    const float2 f = __half22float2(__half2(r));
    return pack2<Q>(f.x, f.y);
  }
}

// c += A B for one m16n8k16 tile (f32 accumulators).
template <class Q>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<Q, __half>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#else
  __trap();  // the host never launches this below sm_80
#endif
}

// Keys [lo, hi) visible to query i of n of a sequence of length len (never past the block table).
__device__ __forceinline__ void visible_keys(const DecodeParams& P, int64_t len, int64_t n, int64_t i, int64_t& lo,
                                             int64_t& hi) {
  const int64_t p = len - n + i;  // the query's position
  const int64_t cap = P.max_blocks << P.bs_shift;
  hi = p + 1 < cap ? p + 1 : cap;
  lo = P.window > 0 && p - P.window + 1 > 0 ? p - P.window + 1 : 0;
  if (hi < lo) hi = lo;
}

// Keys per split of a visible range: at most nsplit splits of >= min_split keys, multiples of kTile.
__device__ __forceinline__ int64_t split_len(const DecodeParams& P, int64_t range) {
  int64_t n = (range + P.min_split - 1) / P.min_split;
  n = n < 1 ? 1 : (n > P.nsplit ? P.nsplit : n);
  const int64_t len = (range + n - 1) / n;
  return len < kTile ? kTile : (len + kTile - 1) / kTile * kTile;
}

__device__ __forceinline__ int64_t num_splits(int64_t range, int64_t slen) {
  return range > 0 ? (range + slen - 1) / slen : 1;
}

template <class Q, class C, int D>
__global__ void __launch_bounds__(kThreads, (D <= 128 ? 3 : 1)) decode_kernel(const DecodeParams P) {
  constexpr int E = (int)sizeof(C);
  constexpr int NKT = D / 16;          // k-steps of S = Q K^T
  constexpr int KMAXG = 16 / (4 * E);  // k-steps per 16-byte K load of a lane
  constexpr int KW = NKT * E;          // K words per lane and key
  constexpr int NV = D / 8;            // V values per lane and key = n-tiles of O
  constexpr int VMAXW = 16 / E;        // V values per 16-byte load
  constexpr int VW = (NV * E + 3) / 4;  // V words per lane and key
  constexpr bool kVEarly = D <= 128;    // V loads in flight with K's (at D = 256 registers forbid)

  __shared__ uint4 s_q[NKT * 32];  // Q A-fragments, [k-step][lane]
  __shared__ int s_tbl[kMaxTable];
  __shared__ __align__(16) float s_o[kMaxGroup * D];
  __shared__ float s_wm[kWarps][16], s_wl[kWarps][16];
  __shared__ float s_m[16], s_l[16];

  const int split = blockIdx.x, kvh = blockIdx.y;
  const int64_t b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tg = lane & 3;
  const int G = P.G;
  const int64_t q0 = P.qsl[b * P.qsl_s], n = P.qsl[(b + 1) * P.qsl_s] - q0, len = P.seq_lens[b * P.sl_s];
  const int64_t i_begin = q0 < 0 ? -q0 : 0, i_end = n < P.T - q0 ? n : P.T - q0;
  const C* kbase = static_cast<const C*>(P.k) + kvh * P.ksh;
  const C* vbase = static_cast<const C*>(P.v) + kvh * P.vsh;
  const int64_t row_mask = (int64_t(1) << P.bs_shift) - 1;

  for (int64_t i = i_begin; i < i_end; ++i) {  // one query per sequence in a decode batch
    const int64_t t = q0 + i;
    int64_t lo, hi;
    visible_keys(P, len, n, i, lo, hi);
    const int64_t slen = split_len(P, hi - lo), ns = num_splits(hi - lo, slen);
    if (split >= ns) continue;
    const int64_t k0 = lo + split * slen, k1 = hi < k0 + slen ? hi : k0 + slen;
    __syncthreads();  // shared memory of the previous query is free

    for (int idx = tid; idx < NKT * 32; idx += kThreads) {
      const int kt = idx >> 5, rg = (idx & 31) >> 2, rt = idx & 3;
      int kt0 = 0, gs = greedy_group(NKT, KMAXG, 0);
      while (kt >= kt0 + gs) kt0 += gs, gs = greedy_group(NKT, KMAXG, kt0);
      const int d = 16 * kt0 + 4 * rt * gs + 4 * (kt - kt0);
      uint32_t w[4];
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // rows rg (a0, a2) and rg + 8 (a1, a3)
        const int row = rg + 8 * h;
        uint32_t x = 0, y = 0;
        if (row < G) {
          const uint16_t* qr =
              reinterpret_cast<const uint16_t*>(static_cast<const Q*>(P.q) + t * P.qst + ((int64_t)kvh * G + row) * P.qsh) + d;
          x = (uint32_t)qr[0] | ((uint32_t)qr[1] << 16);
          y = (uint32_t)qr[2] | ((uint32_t)qr[3] << 16);
        }
        w[h] = x;
        w[h + 2] = y;
      }
      s_q[idx] = make_uint4(w[0], w[1], w[2], w[3]);
    }
    const int64_t first = k0 >> P.bs_shift;
    int64_t span = k1 > k0 ? ((k1 - 1) >> P.bs_shift) - first + 1 : 0;
    const int ntb = (int)(span < kMaxTable ? span : kMaxTable);
    for (int j = tid; j < ntb; j += kThreads) {
      const int id = P.bt[b * P.bt_s0 + (first + j) * P.bt_s1];
      s_tbl[j] = id >= 0 && id < P.NB ? id : -1;
    }
    __syncthreads();

    // Row of `key` in a cache, or nullptr when it is outside the split or its block id is bad.
    auto row_of = [&](const C* base, int64_t sb, int64_t sr, int64_t key) -> const C* {
      if (key < k0 || key >= k1) return nullptr;
      const int64_t j = (key >> P.bs_shift) - first;
      if (j >= ntb) return nullptr;
      const int id = s_tbl[j];
      return id < 0 ? nullptr : base + (int64_t)id * sb + (key & row_mask) * sr;
    };

    float o[NV][4];
#pragma unroll
    for (int v = 0; v < NV; ++v) o[v][0] = o[v][1] = o[v][2] = o[v][3] = 0.f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // rows g and g + 8 (l: this lane's part)

    for (int64_t ts = k0 + warp * kTile; ts < k1; ts += kWarps * kTile) {
      uint32_t kw[2][KW];
      uint32_t vw[4][VW];
      bool vok[4];
#pragma unroll
      for (int r = 0; r < 2; ++r) {  // keys ts + g and ts + 8 + g, this lane's quarter of the row
        const C* row = row_of(kbase, P.ksb, P.ksr, ts + 8 * r + g);
        for_groups<0, NKT, KMAXG>([&](auto KT0, auto GS) {
          constexpr int kt0 = decltype(KT0)::value, gs = decltype(GS)::value;
          load_or_zero<4 * gs * E>(row ? row + 16 * kt0 + 4 * tg * gs : nullptr, &kw[r][kt0 * E]);
        });
      }
      auto load_v = [&] {  // keys ts + 2t, 2t + 1, 2t + 8, 2t + 9, this lane's eighth of the row
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const C* row = row_of(vbase, P.vsb, P.vsr, ts + 2 * tg + (j & 1) + 8 * (j >> 1));
          vok[j] = row != nullptr;
          for_groups<0, NV, VMAXW>([&](auto V0, auto W) {
            constexpr int v0 = decltype(V0)::value, w = decltype(W)::value;
            load_or_zero<w * E>(row ? row + 8 * v0 + g * w : nullptr, &vw[j][v0 * E / 4]);
          });
        }
      };
      if constexpr (kVEarly) load_v();

      float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int kt = 0; kt < NKT; ++kt) {
        const uint4 aq = s_q[kt * 32 + lane];
        const uint32_t a[4] = {aq.x, aq.y, aq.z, aq.w};
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          uint32_t b0, b1;
          if constexpr (E == 2) {
            b0 = kw[r][2 * kt];
            b1 = kw[r][2 * kt + 1];
          } else {
            b0 = fp8x2_to<Q>(kw[r][kt]);
            b1 = fp8x2_to<Q>(kw[r][kt] >> 16);
          }
          mma16816<Q>(s[r], a, b0, b1);
        }
      }
      if constexpr (!kVEarly) load_v();

      // Scores in log2 units; keys outside the split (or with a bad block) get -inf. s[r][e] is
      // row g (e < 2) or g + 8, key ts + 8 r + 2 t + (e & 1): the key of vok[2 r + (e & 1)].
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = s[r][e];
          if (P.softcap > 0.f) x = P.softcap * tanhf(x * P.qk_scale / P.softcap) * kLog2e;
          else x *= P.qk_scale_log2;
          s[r][e] = vok[2 * r + (e & 1)] ? x : -INFINITY;
        }
      float mx0 = fmaxf(fmaxf(s[0][0], s[0][1]), fmaxf(s[1][0], s[1][1]));
      float mx1 = fmaxf(fmaxf(s[0][2], s[0][3]), fmaxf(s[1][2], s[1][3]));
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
      const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
      const float mu0 = mn0 == -INFINITY ? 0.f : mn0, mu1 = mn1 == -INFINITY ? 0.f : mn1;  // no inf - inf
      const float c0 = exp2f(m0 - mu0), c1 = exp2f(m1 - mu1);
      m0 = mn0;
      m1 = mn1;
      float p[2][4];
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int e = 0; e < 4; ++e) p[r][e] = exp2f(s[r][e] - (e < 2 ? mu0 : mu1));
      l0 = l0 * c0 + (p[0][0] + p[0][1]) + (p[1][0] + p[1][1]);
      l1 = l1 * c1 + (p[0][2] + p[0][3]) + (p[1][2] + p[1][3]);
      const uint32_t a[4] = {pack2<Q>(p[0][0], p[0][1]), pack2<Q>(p[0][2], p[0][3]), pack2<Q>(p[1][0], p[1][1]),
                             pack2<Q>(p[1][2], p[1][3])};
#pragma unroll
      for (int v = 0; v < NV; ++v) {
        o[v][0] *= c0;
        o[v][1] *= c0;
        o[v][2] *= c1;
        o[v][3] *= c1;
        uint32_t b0, b1;
        if constexpr (E == 2) {
          const uint32_t sel = (v & 1) ? 0x7632u : 0x5410u;
          b0 = __byte_perm(vw[0][v / 2], vw[1][v / 2], sel);
          b1 = __byte_perm(vw[2][v / 2], vw[3][v / 2], sel);
        } else {
          const uint32_t sel = (uint32_t)(v & 3) | ((uint32_t)(4 + (v & 3)) << 4);
          b0 = fp8x2_to<Q>(__byte_perm(vw[0][v / 4], vw[1][v / 4], sel));
          b1 = fp8x2_to<Q>(__byte_perm(vw[2][v / 4], vw[3][v / 4], sel));
        }
        mma16816<Q>(o[v], a, b0, b1);
      }
    }

    // Merge the warps: rows' maxima and sums, then the scaled O rows summed in shared memory
    // (warp by warp, so the result does not depend on timing).
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    if (tg == 0) {
      s_wm[warp][g] = m0;
      s_wm[warp][g + 8] = m1;
      s_wl[warp][g] = l0;
      s_wl[warp][g + 8] = l1;
    }
    __syncthreads();
    float M0 = -INFINITY, M1 = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M0 = fmaxf(M0, s_wm[w][g]), M1 = fmaxf(M1, s_wm[w][g + 8]);
    const float f0 = m0 == -INFINITY ? 0.f : exp2f(m0 - M0), f1 = m1 == -INFINITY ? 0.f : exp2f(m1 - M1);
    if (tid < 16) {
      float M = -INFINITY, L = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) M = fmaxf(M, s_wm[w][tid]);
#pragma unroll
      for (int w = 0; w < kWarps; ++w)
        if (s_wm[w][tid] != -INFINITY) L += s_wl[w][tid] * exp2f(s_wm[w][tid] - M);
      s_m[tid] = M;
      s_l[tid] = L;
    }
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      if (warp == w) {
#pragma unroll
        for (int v = 0; v < NV; ++v)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = g + 8 * (e >> 1);
            if (row < G) {
              float* dst = s_o + row * D + v_column<NV, VMAXW>(v, 2 * tg + (e & 1));
              const float val = (e < 2 ? f0 : f1) * o[v][e];
              *dst = w == 0 ? val : *dst + val;
            }
          }
      }
      __syncthreads();
    }

    if (ns == 1) {  // the whole range: normalise and write the output
      Q* orow = static_cast<Q*>(P.out) + (t * P.Hq + (int64_t)kvh * G) * D;
      for (int idx = tid; idx < G * (D / 8); idx += kThreads) {
        const int r = idx / (D / 8), d = (idx % (D / 8)) * 8;
        const float L = s_l[r], inv = L > 0.f ? P.out_scale / L : 0.f;
        Vec16<Q> x;
#pragma unroll
        for (int k = 0; k < 8; ++k) x.v[k] = from_float<Q>(s_o[r * D + d + k] * inv);
        store16(orow + r * D + d, x);
      }
    } else {  // one split: leave (m, l, O) for the merge
      const int64_t pidx = (t * P.Hk + kvh) * P.nsplit + split;
      float4* po = reinterpret_cast<float4*>(P.part_o + pidx * G * D);
      for (int idx = tid; idx < G * D / 4; idx += kThreads) po[idx] = reinterpret_cast<const float4*>(s_o)[idx];
      if (tid < G) {
        P.part_ml[(pidx * G + tid) * 2] = s_m[tid];
        P.part_ml[(pidx * G + tid) * 2 + 1] = s_l[tid];
      }
    }
  }
}

// out = sum_s w_s O_s / sum_s w_s l_s, w_s = 2^(m_s - max m), for each query head of every
// (token, kv head) whose range was split (the kernel above wrote the others). One CTA per query
// head row: warp 0 computes the weights, then groups of threads sum disjoint sets of splits for a
// 4-column slice each (many loads in flight: the partials sit in L2), and the groups are added.
template <class Q, int D>
__global__ void __launch_bounds__(kThreads) decode_merge_kernel(const DecodeParams P) {
  constexpr int C4 = D / 4;             // float4 columns of a row
  constexpr int NSG = kThreads / C4;    // split groups
  __shared__ float s_w[kMaxSplits];
  __shared__ float s_inv;
  __shared__ float4 s_acc[NSG][C4];
  const int r = blockIdx.x, kvh = blockIdx.y;
  const int64_t t = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, G = P.G;
  if (r >= G) return;
  auto qsl = [&](int64_t b) { return (int64_t)P.qsl[b * P.qsl_s]; };
  int64_t b;  // the sequence of token t: t itself in a decode batch, else the last b with qsl[b] <= t
  if (qsl(t) == t && qsl(t + 1) == t + 1) {
    b = t;
  } else {
    int64_t lo = 0, hi = P.B - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (qsl(mid) <= t) lo = mid;
      else hi = mid - 1;
    }
    b = lo;
  }
  const int64_t q0 = qsl(b), n = qsl(b + 1) - q0, i = t - q0, len = P.seq_lens[b * P.sl_s];
  if (i < 0 || i >= n) return;
  int64_t lo, hi;
  visible_keys(P, len, n, i, lo, hi);
  const int64_t ns = num_splits(hi - lo, split_len(P, hi - lo));
  if (ns <= 1) return;
  const int64_t base = (t * P.Hk + kvh) * P.nsplit;
  if (tid < 32) {
    float M = -INFINITY;
    for (int64_t s = lane; s < ns; s += 32) M = fmaxf(M, P.part_ml[((base + s) * G + r) * 2]);
    M = warp_max(M);
    float L = 0.f;
    for (int64_t s = lane; s < ns; s += 32) {
      const float m = P.part_ml[((base + s) * G + r) * 2], l = P.part_ml[((base + s) * G + r) * 2 + 1];
      const float w = m == -INFINITY ? 0.f : exp2f(m - M);
      s_w[s] = w;
      L += w * l;
    }
    L = warp_sum(L);
    if (lane == 0) s_inv = L > 0.f ? P.out_scale / L : 0.f;
  }
  __syncthreads();
  const int sg = tid / C4, c = tid % C4;
  if (sg < NSG) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
    for (int64_t s = sg; s < ns; s += NSG) {  // empty splits hold zeros: their weight 0 adds nothing
      const float w = s_w[s];
      const float4 x = *reinterpret_cast<const float4*>(P.part_o + ((base + s) * G + r) * D + 4 * c);
      acc.x += w * x.x;
      acc.y += w * x.y;
      acc.z += w * x.z;
      acc.w += w * x.w;
    }
    s_acc[sg][c] = acc;
  }
  __syncthreads();
  if (tid < C4) {
    float4 acc = s_acc[0][tid];
#pragma unroll
    for (int k = 1; k < NSG; ++k) {
      const float4 x = s_acc[k][tid];
      acc.x += x.x, acc.y += x.y, acc.z += x.z, acc.w += x.w;
    }
    const float inv = s_inv;
    union {
      Q h[4];
      uint2 u;
    } pk;
    pk.h[0] = from_float<Q>(acc.x * inv);
    pk.h[1] = from_float<Q>(acc.y * inv);
    pk.h[2] = from_float<Q>(acc.z * inv);
    pk.h[3] = from_float<Q>(acc.w * inv);
    Q* orow = static_cast<Q*>(P.out) + (t * P.Hq + (int64_t)kvh * G + r) * D;
    *reinterpret_cast<uint2*>(orow + 4 * tid) = pk.u;
  }
}

int env_int(const char* name, int fallback) {
  const char* s = std::getenv(name);
  return s && *s ? std::atoi(s) : fallback;
}

int compute_major() {
  static int majors[64] = {};
  int dev = 0;
  TALLOW_CUDA_CHECK("paged_attention", cudaGetDevice(&dev));
  if (dev >= 64) dev = 63;
  if (!majors[dev])
    TALLOW_CUDA_CHECK("paged_attention", cudaDeviceGetAttribute(&majors[dev], cudaDevAttrComputeCapabilityMajor, dev));
  return majors[dev];
}

template <class Q, class C, int D>
int ctas_per_sm() {
  static const int n = [] {
    int v = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v, decode_kernel<Q, C, D>, kThreads, 0) != cudaSuccess) {
      (void)cudaGetLastError();
      v = 1;
    }
    return v > 0 ? v : 1;
  }();
  return n;
}

// The grid's split count: the fewest splits that keep a split's block ids within kMaxTable, then
// the count that minimises (waves of CTAs) x (keys per CTA + fixed cost) for a full-length context.
int64_t choose_splits(int64_t rows, int64_t maxctx, int64_t slots, int64_t min_split, int64_t split_cap,
                      int64_t max_by_memory) {
  const int64_t need = std::max<int64_t>(1, ceil_div(maxctx, split_cap));
  const int64_t most = std::min<int64_t>({(int64_t)kMaxSplits, max_by_memory,
                                          std::max<int64_t>(need, ceil_div(maxctx, min_split))});
  if (need > most) return -1;
  const int forced = env_int("TALLOW_DECODE_SPLITS", 0);  // tuning override
  if (forced > 0) return std::clamp<int64_t>(forced, need, most);
  // The last answer is kept: a decode loop asks the same question every layer and step.
  thread_local int64_t last_key[5] = {-1, -1, -1, -1, -1}, last_best = 1;
  const int64_t key[5] = {rows, maxctx, slots, need, most};
  if (std::equal(key, key + 5, last_key)) return last_best;
  int64_t best = need;
  double best_cost = 0.0;
  for (int64_t n = need; n <= most; ++n) {
    const double waves = (double)ceil_div(rows * n, slots);
    const double cost = waves * ((double)ceil_div(maxctx, n) + (double)kCtaOverheadKeys);
    if (n == need || cost < best_cost * 0.999) best = n, best_cost = cost;
  }
  std::copy(key, key + 5, last_key);
  last_best = best;
  return best;
}

template <class Q, class C, int D>
bool launch(DecodeParams P, const Tensor& q, int64_t maxctx, int64_t split_cap, cudaStream_t stream) {
  const int64_t rows = P.T * P.Hk;
  const int64_t slots = (int64_t)ctas_per_sm<Q, C, D>() * sm_count();
  const int64_t per_split = P.T * P.Hq * (D + 2) * (int64_t)sizeof(float);
  const int64_t n = choose_splits(rows, maxctx, slots, P.min_split, split_cap,
                                  std::max<int64_t>(1, kMaxPartialBytes / per_split));
  if (n < 1) return false;  // a long context over a huge batch: the scratch would not be small
  P.nsplit = (int)n;
  Tensor scratch;
  if (n > 1) {
    scratch = Tensor::empty({P.T * P.Hq * n * (D + 2)}, DType::F32, q.device());
    P.part_o = static_cast<float*>(scratch.data_ptr());
    P.part_ml = P.part_o + P.T * P.Hq * n * D;
  }
  decode_kernel<Q, C, D><<<dim3((unsigned)n, (unsigned)P.Hk, (unsigned)P.B), kThreads, 0, stream>>>(P);
  TALLOW_CUDA_CHECK_LAUNCH("paged_attention");
  if (n > 1) {
    decode_merge_kernel<Q, D><<<dim3((unsigned)P.G, (unsigned)P.Hk, (unsigned)P.T), kThreads, 0, stream>>>(P);
    TALLOW_CUDA_CHECK_LAUNCH("paged_attention");
  }
  return true;
}

template <class Q, class C>
bool launch_d(int64_t D, const DecodeParams& P, const Tensor& q, int64_t maxctx, int64_t split_cap,
              cudaStream_t stream) {
  switch (D) {
    case 64: return launch<Q, C, 64>(P, q, maxctx, split_cap, stream);
    case 80: return launch<Q, C, 80>(P, q, maxctx, split_cap, stream);
    case 96: return launch<Q, C, 96>(P, q, maxctx, split_cap, stream);
    case 128: return launch<Q, C, 128>(P, q, maxctx, split_cap, stream);
    default: return launch<Q, C, 256>(P, q, maxctx, split_cap, stream);
  }
}

bool rows_aligned(const Tensor& c) {
  const int64_t e = dtype_type_size(c.dtype());
  return aligned_to(c.data_ptr(), 16) && c.stride(3) == 1 && (c.stride(0) * e) % 16 == 0 &&
         (c.stride(1) * e) % 16 == 0 && (c.stride(2) * e) % 16 == 0;
}

}  // namespace

bool paged_decode_attention(const Tensor& out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                            const Tensor& block_tables, const Tensor& seq_lens, const Tensor& query_start_loc,
                            float scale, int64_t sliding_window, float softcap, float k_scale, float v_scale) {
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), B = seq_lens.size(0);
  const int64_t NB = k_cache.size(0), BS = k_cache.size(1), Hk = k_cache.size(2), max_blocks = block_tables.size(1);
  const DType qd = q.dtype(), cd = k_cache.dtype();
  if (T != B || T <= 0 || B > 65535 || Hk <= 0 || Hk > 65535) return false;
  if (qd != DType::F16 && qd != DType::BF16) return false;
  if ((cd != qd && cd != DType::F8E4M3) || v_cache.dtype() != cd) return false;
  if (D != 64 && D != 80 && D != 96 && D != 128 && D != 256) return false;
  if (v_cache.size(3) != D || Hq % Hk != 0 || Hq / Hk > kMaxGroup) return false;
  if (BS <= 0 || (BS & (BS - 1)) != 0 || NB > INT32_MAX) return false;
  for (const Tensor* t : {&block_tables, &seq_lens, &query_start_loc})
    if (t->dtype() != DType::I32) return false;
  if (!rows_aligned(k_cache) || !rows_aligned(v_cache) || !aligned_to(out.data_ptr(), 16) || !out.is_contiguous())
    return false;
  if (q.stride(2) != 1 && D > 1) return false;
  if (compute_major() < 8) return false;

  int bs_shift = 0;
  while ((int64_t(1) << bs_shift) < BS) ++bs_shift;
  const int64_t maxctx = max_blocks * BS;
  const int64_t split_cap = std::max<int64_t>(kTile, (kMaxTable - 2) * BS / kTile * kTile);
  int64_t min_split = env_int("TALLOW_DECODE_MIN_SPLIT", kDefaultMinSplit);
  min_split = std::clamp<int64_t>(min_split / kTile * kTile, kTile, split_cap);
  if (ceil_div(maxctx, split_cap) > kMaxSplits) return false;  // contexts past ~kMaxSplits * split_cap

  const bool f8 = cd == DType::F8E4M3;
  DecodeParams P{};
  P.q = q.data_ptr();
  P.qst = q.stride(0);
  P.qsh = q.stride(1);
  P.k = k_cache.data_ptr();
  P.v = v_cache.data_ptr();
  P.ksb = k_cache.stride(0), P.ksr = k_cache.stride(1), P.ksh = k_cache.stride(2);
  P.vsb = v_cache.stride(0), P.vsr = v_cache.stride(1), P.vsh = v_cache.stride(2);
  P.bt = static_cast<const int32_t*>(block_tables.data_ptr());
  P.bt_s0 = block_tables.stride(0);
  P.bt_s1 = block_tables.stride(1);
  P.seq_lens = static_cast<const int32_t*>(seq_lens.data_ptr());
  P.sl_s = seq_lens.stride(0);
  P.qsl = static_cast<const int32_t*>(query_start_loc.data_ptr());
  P.qsl_s = query_start_loc.stride(0);
  P.out = out.data_ptr();
  P.T = T, P.B = B, P.Hq = Hq, P.Hk = Hk, P.NB = NB, P.max_blocks = max_blocks, P.window = sliding_window;
  P.G = (int)(Hq / Hk);
  P.bs_shift = bs_shift;
  P.min_split = (int)min_split;
  P.qk_scale = f8 ? scale * k_scale : scale;
  P.qk_scale_log2 = P.qk_scale * kLog2e;
  P.softcap = softcap;
  P.out_scale = f8 ? v_scale : 1.0f;

  OpContext ctx(q);
  if (qd == DType::BF16)
    return f8 ? launch_d<__nv_bfloat16, Fp8>(D, P, q, maxctx, split_cap, ctx.stream)
              : launch_d<__nv_bfloat16, __nv_bfloat16>(D, P, q, maxctx, split_cap, ctx.stream);
  return f8 ? launch_d<__half, Fp8>(D, P, q, maxctx, split_cap, ctx.stream)
            : launch_d<__half, __half>(D, P, q, maxctx, split_cap, ctx.stream);
}

}  // namespace tallow::cuda
