// Paged decode attention: split-KV ("flash-decoding") on tensor cores in one kernel (contract in
// decode.cuh).
//
// Grid (split, kv head, sequence), 4 warps a CTA. A CTA attends the query heads of one kv head's
// GQA group (up to 16: the rows of the mma's A operand, zero-padded) over one split of the
// sequence's visible keys, so each K/V row is read from HBM once per step.
//
// Loads: every warp runs its own cp.async pipeline (`stages` slots of KEYS keys: K rows then V
// rows, 8 KiB a slot at 16 bits and D <= 128) over the chunks w, w + 4, w + 8, ... of the split, so
// (stages - 1) chunks per warp are in flight while it computes one, with no CTA barrier in the
// loop. With few rows the prologue fills all `stages` slots (else stages - 1, the last from the
// loop's first step, after q is staged; H100, batch 1-8: +0.01-0.04 of copy bandwidth). The loads
// the prologue waits for (q, and with speculation the metadata again) are issued before the first
// chunks: queued behind them they would wait for much of the stream (batch 1: ~2.5 us). Keys past
// the split, and keys of out-of-range block ids, are zero-filled (cp.async with source size 0: no
// memory traffic) and masked to -inf. Slots are XOR-swizzled in 16-byte units
// so the fragment reads below are free of bank conflicts (K: rows g and g+1 apart, V: keys 2t).
//
// Math: mma.sync m16n8k16, f32 accumulators, online softmax per warp in the log2 domain. The
// contraction index of S = Q K^T (head dim) and the column index of O = P V (head dim again) are
// permuted so that each lane's share of a K or V row is contiguous:
//  * S: B operand = K^T. Lane (g, t) holds key g of each 8-key n-tile. Its 4 values of k-step kt
//    are K[key][d .. d + 3], d = 16 kt0 + 4 t gs + 4 (kt - kt0), where the k-steps are cut into
//    groups (kt0, gs) of one 16-byte read per lane (2 k-steps at 16 bits, 4 at fp8; smaller
//    powers of two at the end). Q's A fragments (staged in shared memory once per CTA) use the
//    same d for k = 2t, 2t+1 (d, d+1) and k = 2t+8, 2t+9 (d+2, d+3).
//  * O: B operand = V. Lane (g, t) holds keys 2t, 2t+1, 2t+8, 2t+9 of the tile (the keys of its
//    P fragment), and for each key D/8 values: value index v is column g of n-tile v, at
//    d = 8 v0 + g w + (v - v0) for the segment (v0, w) of v (segments: one 16-byte read each).
// Narrow kernel (GQA groups of <= 8 query heads, NARROW): the heads are the mma's 8 columns instead of
// 16 rows (of which the group would fill at most half): S^T = K Q^T with A = the K rows above (lane
// (g, t): keys g and g + 8, the same reads) and B = Q^T (the g rows of Q's staged A fragments, kept in
// registers); lane (g, t) then holds heads 2t, 2t+1 of keys g, g + 8, its max and sum reduced over g.
// O^T += V^T P^T: B = P^T is the score fragment's two 8x8 halves transposed in registers (movmatrix),
// A = V^T reuses the V reads and pairs above, value indices 2i and 2i+1 as rows g and g + 8 of m-tile
// i. Half the mmas, exponentials and O registers of the wide kernel.
// FP8 caches run the mmas in f16: e4m3 -> f16x2 is one cvt.rn.f16x2.e4m3x2 per pair (exact), and
// P in f16 is finer than bf16. A bf16 q is staged as f16 times 2^e per row (e puts the row's
// largest |q| in [2^14, 2^15): exact for every element within 2^24 of it), and 2^-e goes into that
// row's score scale. k_scale is folded into the score scale, v_scale into the output.
//
// Splits: the host picks the grid's split count from shapes only (batch, kv heads, the block
// table's width as the longest context, SM count, occupancy); each sequence then cuts its own
// visible range [lo, hi) into ceil(range / min_split) splits (at most the grid's), so short
// contexts use one split and CTAs past a sequence's splits exit at once. With one split a CTA
// writes the output; else it leaves (m, l, unnormalised O) per head in a scratch buffer, and the
// last CTA of the (token, kv head) to finish - a release-acquire atomic counter - merges
// the splits in split order (the result does not depend on which CTA came last) and resets the
// counter to 0 for the next launch. A split's block ids (<= kMaxTable) are staged in shared memory;
// entries at or past ceil(seq_len / block_size) are never read.
//
// Counters: one int per (token, kv head), in a per-device (or private stream's) buffer allocated
// with cudaMalloc outside graph capture (>= 64 Ki entries, grown to the largest T * Hk seen, in
// powers of two; an outgrown buffer is kept, since captured graphs still point at it) and zeroed
// once; every launch leaves it zeroed. A launch under capture that needs more counters than the
// buffer holds takes them from the graph's pool instead, zeroed by a memset captured before the
// kernel. One decode launch at a time uses a buffer (stream order or PDL; streams that may overlap
// are made private).
//
// Programmatic dependent launch (sm_90): the kernel is launched with programmatic stream
// serialization, so it starts while the previous kernel finishes; griddepcontrol.wait precedes
// every read of q and of cache rows the previous kernel may write, and every write. The metadata
// (query_start_loc, seq_lens, the split's block ids) is read before the wait, then read again after
// it and compared: on any difference (the previous kernel wrote them) the CTA drops its loads and
// starts over, so this is correct whatever the previous kernel wrote. With TALLOW_DECODE_PDL=3 (the
// default), griddepcontrol.launch_dependents comes right after the wait: every CTA of the grid is
// resident by then (the trigger fires once all have executed it), so the next kernel's CTAs take
// free slots only and run their pre-wait part (metadata, early copies; o_proj's gemv: weights)
// while this one streams. And when the caller promises a settled cache (settled_cache: the rows
// before each sequence's new tokens are written by no kernel still running, as after
// rope_and_cache), the first wave's CTAs also copy the first stages - 1 chunks of every warp
// before the wait, all but the fresh key (a decode's own row), which its warp loads after the wait
// (H100, batch 1-8, 4k-32k keys: +0.03-0.07 of copy bandwidth). TALLOW_DECODE_PDL=2 triggers after
// the main loop and copies nothing early, 1 waits before any read, 0 launches without the attribute.
#include "attention/decode.cuh"

#include <cuda_fp8.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <type_traits>
#include <vector>

#include "attention/ptx.cuh"
#include "core/tuning.h"
#include "launch.cuh"
#include "pdl.cuh"

namespace tallow::cuda {

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kTile = 16;          // keys of one mma step: two 8-key n-tiles of S, one k-step of P V
constexpr int kMaxGroup = 16;      // query heads per kv head (the mma's 16 rows)
constexpr int kMaxTable = 1024;    // block ids of one split in shared memory
constexpr int kMaxSplits = 256;    // splits per (token, kv head); bounds the merge's shared memory
constexpr int kDefaultMinSplit = 256;
constexpr int kFewRowsMinSplit = 64;     // see launch()
constexpr int kManyRowsMinSplit = 2048;  // see launch()
constexpr int kDefaultStages = 3;
constexpr int kMaxStages = 4;
constexpr int64_t kDeepMinContext = 16384;  // see launch()
constexpr int kMergeLoads = 16;  // split partials a merging thread reads at once
constexpr int64_t kCtaOverheadKeys = 128;          // a CTA's fixed cost, in keys streamed (split planning)
constexpr int64_t kMaxPartialBytes = 128ll << 20;  // scratch for split results
constexpr int64_t kMinCounters = 1 << 16;
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
  int ksr32, vsr32;                      // the row strides again (they fit: checked by the host)
  const int32_t* bt;
  int64_t bt_s0, bt_s1;
  const int32_t* seq_lens;
  int64_t sl_s;
  const int32_t* qsl;
  int64_t qsl_s;
  void* out;        // [T, Hq, D]
  float* part_o;    // [T, Hk, nsplit, G, D]: unnormalised split outputs
  float* part_ml;   // [T, Hk, nsplit, G, 2]: (max in log2 units, sum of weights)
  int* counters;    // [T, Hk]: splits finished (0 between launches)
  int64_t T, B, Hq, Hk, NB, max_blocks, window;
  int G, bs_shift, nsplit, min_split, stages, early, early_kv, early_trigger, early_ctas;
  int fill;  // the prologue fills every pipeline slot (the last one after the wait); see the loop
  float score_scale;   // raw dot -> log2 score: qk_scale * log2(e); with softcap qk_scale / softcap
  float softcap_log2;  // softcap * log2(e), 0 without softcap
  float out_scale;     // v_scale for fp8, else 1
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

// Compile-time shape of one (q type, cache type, head dim) instance.
template <class Q, class C, int D>
struct Shape_ {
  static constexpr int E = (int)sizeof(C);
  static constexpr bool kF8 = E == 1;
  using MT = std::conditional_t<kF8, __half, Q>;  // the mma operand type
  static constexpr bool kQScale = kF8 && std::is_same_v<Q, __nv_bfloat16>;
  static constexpr int NKT = D / 16;          // k-steps of S = Q K^T
  static constexpr int KMAXG = 16 / (4 * E);  // k-steps per 16-byte K read of a lane
  static constexpr int NV = D / 8;            // V values per lane and key = n-tiles of O
  static constexpr int VMAXW = 16 / E;        // V values per 16-byte read
  static constexpr int RB = D * E;                    // bytes of a cache row (one kv head)
  static constexpr int RS = (RB + 127) / 128 * 128;   // its stride in a slot (whole swizzle groups)
  static constexpr int TPS = RS <= 256 ? 256 / RS : 1;  // mma tiles per chunk: ~8 KiB slots
  static constexpr int KEYS = kTile * TPS;            // keys per chunk (<= 32: one ballot)
  static constexpr int KEYS_SHIFT = KEYS == 32 ? 5 : 4;  // log2(KEYS)
  static constexpr int PPR = RB / 16;                 // 16-byte pieces of a row
  static constexpr int PIECES = KEYS * PPR;           // pieces of K (and of V) per chunk
  static constexpr int SLOT = 2 * KEYS * RS;          // bytes of one pipeline slot
  static constexpr int OW_BYTES = kWarps * kMaxGroup * D * 4;                     // warps' O rows
  static constexpr int MERGE_BYTES = kMaxGroup * kMaxSplits * 4 + kThreads * 16;  // weights, sums
  static constexpr int EPI_BYTES = OW_BYTES > MERGE_BYTES ? OW_BYTES : MERGE_BYTES;
  static_assert(KEYS <= 32 && PIECES % 32 == 0 && RB % 16 == 0, "chunk shape");
};

// ---- device helpers ----------------------------------------------------------------------------

// Output elements acc * inv, rounded to Q, stored with one 8-byte write.
template <class Q>
__device__ __forceinline__ void store4(Q* dst, float4 acc, float inv) {
  union {
    Q h[4];
    uint2 u;
  } pk;
  pk.h[0] = from_float<Q>(acc.x * inv);
  pk.h[1] = from_float<Q>(acc.y * inv);
  pk.h[2] = from_float<Q>(acc.z * inv);
  pk.h[3] = from_float<Q>(acc.w * inv);
  *reinterpret_cast<uint2*>(dst) = pk.u;
}

// *p += v at gpu scope with release and acquire semantics; returns the old value.
__device__ __forceinline__ int atomic_add_acq_rel(int* p, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// Waits until at most `pending` of this thread's newest groups are still in flight.
__device__ __forceinline__ void cp_async_wait_pending(int pending) {
  switch (pending) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    default: cp_async_wait<3>(); break;
  }
}

template <int BYTES>
__device__ __forceinline__ void lds_words(const unsigned char* p, uint32_t* w) {
  if constexpr (BYTES == 16) {
    const uint4 x = *reinterpret_cast<const uint4*>(p);
    w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w;
  } else if constexpr (BYTES == 8) {
    const uint2 x = *reinterpret_cast<const uint2*>(p);
    w[0] = x.x, w[1] = x.y;
  } else if constexpr (BYTES == 4) {
    w[0] = *reinterpret_cast<const uint32_t*>(p);
  } else {
    static_assert(BYTES == 2, "read width");
    w[0] = *reinterpret_cast<const uint16_t*>(p);
  }
}

// Byte `off` of a slot row whose 16-byte units are XOR-swizzled by `swz` (< 8).
__device__ __forceinline__ int swizzled(int off, int swz) { return (((off >> 4) ^ swz) << 4) | (off & 15); }

// Two e4m3 values (low 16 bits; the lower byte first) as f16x2: one cvt.rn.f16x2.e4m3x2 on sm_89+.
__device__ __forceinline__ uint32_t e4m3x2_to_h2(uint32_t two) {
  const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(two & 0xffffu), __NV_E4M3);
  return (uint32_t)r.x | ((uint32_t)r.y << 16);
}

// Chunk-slot reads shared by the wide and narrow kernels (lane (g, t); see the top of the file).
// K rows 16 tile + g and 16 tile + g + 8: the lane's BYTES of k-step group (kt0, gs).
template <int BYTES, int RS, int E>
__device__ __forceinline__ void read_k_rows(const unsigned char* ks, int tile, int kt0, int gs, int g, int tg,
                                            uint32_t (&kw)[2][(BYTES + 3) / 4]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int kk = kTile * tile + 8 * r + g;
    lds_words<BYTES>(ks + kk * RS + swizzled((16 * kt0 + 4 * tg * gs) * E, (kk & 1) << 2), kw[r]);
  }
}

// The 16-bit pairs of k-step j of a K row read: contraction indices (2t, 2t+1) in lo, (2t+8, 2t+9) in hi.
template <int E, int N>
__device__ __forceinline__ void k_pairs(const uint32_t (&kw)[N], int j, uint32_t& lo, uint32_t& hi) {
  if constexpr (E == 2) {
    lo = kw[2 * j];
    hi = kw[2 * j + 1];
  } else {
    lo = e4m3x2_to_h2(kw[j]);
    hi = e4m3x2_to_h2(kw[j] >> 16);
  }
}

// V rows of keys 16 tile + 2t, + 1, + 8, + 9 (j = 0..3): the lane's BYTES of value segment (v0, w).
template <int BYTES, int RS, int E>
__device__ __forceinline__ void read_v_keys(const unsigned char* vs, int tile, int v0, int w, int g, int tg,
                                            uint32_t (&vw)[4][(BYTES + 3) / 4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int kk = kTile * tile + 2 * tg + (j & 1) + 8 * (j >> 1);
    lds_words<BYTES>(vs + kk * RS + swizzled((8 * v0 + g * w) * E, 2 * tg), vw[j]);
  }
}

// Value u of the segment for keys (2t, 2t+1) (half 0) or (2t+8, 2t+9) (half 1), as one 16-bit pair.
template <int E, int N>
__device__ __forceinline__ uint32_t v_pair(const uint32_t (&vw)[4][N], int u, int half) {
  if constexpr (E == 2) {
    return __byte_perm(vw[2 * half][u / 2], vw[2 * half + 1][u / 2], (u & 1) ? 0x7632u : 0x5410u);
  } else {
    const uint32_t bi = (uint32_t)(u & 3), sel = bi | ((4u + bi) << 4);
    return e4m3x2_to_h2(__byte_perm(vw[2 * half][u / 4], vw[2 * half + 1][u / 4], sel));
  }
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

// Keys per split of a visible range: ceil(range / min_split) splits, at most nsplit, each a
// multiple of kTile keys long.
// 32-bit unsigned arithmetic (ranges stay below 2^30 keys: the host checks the table's width), as
// 64-bit divisions by runtime values cost a software routine on the latency-bound prologue.
__device__ __forceinline__ int64_t split_len(const DecodeParams& P, int64_t range) {
  const uint32_t r = (uint32_t)range, ms = (uint32_t)P.min_split;
  uint32_t n = (r + ms - 1) / ms;
  n = n < 1 ? 1 : (n > (uint32_t)P.nsplit ? (uint32_t)P.nsplit : n);
  const uint32_t len = (r + n - 1) / n;
  return len < kTile ? kTile : (len + kTile - 1) / kTile * kTile;
}

__device__ __forceinline__ int64_t num_splits(int64_t range, int64_t slen) {
  return range > 0 ? ((uint32_t)range + (uint32_t)slen - 1) / (uint32_t)slen : 1;
}

// The 32-bit word of s_q (A fragments, [k-step][lane][4]) that holds q elements (d, d + 1) of row r.
template <int NKT, int KMAXG>
__device__ __forceinline__ int q_word(int d, int r) {
  if constexpr (NKT % KMAXG == 0) {  // every group has KMAXG k-steps (D = 64, 128, 256): shifts and masks
    constexpr int GW = 16 * KMAXG;     // head-dim elements of a group
    const int kt0 = d / GW * KMAXG, local = d % GW, t = local / (4 * KMAXG), rem = local % (4 * KMAXG);
    const int kt = kt0 + rem / 4, upper = (rem & 3) >> 1;
    return (kt * 32 + (r & 7) * 4 + t) * 4 + (r >> 3) + 2 * upper;
  }
  int kt0 = 0, gs = greedy_group(NKT, KMAXG, 0);
  while (d >= 16 * (kt0 + gs)) {
    kt0 += gs;
    gs = greedy_group(NKT, KMAXG, kt0);
  }
  const int local = d - 16 * kt0, t = local / (4 * gs), rem = local % (4 * gs);
  const int kt = kt0 + rem / 4, upper = (rem & 3) >> 1;  // d + 2, d + 3: a2 / a3
  return (kt * 32 + (r & 7) * 4 + t) * 4 + (r >> 3) + 2 * upper;
}

template <class Q, class C, int D, bool NARROW>
__global__ void __launch_bounds__(kThreads, 2) decode_kernel(const DecodeParams P) {
  using S = Shape_<Q, C, D>;
  using MT = typename S::MT;
  constexpr int E = S::E, NKT = S::NKT, KMAXG = S::KMAXG, NV = S::NV, VMAXW = S::VMAXW;
  constexpr int RS = S::RS, TPS = S::TPS, KEYS = S::KEYS, PPR = S::PPR;

  extern __shared__ __align__(128) unsigned char smem[];  // pipeline slots; after the loop: epilogue
  __shared__ uint4 s_q[NKT * 32];                          // Q A-fragments, [k-step][lane]
  __shared__ int s_tbl[kMaxTable];
  __shared__ float s_rs[kMaxGroup];                        // per row: raw dot -> log2 score
  __shared__ float s_wm[kWarps][kMaxGroup], s_wl[kWarps][kMaxGroup];
  __shared__ float s_inv[kMaxGroup];
  __shared__ int64_t s_meta[3];
  __shared__ int s_last;

  const int split = blockIdx.x, kvh = blockIdx.y;
  const int64_t b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tg = lane & 3;
  const int G = P.G, stages = P.stages;
  const C* kbase = static_cast<const C*>(P.k) + kvh * P.ksh;
  const C* vbase = static_cast<const C*>(P.v) + kvh * P.vsh;
  const int row_mask = (1 << P.bs_shift) - 1;
  unsigned char* wslots = smem + warp * stages * S::SLOT;  // this warp's pipeline

  for (int pass = 0; pass < 2; ++pass) {
    // Pass 0 with P.early reads the metadata before waiting for the previous kernel and checks it
    // after; pass 1 (only after a mismatch) waits first.
    const bool spec = P.early && pass == 0;
    if (!spec) {
      pdl_wait();
      if (P.early_trigger) pdl_launch_dependents();
    }
    if (pass) __syncthreads();  // every thread is done reading pass 0's s_meta
    if (tid == 0) {  // one reader: every thread plans with the same values
      s_meta[0] = __ldcg(P.qsl + b * P.qsl_s);
      s_meta[1] = __ldcg(P.qsl + (b + 1) * P.qsl_s);
      s_meta[2] = __ldcg(P.seq_lens + b * P.sl_s);
    }
    __syncthreads();
    const int64_t q0 = s_meta[0], n = s_meta[1] - q0, len = s_meta[2];
    if (spec && n != 1) continue;  // speculate on decode rows only (uniform: values from shared memory)
    // Checks, after the wait, that the metadata read before it is still what memory holds.
    auto meta_changed = [&] {
      return __ldcg(P.qsl + b * P.qsl_s) != s_meta[0] || __ldcg(P.qsl + (b + 1) * P.qsl_s) != s_meta[1] ||
             __ldcg(P.seq_lens + b * P.sl_s) != s_meta[2];
    };
    const int64_t i_begin = q0 < 0 ? -q0 : 0, i_end = n < P.T - q0 ? n : P.T - q0;
    bool again = false, checked = !spec;  // checked: the metadata was confirmed after the wait

    for (int64_t i = i_begin; i < i_end; ++i) {  // one query per sequence in a decode batch
      const int64_t t = q0 + i;
      int64_t lo, hi;
      visible_keys(P, len, n, i, lo, hi);
      const int64_t slen = split_len(P, hi - lo), ns = num_splits(hi - lo, slen);
      if (split >= ns) continue;  // nothing to do here (with speculation: confirmed below)
      const int64_t k0 = lo + split * slen, k1 = hi < k0 + slen ? hi : k0 + slen;
      __syncthreads();  // shared memory of the previous query is free

      // The split's block ids (bad ones as -1).
      const int64_t first = k0 >> P.bs_shift;
      const int64_t span = k1 > k0 ? ((k1 - 1) >> P.bs_shift) - first + 1 : 0;
      const int ntb = (int)(span < kMaxTable ? span : kMaxTable);
      auto table_entry = [&](int j) {
        const int id = __ldcg(P.bt + b * P.bt_s0 + (first + j) * P.bt_s1);
        return id >= 0 && id < P.NB ? id : -1;
      };
      for (int j = tid; j < ntb; j += kThreads) s_tbl[j] = table_entry(j);
      __syncthreads();

      // This warp's chunks: w, w + kWarps, ... of the split, KEYS keys each.
      const int64_t nck = (k1 - k0 + KEYS - 1) / KEYS;
      const int nmine = nck > warp ? (int)((nck - warp + kWarps - 1) / kWarps) : 0;
      // Lane `key` of the warp resolves key c0 + key of a chunk: block id (-1: not read) and row.
      auto resolve = [&](int64_t c0, int& id, int& row) {
        const int64_t key = c0 + lane;
        id = -1;
        row = 0;
        if (lane < KEYS && key < k1) {
          const int64_t j = (key >> P.bs_shift) - first;
          id = j < ntb ? s_tbl[j] : -1;
          row = (int)(key & row_mask);
        }
      };
      auto chunk_start = [&](int c) { return k0 + (int64_t)(warp + c * kWarps) * KEYS; };
      // Chunk c of this warp into pipeline slot `slot` (one commit group). Fast paths (warp-uniform):
      // the chunk starts a cache block and lies in it (blocks of >= KEYS rows), or spans two whole
      // blocks of KEYS / 2 rows: one or two block ids (broadcast reads of s_tbl), rows that follow
      // each other, so a piece's address is its block's plus a 32-bit offset. Else every key
      // resolves its own block (lane kk of the warp resolves key kk, the others read it with
      // shuffles). Offsets of keys past the range or of bad blocks are never read (cp.async with
      // source size 0 reads nothing).
      // Early copies (see the top of the file): keys [fresh_lo, k1) are the rows the previous kernel
      // may write. FILTER 0 issues every key, 1 (the copies before the wait) all but those.
      const int64_t fresh_lo = len - n;
      auto issue = [&](int c, int slot, auto filter) {
        constexpr int FILTER = decltype(filter)::value;
        // The early copies' lane index is opaque to the compiler: shared with the loop's copies, their
        // address terms would stay live through the main loop (registers past the kernel's budget).
        int ln = lane;
        if constexpr (FILTER != 0) asm volatile("" : "+r"(ln));
        if (c < nmine) {
          unsigned char* ks = wslots + slot * S::SLOT;
          unsigned char* vs = ks + KEYS * RS;
          const int64_t c0 = chunk_start(c);
          const int nvalid = k1 - c0 < KEYS ? (int)(k1 - c0) : KEYS;
          const int64_t j = (c0 >> P.bs_shift) - first;
          const int64_t fl = fresh_lo - c0;  // keys kk in [fl, nvalid) of the chunk are fresh
          const int fresh0 = fl < 0 ? 0 : (fl > KEYS ? KEYS : (int)fl);
          auto wanted = [&](int kk) {
            if constexpr (FILTER == 0) return true;
            return !(kk >= fresh0 && kk < nvalid);
          };
          auto block_ptrs = [&](int64_t jj, int row0, const unsigned char*& kb, const unsigned char*& vb) {
            const int id = jj < ntb ? s_tbl[jj] : -1;
            kb = reinterpret_cast<const unsigned char*>(kbase) + ((int64_t)id * P.ksb + (int64_t)row0 * P.ksr) * E;
            vb = reinterpret_cast<const unsigned char*>(vbase) + ((int64_t)id * P.vsb + (int64_t)row0 * P.vsr) * E;
            return id >= 0;
          };
          if (P.bs_shift >= S::KEYS_SHIFT && (c0 & (KEYS - 1)) == 0) {  // one block
            const unsigned char *kb, *vb;
            const bool blk_ok = block_ptrs(j, (int)(c0 & row_mask), kb, vb);
            if constexpr (32 % PPR == 0) {  // a lane keeps its piece; its key advances by 32 / PPR a step
              constexpr int KSTEP = 32 / PPR;
              const int kk0 = ln / PPR, piece = ln % PPR;
              const int koff = (kk0 * P.ksr32 + piece * (16 / E)) * E, kstep = KSTEP * P.ksr32 * E;
              const int voff = (kk0 * P.vsr32 + piece * (16 / E)) * E, vstep = KSTEP * P.vsr32 * E;
#pragma unroll
              for (int it = 0; it < S::PIECES / 32; ++it) {
                const int kk = kk0 + KSTEP * it;
                const bool ok = blk_ok && kk < nvalid;
                if (!wanted(kk)) continue;
                cp_async16(smem_addr(ks + kk * RS + ((piece ^ ((kk & 1) << 2)) << 4)), kb + koff + it * kstep, ok);
                cp_async16(smem_addr(vs + kk * RS + ((piece ^ (((kk >> 1) & 3) << 1)) << 4)), vb + voff + it * vstep,
                           ok);
              }
            } else {
#pragma unroll
              for (int it = 0; it < S::PIECES / 32; ++it) {
                const int p = ln + 32 * it, kk = p / PPR, piece = p % PPR;
                const bool ok = blk_ok && kk < nvalid;
                if (!wanted(kk)) continue;
                cp_async16(smem_addr(ks + kk * RS + ((piece ^ ((kk & 1) << 2)) << 4)),
                           kb + (kk * P.ksr32 + piece * (16 / E)) * E, ok);
                cp_async16(smem_addr(vs + kk * RS + ((piece ^ (((kk >> 1) & 3) << 1)) << 4)),
                           vb + (kk * P.vsr32 + piece * (16 / E)) * E, ok);
              }
            }
          } else if (P.bs_shift == S::KEYS_SHIFT - 1 && (c0 & (KEYS / 2 - 1)) == 0) {  // two blocks
            const unsigned char *kb0, *vb0, *kb1, *vb1;
            const bool ok0 = block_ptrs(j, 0, kb0, vb0), ok1 = block_ptrs(j + 1, 0, kb1, vb1);
#pragma unroll
            for (int it = 0; it < S::PIECES / 32; ++it) {
              const int p = ln + 32 * it, kk = p / PPR, piece = p % PPR;
              const bool hi = kk >= KEYS / 2;
              const int row = hi ? kk - KEYS / 2 : kk;
              const bool ok = (hi ? ok1 : ok0) && kk < nvalid;
              if (!wanted(kk)) continue;
              cp_async16(smem_addr(ks + kk * RS + ((piece ^ ((kk & 1) << 2)) << 4)),
                         (hi ? kb1 : kb0) + (row * P.ksr32 + piece * (16 / E)) * E, ok);
              cp_async16(smem_addr(vs + kk * RS + ((piece ^ (((kk >> 1) & 3) << 1)) << 4)),
                         (hi ? vb1 : vb0) + (row * P.vsr32 + piece * (16 / E)) * E, ok);
            }
          } else {  // any layout
            int my_id, my_row;
            resolve(c0, my_id, my_row);
#pragma unroll
            for (int it = 0; it < S::PIECES / 32; ++it) {
              const int p = ln + 32 * it, kk = p / PPR, piece = p % PPR;
              const int id = __shfl_sync(0xffffffffu, my_id, kk), row = __shfl_sync(0xffffffffu, my_row, kk);
              const bool ok = id >= 0;
              if (!wanted(kk)) continue;
              const C* ksrc = ok ? kbase + (int64_t)id * P.ksb + (int64_t)row * P.ksr + piece * (16 / E) : kbase;
              const C* vsrc = ok ? vbase + (int64_t)id * P.vsb + (int64_t)row * P.vsr + piece * (16 / E) : vbase;
              cp_async16(smem_addr(ks + kk * RS + ((piece ^ ((kk & 1) << 2)) << 4)), ksrc, ok);
              cp_async16(smem_addr(vs + kk * RS + ((piece ^ (((kk >> 1) & 3) << 1)) << 4)), vsrc, ok);
            }
          }
        }
        cp_async_commit();
      };
      using AllKeys = std::integral_constant<int, 0>;
      // Early cache reads: the first chunks, all but the fresh key, go out before the wait; the warp
      // whose chunk holds the fresh key (fix_c) copies that row itself after the wait (below).
      // Only CTAs of the first wave: later ones start after the previous kernel has finished, and
      // their early copies would only delay their q (measured: nano-vllm steps 7.0 -> 7.5 ms).
      const bool early_kv = spec && P.early_kv && n == 1 &&
                            split + (int64_t)P.nsplit * (kvh + P.Hk * b) < (int64_t)P.early_ctas;
      int fix_c = -1;
      if (early_kv) {
        for (int c = 0; c < stages - 1; ++c) issue(c, c, std::integral_constant<int, 1>{});
        if (fresh_lo >= k0 && fresh_lo < k1) {
          const int64_t ci = (fresh_lo - k0) / KEYS;  // the split's chunk holding the fresh key
          if (ci % kWarps == warp && ci / kWarps < stages - 1) fix_c = (int)(ci / kWarps);
        }
      }
      if (spec) {
        pdl_wait();  // q (and fresh cache rows) are the previous kernel's outputs
        if (P.early_trigger) pdl_launch_dependents();
      }

      // Loads the prologue waits for go out before the K/V copies (behind those they would wait for
      // much of the stream; early copies went out before the wait): q rows (after the wait: q is the
      // previous kernel's output) and, when speculating, the metadata and the first block ids again.
      constexpr int NPL = (D / 2 + 31) / 32;  // q element pairs per lane
      constexpr int RR = kMaxGroup / kWarps;  // q rows per warp: w, w + 4, ...
      Q qv[RR][NPL][2];
#pragma unroll
      for (int rr = 0; rr < RR; ++rr) {
        const int r = warp + kWarps * rr;
        const Q* qrow = static_cast<const Q*>(P.q) + t * P.qst + ((int64_t)kvh * G + (r < G ? r : 0)) * P.qsh;
#pragma unroll
        for (int k = 0; k < NPL; ++k) {
          const int p = lane + 32 * k;
          const bool ok = r < G && p < D / 2;
          qv[rr][k][0] = ok ? qrow[2 * p] : from_float<Q>(0.f);
          qv[rr][k][1] = ok ? qrow[2 * p + 1] : from_float<Q>(0.f);
        }
      }
      int64_t again_meta[3] = {s_meta[0], s_meta[1], s_meta[2]};
      int again_id = -1;
      if (spec) {
        if (tid == 0) {
          again_meta[0] = __ldcg(P.qsl + b * P.qsl_s);
          again_meta[1] = __ldcg(P.qsl + (b + 1) * P.qsl_s);
          again_meta[2] = __ldcg(P.seq_lens + b * P.sl_s);
        }
        if (tid < ntb) again_id = __ldcg(P.bt + b * P.bt_s0 + (first + tid) * P.bt_s1);
      }
      // The fresh row of chunk fix_c: K and V pieces by plain loads now, into the slot (no copy was
      // issued for it) once q is staged; the loop's __syncwarp orders them before it is read.
      constexpr int FPL = (2 * PPR + 31) / 32;  // 16-byte pieces (K then V) per lane
      uint4 fresh[FPL];
      int fresh_kk = 0;
      if (fix_c >= 0) {
        fresh_kk = (int)(fresh_lo - chunk_start(fix_c));
        const int64_t j = (fresh_lo >> P.bs_shift) - first;
        const int id = j < ntb ? s_tbl[j] : -1;
        const int row = (int)(fresh_lo & row_mask);
#pragma unroll
        for (int f = 0; f < FPL; ++f) {
          const int p = lane + 32 * f, piece = p < PPR ? p : p - PPR;
          fresh[f] = make_uint4(0u, 0u, 0u, 0u);
          if (p < 2 * PPR && id >= 0) {
            const C* src = p < PPR ? kbase + (int64_t)id * P.ksb + (int64_t)row * P.ksr
                                   : vbase + (int64_t)id * P.vsb + (int64_t)row * P.vsr;
            fresh[f] = __ldcg(reinterpret_cast<const uint4*>(src + piece * (16 / E)));
          }
        }
      }
      // The last slot is free too: its chunk goes out now rather than from the loop's first step, after
      // q has been staged (batch 1: ~1 us later). With early copies, it is the first chunk after the wait.
      const int first_copies = P.fill ? stages : stages - 1;
      for (int c = early_kv ? stages - 1 : 0; c < first_copies; ++c) issue(c, c, AllKeys{});

      // Q rows as A fragments; rows past G are zeros.
      {
        uint32_t* sq = reinterpret_cast<uint32_t*>(s_q);
#pragma unroll
        for (int rr = 0; rr < RR; ++rr) {
          const int r = warp + kWarps * rr;
          float x[NPL][2];
          float mx = 0.f;
#pragma unroll
          for (int k = 0; k < NPL; ++k) {
            x[k][0] = to_float(qv[rr][k][0]);
            x[k][1] = to_float(qv[rr][k][1]);
            mx = fmaxf(mx, fmaxf(fabsf(x[k][0]), fabsf(x[k][1])));
          }
          float up = 1.f, down = 1.f;
          if constexpr (S::kQScale) {  // bf16 q into f16: the row's max into [2^14, 2^15)
            mx = warp_max(mx);
            if (mx > 0.f && mx <= 3.0e38f) {
              int e = 14 - (int)((__float_as_uint(mx) >> 23) & 0xffu) + 127;
              e = e < -60 ? -60 : (e > 60 ? 60 : e);
              up = __uint_as_float((uint32_t)(127 + e) << 23);
              down = __uint_as_float((uint32_t)(127 - e) << 23);
            }
          }
#pragma unroll
          for (int k = 0; k < NPL; ++k) {
            const int p = lane + 32 * k;
            if (p < D / 2) sq[q_word<NKT, KMAXG>(2 * p, r)] = pack2<MT>(x[k][0] * up, x[k][1] * up);
          }
          if (lane == 0) s_rs[r] = down * P.score_scale;
        }
      }
      if (fix_c >= 0) {
        unsigned char* ks = wslots + fix_c * S::SLOT;
        unsigned char* vs = ks + KEYS * RS;
        const int kk = fresh_kk;
#pragma unroll
        for (int f = 0; f < FPL; ++f) {
          const int p = lane + 32 * f;
          if (p < PPR)
            *reinterpret_cast<uint4*>(ks + kk * RS + ((p ^ ((kk & 1) << 2)) << 4)) = fresh[f];
          else if (p < 2 * PPR)
            *reinterpret_cast<uint4*>(vs + kk * RS + (((p - PPR) ^ (((kk >> 1) & 3) << 1)) << 4)) = fresh[f];
        }
      }
      bool bad = false;
      if (spec) {
        bad = again_meta[0] != s_meta[0] || again_meta[1] != s_meta[1] || again_meta[2] != s_meta[2];
        if (tid < ntb) bad |= (again_id >= 0 && again_id < P.NB ? again_id : -1) != s_tbl[tid];
        for (int j = tid + kThreads; j < ntb; j += kThreads) bad |= table_entry(j) != s_tbl[j];
      }
      if (__syncthreads_or(bad)) {  // (also publishes s_q) drop the loads, start over after the wait
        cp_async_wait<0>();
        __syncthreads();
        again = true;
        break;
      }
      checked = true;
      // Wide: rows g and g + 8 of S and O (l: this lane's part). Narrow: heads 2 t and 2 t + 1.
      const float rs0 = s_rs[NARROW ? 2 * tg : g], rs1 = s_rs[NARROW ? 2 * tg + 1 : g + 8];
      constexpr int NO = NARROW ? NV / 2 : NV;  // O accumulator tiles
      float o[NO][4];
#pragma unroll
      for (int v = 0; v < NO; ++v) o[v][0] = o[v][1] = o[v][2] = o[v][3] = 0.f;
      float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
      // Narrow: Q^T's B fragments (rows g of the staged A fragments), kept in registers.
      uint32_t qb[NARROW ? NKT : 1][2];
      if constexpr (NARROW) {
#pragma unroll
        for (int kt = 0; kt < NKT; ++kt) {
          const uint4 aq = s_q[kt * 32 + lane];
          qb[kt][0] = aq.x;
          qb[kt][1] = aq.z;
        }
      }

      // Slots in a ring, advanced by one a chunk (no runtime modulo): chunk c is in slot `cur`,
      // chunk c + stages - 1 goes to `nxt`.
      int cur = 0, nxt = stages - 1;
      // With P.fill the prologue issued chunk stages - 1 already: the first step issues nothing (and
      // commits no group, so `stages - 1` newer groups are still what chunk c waits behind).
      for (int c = 0; c < nmine; ++c) {
        __syncwarp();        // every lane is done with the slot chunk c - 1 used
        if (c > 0 || !P.fill) issue(c + stages - 1, nxt, AllKeys{});
        nxt = nxt + 1 == stages ? 0 : nxt + 1;
        cp_async_wait_pending(stages - 1);  // this lane's copies of chunk c have landed
        __syncwarp();        // ... and every lane's
        int id, row;
        resolve(chunk_start(c), id, row);
        const uint32_t valid = __ballot_sync(0xffffffffu, id >= 0);  // bit kk: key kk of the chunk is read
        const unsigned char* ks = wslots + cur * S::SLOT;
        const unsigned char* vs = ks + KEYS * RS;
        cur = cur + 1 == stages ? 0 : cur + 1;

        if constexpr (NARROW) {
#pragma unroll
          for (int tile = 0; tile < TPS; ++tile) {
            // S^T = K Q^T: A = K rows 16 tile + g, + 8 (read as the wide path reads them), B = Q^T.
            float s[4] = {0.f, 0.f, 0.f, 0.f};
            for_groups<0, NKT, KMAXG>([&](auto KT0, auto GS) {
              constexpr int kt0 = decltype(KT0)::value, gs = decltype(GS)::value;
              constexpr int BYTES = 4 * gs * E;
              uint32_t kw[2][(BYTES + 3) / 4];
              read_k_rows<BYTES, RS, E>(ks, tile, kt0, gs, g, tg, kw);
#pragma unroll
              for (int j = 0; j < gs; ++j) {
                uint32_t a[4];  // rows g, g + 8 of k (2t, 2t+1), then of k (2t+8, 2t+9)
                k_pairs<E>(kw[0], j, a[0], a[2]);
                k_pairs<E>(kw[1], j, a[1], a[3]);
                mma16816<MT>(s, a, qb[kt0 + j][0], qb[kt0 + j][1]);
              }
            });

            // s[e]: key 16 tile + g + 8 (e >> 1), head 2 t + (e & 1), in log2 units; masked keys get -inf.
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              float x = s[e] * ((e & 1) ? rs1 : rs0);
              if (P.softcap_log2 > 0.f) x = P.softcap_log2 * tanhf(x);
              const int kk = kTile * tile + g + 8 * (e >> 1);
              s[e] = (valid >> kk) & 1u ? x : -INFINITY;
            }
            float mx0 = fmaxf(s[0], s[2]), mx1 = fmaxf(s[1], s[3]);
#pragma unroll
            for (int x = 4; x < 32; x <<= 1) {
              mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, x));
              mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, x));
            }
            const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
            const float mu0 = mn0 == -INFINITY ? 0.f : mn0, mu1 = mn1 == -INFINITY ? 0.f : mn1;  // no inf - inf
            const float c0 = exp2f(m0 - mu0), c1 = exp2f(m1 - mu1);
            m0 = mn0;
            m1 = mn1;
            float p[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) p[e] = exp2f(s[e] - ((e & 1) ? mu1 : mu0));
            l0 = l0 * c0 + (p[0] + p[2]);
            l1 = l1 * c1 + (p[1] + p[3]);
            // P^T as the B operand (head g; keys 2 t, 2 t + 1 and 2 t + 8, 2 t + 9): the C fragment's two
            // 8x8 halves transposed in registers.
            const uint32_t b0 = movmatrix_trans(pack2<MT>(p[0], p[1])), b1 = movmatrix_trans(pack2<MT>(p[2], p[3]));
            if (__any_sync(0xffffffffu, c0 != 1.f || c1 != 1.f)) {  // a head's max rose
#pragma unroll
              for (int v = 0; v < NO; ++v) {
                o[v][0] *= c0;
                o[v][1] *= c1;
                o[v][2] *= c0;
                o[v][3] *= c1;
              }
            }

            // O^T += V^T P^T: A rows g and g + 8 of m-tile i are the wide path's value indices 2 i and 2 i + 1
            // (the same V reads and key pairs: 2 t, 2 t + 1 and 2 t + 8, 2 t + 9).
            for_groups<0, NV, VMAXW>([&](auto V0, auto W) {
              constexpr int v0 = decltype(V0)::value, w = decltype(W)::value;
              static_assert(v0 % 2 == 0 && w % 2 == 0, "value pairs stay in one segment");
              constexpr int BYTES = w * E;
              uint32_t vw[4][(BYTES + 3) / 4];
              read_v_keys<BYTES, RS, E>(vs, tile, v0, w, g, tg, vw);
#pragma unroll
              for (int v = v0; v < v0 + w; v += 2) {
                // A rows g (value index v) and g + 8 (v + 1), keys (2t, 2t+1) then (2t+8, 2t+9).
                const uint32_t a[4] = {v_pair<E>(vw, v - v0, 0), v_pair<E>(vw, v + 1 - v0, 0),
                                       v_pair<E>(vw, v - v0, 1), v_pair<E>(vw, v + 1 - v0, 1)};
                mma16816<MT>(o[v / 2], a, b0, b1);
              }
            });
          }
        } else {
#pragma unroll
          for (int tile = 0; tile < TPS; ++tile) {
            // S = Q K^T for keys 16 tile + 8 r + g (two n-tiles).
            float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
            for_groups<0, NKT, KMAXG>([&](auto KT0, auto GS) {
              constexpr int kt0 = decltype(KT0)::value, gs = decltype(GS)::value;
              constexpr int BYTES = 4 * gs * E;
              uint32_t kw[2][(BYTES + 3) / 4];
              read_k_rows<BYTES, RS, E>(ks, tile, kt0, gs, g, tg, kw);
#pragma unroll
              for (int j = 0; j < gs; ++j) {
                const uint4 aq = s_q[(kt0 + j) * 32 + lane];
                const uint32_t a[4] = {aq.x, aq.y, aq.z, aq.w};
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                  uint32_t b0, b1;
                  k_pairs<E>(kw[r], j, b0, b1);
                  mma16816<MT>(s[r], a, b0, b1);
                }
              }
            });

            // Scores in log2 units; masked keys get -inf. s[r][e] is row g (e < 2) or g + 8, key
            // 16 tile + 8 r + 2 t + (e & 1).
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                float x = s[r][e] * (e < 2 ? rs0 : rs1);
                if (P.softcap_log2 > 0.f) x = P.softcap_log2 * tanhf(x);
                const int kk = kTile * tile + 8 * r + 2 * tg + (e & 1);
                s[r][e] = (valid >> kk) & 1u ? x : -INFINITY;
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
            const uint32_t a[4] = {pack2<MT>(p[0][0], p[0][1]), pack2<MT>(p[0][2], p[0][3]),
                                   pack2<MT>(p[1][0], p[1][1]), pack2<MT>(p[1][2], p[1][3])};
            if (__any_sync(0xffffffffu, c0 != 1.f || c1 != 1.f)) {  // a row's max rose (rare after the first keys)
#pragma unroll
              for (int v = 0; v < NV; ++v) {
                o[v][0] *= c0;
                o[v][1] *= c0;
                o[v][2] *= c1;
                o[v][3] *= c1;
              }
            }

            // O += P V: keys 16 tile + 2 t + (j & 1) + 8 (j >> 1), one segment of values at a time.
            // Their rows are swizzled by 2 t (((key >> 1) & 3) << 1).
            for_groups<0, NV, VMAXW>([&](auto V0, auto W) {
              constexpr int v0 = decltype(V0)::value, w = decltype(W)::value;
              constexpr int BYTES = w * E;
              uint32_t vw[4][(BYTES + 3) / 4];
              read_v_keys<BYTES, RS, E>(vs, tile, v0, w, g, tg, vw);
#pragma unroll
              for (int v = v0; v < v0 + w; ++v)
                mma16816<MT>(o[v], a, v_pair<E>(vw, v - v0, 0), v_pair<E>(vw, v - v0, 1));
            });
          }
        }
      }
      cp_async_wait<0>();  // (only empty groups can remain)
      if (!P.early_trigger) pdl_launch_dependents();  // TALLOW_DECODE_PDL=2: the main loop is done

      // Merge the warps: each leaves (m, l) per row and its O rows in shared memory (the slots are
      // free once every warp is past the barrier); then each output element sums the warps in order.
      // A row's keys are spread over the lanes t (wide) or g (narrow) that hold it.
#pragma unroll
      for (int x = NARROW ? 4 : 1; x < (NARROW ? 32 : 4); x <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, x);
        l1 += __shfl_xor_sync(0xffffffffu, l1, x);
      }
      if (NARROW ? g == 0 : tg == 0) {
        const int r0 = NARROW ? 2 * tg : g, r1 = NARROW ? 2 * tg + 1 : g + 8;
        s_wm[warp][r0] = m0;
        s_wm[warp][r1] = m1;
        s_wl[warp][r0] = l0;
        s_wl[warp][r1] = l1;
      }
      __syncthreads();
      float* s_ow = reinterpret_cast<float*>(smem);  // [kWarps][G][D]
#pragma unroll
      for (int v = 0; v < NO; ++v)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          // Wide: o[v][e] is row g + 8 (e >> 1), value index v at column 2 t + (e & 1). Narrow: head
          // 2 t + (e & 1), value index 2 v + (e >> 1) at column g.
          const int row = NARROW ? 2 * tg + (e & 1) : g + 8 * (e >> 1);
          const int col = NARROW ? v_column<NV, VMAXW>(2 * v + (e >> 1), g) : v_column<NV, VMAXW>(v, 2 * tg + (e & 1));
          if (row < G) s_ow[(warp * G + row) * D + col] = o[v][e];
        }
      __syncthreads();

      const int64_t cidx = t * P.Hk + kvh, pidx = cidx * P.nsplit + split;
      for (int idx = tid; idx < G * (D / 4); idx += kThreads) {
        const int r = idx / (D / 4), d = (idx % (D / 4)) * 4;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) M = fmaxf(M, s_wm[w][r]);
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        float L = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
          const float f = s_wm[w][r] == -INFINITY ? 0.f : exp2f(s_wm[w][r] - M);
          const float4 x = *reinterpret_cast<const float4*>(s_ow + (w * G + r) * D + d);
          acc.x += f * x.x, acc.y += f * x.y, acc.z += f * x.z, acc.w += f * x.w;
          L += f * s_wl[w][r];
        }
        if (ns == 1) {  // the whole range: normalise and write the output
          store4(static_cast<Q*>(P.out) + (t * P.Hq + (int64_t)kvh * G + r) * D + d, acc,
                 L > 0.f ? P.out_scale / L : 0.f);
        } else {  // one split: leave (m, l, O) for the merge
          *reinterpret_cast<float4*>(P.part_o + (pidx * G + r) * D + d) = acc;
          if (d == 0) {
            P.part_ml[(pidx * G + r) * 2] = M;
            P.part_ml[(pidx * G + r) * 2 + 1] = L;
          }
        }
      }
      if (ns == 1) continue;

      // The last split to finish merges them all: sum_s w_s O_s / sum_s w_s l_s, w_s = 2^(m_s - max m),
      // in split order (warp-wide trees and fixed thread groups: the same result whoever merges).
      // One release-acquire count by thread 0 after the barrier: the barrier orders the CTA's partial
      // writes before the release, and the acquire, then the barrier, orders the merge's reads after
      // every split's writes (as CUTLASS's split-K semaphores do). Every thread's __threadfence and a
      // second fence in the merging CTA took longer (H100, batch 1, 4k keys: 10.9 vs 10.2 us a call).
      __syncthreads();
      if (tid == 0) s_last = atomic_add_acq_rel(P.counters + cidx, 1) == (int)ns - 1;
      __syncthreads();
      if (!s_last) continue;
      const int nsi = (int)ns;
      const int64_t base = cidx * P.nsplit;
      if (nsi <= kMergeLoads) {
        // Few splits: each thread reads every split's (m, l) and O columns of its outputs at once (one
        // L2 round trip where the general path below takes three) and sums them in split order.
        const float2* mlb = reinterpret_cast<const float2*>(P.part_ml) + base * G;
        for (int it = tid; it < G * (D / 4); it += kThreads) {
          const int r = it / (D / 4), c = it % (D / 4);
          float2 ml[kMergeLoads];
          float4 x[kMergeLoads];
#pragma unroll
          for (int u = 0; u < kMergeLoads; ++u) {
            ml[u] = u < nsi ? __ldcg(mlb + (int64_t)u * G + r) : make_float2(-INFINITY, 0.f);
            x[u] = u < nsi ? __ldcg(reinterpret_cast<const float4*>(P.part_o + ((base + u) * G + r) * D) + c)
                           : make_float4(0.f, 0.f, 0.f, 0.f);
          }
          float M = -INFINITY;
#pragma unroll
          for (int u = 0; u < kMergeLoads; ++u) M = fmaxf(M, ml[u].x);
          float L = 0.f;
          float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
          for (int u = 0; u < kMergeLoads; ++u) {
            const float w = ml[u].x == -INFINITY ? 0.f : exp2f(ml[u].x - M);
            L += w * ml[u].y;
            acc.x += w * x[u].x, acc.y += w * x[u].y, acc.z += w * x[u].z, acc.w += w * x[u].w;
          }
          store4(static_cast<Q*>(P.out) + (t * P.Hq + (int64_t)kvh * G + r) * D + 4 * c, acc,
                 L > 0.f ? P.out_scale / L : 0.f);
        }
        if (tid == 0) P.counters[cidx] = 0;  // every split has counted: ready for the next launch
        continue;
      }
      float* s_w = reinterpret_cast<float*>(smem);  // [G][ns]
      for (int r = warp; r < G; r += kWarps) {
        // (m, l) of split s at ml[s * G]; a lane's first pair stays in registers (one read when
        // nsi <= 32: the merge is a chain of L2 round trips).
        const float2* ml = reinterpret_cast<const float2*>(P.part_ml) + base * G + r;
        const float2 first_ml = lane < nsi ? __ldcg(ml + (int64_t)lane * G) : make_float2(-INFINITY, 0.f);
        float M = first_ml.x;
        for (int s = lane + 32; s < nsi; s += 32) M = fmaxf(M, __ldcg(ml + (int64_t)s * G).x);
        M = warp_max(M);
        float L = 0.f;
        for (int s = lane; s < nsi; s += 32) {
          const float2 x = s == lane ? first_ml : __ldcg(ml + (int64_t)s * G);
          const float w = x.x == -INFINITY ? 0.f : exp2f(x.x - M);
          s_w[r * nsi + s] = w;
          L += w * x.y;
        }
        L = warp_sum(L);
        if (lane == 0) s_inv[r] = L > 0.f ? P.out_scale / L : 0.f;
      }
      __syncthreads();
      constexpr int C4 = D / 4;
      const int items = G * C4;  // float4 columns of the group's output rows
      // acc += w_s O_s[r][4c ..] for s = s0, s0 + step, ... in order, kMergeLoads loads in flight.
      auto sum_splits = [&](int s0, int step, int r, int c) {
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int s1 = s0; s1 < nsi; s1 += kMergeLoads * step) {
          float4 x[kMergeLoads];
#pragma unroll
          for (int u = 0; u < kMergeLoads; ++u) {
            const int s = s1 + u * step;
            x[u] = s < nsi ? __ldcg(reinterpret_cast<const float4*>(P.part_o + ((base + s) * G + r) * D) + c)
                           : make_float4(0.f, 0.f, 0.f, 0.f);
          }
#pragma unroll
          for (int u = 0; u < kMergeLoads; ++u) {
            const int s = s1 + u * step;
            const float w = s < nsi ? s_w[r * nsi + s] : 0.f;
            acc.x += w * x[u].x, acc.y += w * x[u].y, acc.z += w * x[u].z, acc.w += w * x[u].w;
          }
        }
        return acc;
      };
      auto store = [&](int r, int c, float4 acc) {
        store4(static_cast<Q*>(P.out) + (t * P.Hq + (int64_t)kvh * G + r) * D + 4 * c, acc, s_inv[r]);
      };
      if (items >= kThreads) {  // a thread per column, all splits in order
        for (int it = tid; it < items; it += kThreads) store(it / C4, it % C4, sum_splits(0, 1, it / C4, it % C4));
      } else {  // groups of threads take splits s = grp (mod ngrp); the groups are added in order
        const int ngrp = kThreads / items, grp = tid / items, it = tid % items;
        float4* s_acc = reinterpret_cast<float4*>(smem + kMaxGroup * kMaxSplits * 4);
        if (grp < ngrp) s_acc[grp * items + it] = sum_splits(grp, ngrp, it / C4, it % C4);
        __syncthreads();
        if (tid < items) {
          float4 acc = s_acc[tid];
          for (int k = 1; k < ngrp; ++k) {
            const float4 x = s_acc[k * items + tid];
            acc.x += x.x, acc.y += x.y, acc.z += x.z, acc.w += x.w;
          }
          store(tid / C4, tid % C4, acc);
        }
      }
      if (tid == 0) P.counters[cidx] = 0;  // every split has counted: ready for the next launch
    }
    if (!again && !checked) {  // speculated and found nothing to do: confirm after the wait
      pdl_wait();
      if (P.early_trigger) pdl_launch_dependents();
      again = __syncthreads_or(tid == 0 && meta_changed());
    }
    if (!again) return;
  }
}

// ---- host side ---------------------------------------------------------------------------------

int current_dev() {
  int dev = 0;
  TALLOW_CUDA_CHECK("paged_attention", cudaGetDevice(&dev));
  return dev < 64 ? dev : 63;
}

int compute_major() {
  static int majors[64] = {};
  const int dev = current_dev();
  if (!majors[dev])
    TALLOW_CUDA_CHECK("paged_attention", cudaDeviceGetAttribute(&majors[dev], cudaDevAttrComputeCapabilityMajor, dev));
  return majors[dev];
}

// Pipeline depth (TALLOW_DECODE_STAGES, lowered until the shared memory fits the device), the
// dynamic shared memory of a launch, and resident CTAs per SM; per device and depth.
struct KernelFit {
  int stages = 0;
  size_t smem = 0;
  int per_sm = 1;
};

template <class Q, class C, int D, bool NARROW>
KernelFit kernel_fit(int want) {
  using S = Shape_<Q, C, D>;
  static std::mutex mu;
  static KernelFit fits[64][kMaxStages + 1];
  static size_t max_dyn[64];
  want = std::clamp(want, 1, kMaxStages);
  const int dev = current_dev();
  std::lock_guard<std::mutex> lk(mu);
  KernelFit& f = fits[dev][want];
  if (f.stages) return f;
  auto kernel = decode_kernel<Q, C, D, NARROW>;
  if (!max_dyn[dev]) {  // allow every size this device can give (a launch asks for what it needs)
    cudaFuncAttributes attr{};
    TALLOW_CUDA_CHECK("paged_attention", cudaFuncGetAttributes(&attr, kernel));
    int optin = 0;
    TALLOW_CUDA_CHECK("paged_attention", cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    max_dyn[dev] = (size_t)std::max<int64_t>(0, (int64_t)optin - (int64_t)attr.sharedSizeBytes);
    TALLOW_CUDA_CHECK("paged_attention", cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                              (int)max_dyn[dev]));
  }
  int s = want;
  auto bytes = [&](int st) { return (size_t)std::max(kWarps * st * S::SLOT, S::EPI_BYTES); };
  while (s > 1 && bytes(s) > max_dyn[dev]) --s;
  if (bytes(s) > max_dyn[dev]) return f;  // stages 0: this device cannot run it (the caller falls back)
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, bytes(s)) != cudaSuccess) {
    (void)cudaGetLastError();
    per_sm = 1;
  }
  f.smem = bytes(s);
  f.per_sm = std::max(per_sm, 1);
  f.stages = s;
  return f;
}

// The split counters of the device, or of a private stream (runtime.h: set_private_scratch; see the
// top of the file): launches queued on two such streams (a decode step split over two streams,
// runner.py) may run at once, so each has its own.
// Also called when a launch needs none (`used` false), so that the buffer exists before a later
// capture needs it.
int* split_counters(int64_t need, bool used, const Tensor& like, cudaStream_t stream, Tensor& fallback) {
  struct Counters {
    int* buf = nullptr;
    int64_t cap = 0;
  };
  static std::mutex mu;
  static std::map<std::pair<int, cudaStream_t>, Counters> per_stream;
  const int dev = current_dev();
  const cudaStream_t key = (cudaStream_t)scratch_key(stream);
  std::lock_guard<std::mutex> lk(mu);
  Counters& c = per_stream[{dev, key}];
  if (c.cap >= need) return c.buf;
  const bool capturing = is_capturing(stream);
  if (!capturing) {
    int64_t n = kMinCounters;
    while (n < need) n *= 2;
    int* p = nullptr;
    TALLOW_CUDA_CHECK("paged_attention", cudaMalloc(&p, (size_t)n * sizeof(int)));
    TALLOW_CUDA_CHECK("paged_attention", cudaMemsetAsync(p, 0, (size_t)n * sizeof(int), stream));
    TALLOW_CUDA_CHECK("paged_attention", cudaStreamSynchronize(stream));  // once: other streams may use it next
    c.buf = p;  // the old buffer stays allocated: captured graphs may still use it
    c.cap = n;
    return p;
  }
  if (!used) return nullptr;
  fallback = Tensor::empty({need}, DType::I32, like.device());
  TALLOW_CUDA_CHECK("paged_attention", cudaMemsetAsync(fallback.data_ptr(), 0, (size_t)need * sizeof(int), stream));
  return static_cast<int*>(fallback.data_ptr());
}

// The grid's split count: the fewest splits that keep a split's block ids within kMaxTable, then
// the count that minimises (waves of CTAs) x (keys per CTA + fixed cost) for a full-length context.
int64_t choose_splits(int64_t rows, int64_t maxctx, int64_t slots, int64_t min_split, int64_t split_cap,
                      int64_t max_by_memory) {
  const int64_t need = std::max<int64_t>(1, ceil_div(maxctx, split_cap));
  const int64_t most = std::min<int64_t>({(int64_t)kMaxSplits, max_by_memory,
                                          std::max<int64_t>(need, ceil_div(maxctx, min_split))});
  if (need > most) return -1;
  const int64_t forced = kernel_tuning().decode_splits;  // tuning override (tests: the merge path)
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
bool launch(DecodeParams P, const Tensor& q, int64_t maxctx, int64_t split_cap, bool fixed_min_split,
            cudaStream_t stream) {
  const int64_t rows = P.T * P.Hk;
  // Very few rows over a long table: the grid is about one CTA an SM either way, and a deeper
  // pipeline (three chunks in flight a warp) beats a second CTA an SM with more, shorter splits
  // (H100, batch 1, 32k keys: 0.79 -> 0.82 of copy bandwidth; no gain at 4k-8k keys or batch 8).
  // Not for fp8 caches: there 3 stages did better (batch 2, 16k / 32k keys: 0.67 / 0.78 with 4,
  // 0.71 / 0.82 with 3).
  const bool deep = sizeof(C) == 2 && rows * 8 <= sm_count() && maxctx >= kDeepMinContext;
  // Groups of up to 8 query heads run S^T = K Q^T and O^T = V^T P^T (the narrow kernel: heads are the
  // mma's 8 columns, not 16 rows): half the mmas, exponentials and O registers of the wide kernel.
  // (The switch back to the wide kernel for those, TALLOW_DECODE_NARROW, was removed: cuda/README.md.)
  const KernelTuning& tune = kernel_tuning();
  const bool narrow = P.G <= 8;
  const int want_stages =
      tune.decode_stages > 0 ? (int)tune.decode_stages : (deep ? kMaxStages : kDefaultStages);
  const KernelFit fit = narrow ? kernel_fit<Q, C, D, true>(want_stages) : kernel_fit<Q, C, D, false>(want_stages);
  if (fit.stages < 1) return false;
  const int64_t slots = (int64_t)fit.per_sm * sm_count();
  const int64_t per_split = P.T * P.Hq * (D + 2) * (int64_t)sizeof(float);
  // Many (token, kv head) rows (at least one an SM: 17+ sequences of 8 kv heads on an H100) already give
  // every SM CTAs: there a sequence splits only past kManyRowsMinSplit keys, and the grid is planned
  // with that length, sparing split merges. Measured on the nano-vllm run (H100, four A/B pairs in one
  // call, `gpu_e2e.py --target nanovllm`): 19,969 vs 19,746 tok/s on average, every pair up; batch 32-64
  // at 4k-32k keys unchanged (0.98-1.01 of copy bandwidth). Before: 256 keys from one row an SM, 1024
  // from four.
  if (!fixed_min_split && rows >= sm_count())
    P.min_split = (int)std::min<int64_t>(std::max<int>(P.min_split, kManyRowsMinSplit), split_cap);
  const int64_t n = choose_splits(rows, maxctx, slots, P.min_split, split_cap,
                                  std::max<int64_t>(1, kMaxPartialBytes / per_split));
  if (n < 1) return false;  // a long context over a huge batch: the scratch would not be small
  P.nsplit = (int)n;
  // Few rows leave most SMs idle with one split per row: there a sequence cuts its range into splits of
  // kFewRowsMinSplit keys (still at most n), so a short context spreads over more CTAs, each with a
  // short serial chain (B = 1, 256 keys: 4 CTAs a head, not 1).
  if (!fixed_min_split && rows < sm_count()) P.min_split = std::min<int>(P.min_split, kFewRowsMinSplit);
  P.stages = fit.stages;
  Tensor scratch, counters;
  if (n > 1) {
    scratch = Tensor::empty({P.T * P.Hq * n * (D + 2)}, DType::F32, q.device());
    P.part_o = static_cast<float*>(scratch.data_ptr());
    P.part_ml = P.part_o + P.T * P.Hq * n * D;
  }
  P.counters = split_counters(rows, n > 1, q, stream, counters);
  static bool no_pdl[64] = {};  // set when the driver refused the attribute once
  const int dev = current_dev();
  // PDL (sm_90): the metadata read before the wait (rechecked after it), with settled_cache the first
  // chunks too, and the next launch triggered right after the wait. KernelTuning::decode_pdl off gives
  // the plain launch of older devices (tests); the intermediate modes of TALLOW_DECODE_PDL (1: wait
  // before any read, 2: no early cache copies or trigger) were removed, measured slower.
  const bool pdl = tune.decode_pdl && compute_major() >= 9 && !no_pdl[dev];
  P.early = pdl;
  P.early_kv = P.early && P.early_kv;  // settled_cache, when the metadata is read early too
  P.early_trigger = pdl;
  P.early_ctas = (int)std::min<int64_t>(slots, INT32_MAX);
  // Filling every slot in the prologue pays where few rows leave the stream short (batch 1-8); with
  // many rows it measured 0.3% slower on the nano-vllm run (two pairs). KernelTuning::decode_fill forces
  // it (tests: both sides for one shape).
  P.fill = tune.decode_fill >= 0 ? tune.decode_fill != 0 : rows < sm_count();
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3((unsigned)n, (unsigned)P.Hk, (unsigned)P.B);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = fit.smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  auto kernel = narrow ? decode_kernel<Q, C, D, true> : decode_kernel<Q, C, D, false>;
  cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, P);
  if (err != cudaSuccess && pdl && !is_capturing(stream)) {  // an old driver: a plain launch from now on
    (void)cudaGetLastError();
    no_pdl[dev] = true;
    cfg.numAttrs = 0;
    P.early = P.early_kv = P.early_trigger = 0;
    err = cudaLaunchKernelEx(&cfg, kernel, P);
  }
  TALLOW_CUDA_CHECK("paged_attention", err);
  TALLOW_CUDA_CHECK_LAUNCH("paged_attention");
  return true;
}

template <class Q, class C>
bool launch_d(int64_t D, const DecodeParams& P, const Tensor& q, int64_t maxctx, int64_t split_cap, bool fixed,
              cudaStream_t stream) {
  switch (D) {
    case 64: return launch<Q, C, 64>(P, q, maxctx, split_cap, fixed, stream);
    case 80: return launch<Q, C, 80>(P, q, maxctx, split_cap, fixed, stream);
    case 96: return launch<Q, C, 96>(P, q, maxctx, split_cap, fixed, stream);
    case 128: return launch<Q, C, 128>(P, q, maxctx, split_cap, fixed, stream);
    default: return launch<Q, C, 256>(P, q, maxctx, split_cap, fixed, stream);
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
                            float scale, int64_t sliding_window, float softcap, float k_scale, float v_scale,
                            bool settled_cache) {
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), B = seq_lens.size(0);
  const int64_t NB = k_cache.size(0), BS = k_cache.size(1), Hk = k_cache.size(2), max_blocks = block_tables.size(1);
  const DType qd = q.dtype(), cd = k_cache.dtype();
  if (T != B || T <= 0 || B > 65535 || Hk <= 0 || Hk > 65535) return false;
  if (qd != DType::F16 && qd != DType::BF16) return false;
  if ((cd != qd && cd != DType::F8E4M3) || v_cache.dtype() != cd) return false;
  if (D != 64 && D != 80 && D != 96 && D != 128 && D != 256) return false;
  if (v_cache.size(3) != D || Hq % Hk != 0 || Hq / Hk > kMaxGroup) return false;
  if (BS <= 0 || BS > (1 << 20) || (BS & (BS - 1)) != 0 || NB > INT32_MAX) return false;
  for (const Tensor* t : {&block_tables, &seq_lens, &query_start_loc})
    if (t->dtype() != DType::I32) return false;
  if (!rows_aligned(k_cache) || !rows_aligned(v_cache) || !aligned_to(out.data_ptr(), 16) || !out.is_contiguous())
    return false;
  if (q.stride(2) != 1 && D > 1) return false;
  if (k_cache.stride(1) > INT32_MAX / BS || v_cache.stride(1) > INT32_MAX / BS) return false;  // ksr32, vsr32
  if (compute_major() < 8) return false;

  int bs_shift = 0;
  while ((int64_t(1) << bs_shift) < BS) ++bs_shift;
  const int64_t maxctx = max_blocks * BS;
  const int64_t split_cap = std::max<int64_t>(kTile, (kMaxTable - 2) * BS / kTile * kTile);
  // KernelTuning::decode_min_split (a tuning override) fixes the minimum split of every launch, or of
  // launches with decode_min_split_rows_lo <= T * Hk < decode_min_split_rows_hi rows only; the others
  // keep the planner's values (launch()).
  int64_t min_split = kDefaultMinSplit;
  bool fixed_min_split = false;
  if (const KernelTuning& tune = kernel_tuning(); tune.decode_min_split > 0) {
    if (T * Hk >= tune.decode_min_split_rows_lo && T * Hk < tune.decode_min_split_rows_hi)
      min_split = tune.decode_min_split, fixed_min_split = true;
  }
  min_split = std::clamp<int64_t>(min_split / kTile * kTile, kTile, split_cap);
  if (ceil_div(maxctx, split_cap) > kMaxSplits) return false;  // contexts past ~kMaxSplits * split_cap
  if (maxctx >= (int64_t(1) << 30)) return false;                // 32-bit split arithmetic on the device

  const bool f8 = cd == DType::F8E4M3;
  const float qk_scale = f8 ? scale * k_scale : scale;
  DecodeParams P{};
  P.q = q.data_ptr();
  P.qst = q.stride(0);
  P.qsh = q.stride(1);
  P.k = k_cache.data_ptr();
  P.v = v_cache.data_ptr();
  P.ksb = k_cache.stride(0), P.ksr = k_cache.stride(1), P.ksh = k_cache.stride(2);
  P.vsb = v_cache.stride(0), P.vsr = v_cache.stride(1), P.vsh = v_cache.stride(2);
  P.ksr32 = (int)P.ksr, P.vsr32 = (int)P.vsr;
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
  P.score_scale = softcap > 0.f ? qk_scale / softcap : qk_scale * kLog2e;
  P.softcap_log2 = softcap > 0.f ? softcap * kLog2e : 0.f;
  P.out_scale = f8 ? v_scale : 1.0f;
  P.early_kv = settled_cache;

  OpContext ctx(q);
  if (qd == DType::BF16)
    return f8 ? launch_d<__nv_bfloat16, Fp8>(D, P, q, maxctx, split_cap, fixed_min_split, ctx.stream)
              : launch_d<__nv_bfloat16, __nv_bfloat16>(D, P, q, maxctx, split_cap, fixed_min_split, ctx.stream);
  return f8 ? launch_d<__half, Fp8>(D, P, q, maxctx, split_cap, fixed_min_split, ctx.stream)
            : launch_d<__half, __half>(D, P, q, maxctx, split_cap, fixed_min_split, ctx.stream);
}

}  // namespace tallow::cuda
