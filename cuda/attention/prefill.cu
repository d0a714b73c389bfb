// Paged prefill attention on tensor cores (contract in prefill.cuh and cpp/ops/paged_attention.h).
//
// FlashAttention-2 tiling. A CTA of 4 warps takes one query head and a tile of BM = 64 * kMRep
// query rows of one sequence; each warp owns 16 * kMRep rows. It walks the key tiles (BN keys) the
// query tile can see, gathered row by row from the paged cache through the block table:
//   S = Q K^T  mma.sync m16n8k16 with f32 accumulators; Q and K fragments by ldmatrix from smem
//   online softmax in registers, base 2 (scale * log2(e) folded into one multiply), P rounded to 16 bits
//   O += P V   V fragments by ldmatrix.trans
// K/V tiles are double-buffered with 16-byte cp.async into padded smem rows: a row holds D + 8
// elements, an odd number of 16-byte units, so the 8 row addresses of an ldmatrix hit distinct banks.
// FP8 caches: the bytes are cp.async'ed into a raw buffer, then converted to q's 16-bit type in smem
// (exact: every e4m3 value is an f16 and a bf16); k_scale folds into the score scale and v_scale into
// the final normalisation, so no extra rounding is added.
//
// Grid: (T / BM + B) query tiles x Hq heads, with no host knowledge of the sequence lengths (safe
// under graph capture). Sequence b owns tiles [qsl[b] / BM + b, qsl[b + 1] / BM + b + 1): at least
// ceil(n_b / BM) tiles, ending where b + 1's begin and the last ending at T / BM + B. A tile finds
// its sequence by binary search; surplus tiles exit at once. Tiles run in reverse order (a sequence's
// last, longest causal tiles first) with heads fastest (the q heads of a kv group share K/V in L2).
//
// Key range of a query tile: [lo, hi), hi = last query's position + 1, lo = the first query's window
// start (0 without a window). Only blocks holding keys of [lo, hi) are read (other rows of a key tile
// are zero-filled and masked), so table entries past a sequence or wholly before its window are
// never touched. A warp skips key tiles none of its rows can see and masks only tiles that cut its
// rows' ranges. Block ids outside [0, num_blocks) are not read and their keys are left out.
#include <cuda_fp8.h>

#include <algorithm>
#include <initializer_list>
#include <type_traits>

#include "attention/prefill.cuh"
#include "attention/ptx.cuh"
#include "launch.cuh"

namespace tallow::cuda {

namespace {

constexpr int kThreads = 128;  // 4 warps
constexpr float kLog2e = 1.4426950408889634f;

// Tile shape per head dim. kMRep = 2 (BM = 128, 32 rows per warp) halves the K/V fragment loads
// per mma; D = 256 keeps BM = 64 and BN = 32 for registers (O alone is D / 2 floats per m16 tile).
// ptxas (sm_90) gives every variant ~255 registers (2 CTAs per SM); D = 96 and 128 spill 50-90
// bytes of loop scalars (BN = 32 removes that, at twice the softmax bookkeeping per key).
template <int D>
struct TileShape {
  static constexpr int kMRep = D <= 128 ? 2 : 1;
  static constexpr int BM = 64 * kMRep;
  static constexpr int BN = D <= 128 ? 64 : 32;
};

constexpr size_t align16(size_t n) { return (n + 15) / 16 * 16; }

// Shared memory layout (bytes). FP8 caches use one 16-bit K/V buffer fed from double-buffered raw bytes.
template <int D, bool kF8>
struct Smem {
  static constexpr int BM = TileShape<D>::BM, BN = TileShape<D>::BN, ST = D + 8;
  static constexpr int kStages = kF8 ? 1 : 2;
  static constexpr size_t kKoff = 0;                                     // int64 [3][BN]: K row offsets, -1 = none
  static constexpr size_t kVoff = kKoff + 3 * BN * 8;                    // int64 [3][BN]
  static constexpr size_t kBad = kVoff + 3 * BN * 8;                     // u32 [3][BN / 32]: keys with bad block ids
  static constexpr size_t kQ = align16(kBad + 3 * (BN / 32) * 4);        // 16-bit [BM][ST]
  static constexpr size_t kK = kQ + (size_t)BM * ST * 2;                 // 16-bit [kStages][BN][ST]
  static constexpr size_t kV = kK + (size_t)kStages * BN * ST * 2;       // 16-bit [kStages][BN][ST]
  static constexpr size_t kRaw = kV + (size_t)kStages * BN * ST * 2;     // fp8: K [2][BN][D], V [2][BN][D]
  static constexpr size_t kBytes = kRaw + (kF8 ? (size_t)4 * BN * D : 0);
};

struct PrefillParams {
  const void* q;
  int64_t q_st, q_sh;
  const void* k;
  int64_t k_sb, k_sr, k_sh;
  const void* v;
  int64_t v_sb, v_sr, v_sh;
  const int32_t* bt;
  int64_t bt_s0, bt_s1;
  const int32_t* seq_lens;
  int64_t sl_s;
  const int32_t* qsl;
  int64_t qsl_s;
  void* out;  // contiguous [T, Hq, D]
  int64_t num_blocks;
  int T, B, Hq, group, max_blocks, bs_log2, num_tiles, window;
  float score_scale;  // scale * k_scale * log2(e) (no softcap)
  float cap_in;       // scale * k_scale / softcap
  float cap_out;      // softcap * log2(e); 0 = no softcap
  float out_scale;    // v_scale
};

// ---- PTX wrappers (sm_80+) ------------------------------------------------------------------------

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ float ex2(float x) {  // 2^x; ex2(-inf) = 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Two e4m3 bytes (lo byte first) -> two T, exactly.
template <class T>
__device__ __forceinline__ uint32_t f8x2_to(uint32_t two) {
  const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)two, __NV_E4M3);
  if constexpr (std::is_same_v<T, __half>) {
    return (uint32_t)r.x | ((uint32_t)r.y << 16);
  } else {
    const float2 f = __half22float2(__half2(r));
    return pack2<__nv_bfloat16>(f.x, f.y);
  }
}

// 16 e4m3 bytes at src (smem) -> 16 T at dst (smem).
template <class T>
__device__ __forceinline__ void f8x16_to(const uint8_t* src, T* dst) {
  const uint4 w = *reinterpret_cast<const uint4*>(src);
  const uint32_t in[4] = {w.x, w.y, w.z, w.w};
  uint32_t o[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    o[2 * i] = f8x2_to<T>(in[i] & 0xffffu);
    o[2 * i + 1] = f8x2_to<T>(in[i] >> 16);
  }
  reinterpret_cast<uint4*>(dst)[0] = make_uint4(o[0], o[1], o[2], o[3]);
  reinterpret_cast<uint4*>(dst)[1] = make_uint4(o[4], o[5], o[6], o[7]);
}

// f(idx) for idx = tid, tid + kThreads, ... < N, unrolled (N is a compile-time count).
template <int N, class F>
__device__ __forceinline__ void for_chunks(int tid, F&& f) {
#pragma unroll
  for (int i = 0; i < (N + kThreads - 1) / kThreads; ++i) {
    const int idx = tid + i * kThreads;
    if (N % kThreads == 0 || idx < N) f(idx);
  }
}

// ---- the kernel -----------------------------------------------------------------------------------

// T: q/out and mma type (__half / __nv_bfloat16); C: cache element (T, or uint8_t for e4m3).
template <class T, class C, int D>
__global__ void __launch_bounds__(kThreads) prefill_kernel(const PrefillParams P) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr bool kF8 = sizeof(C) == 1;
  using L = Smem<D, kF8>;
  constexpr int MR = TileShape<D>::kMRep, BM = L::BM, BN = L::BN, ST = L::ST;
  constexpr int NT = D / 8;   // 8-wide column tiles of O
  constexpr int SN = BN / 8;  // 8-wide column tiles of S
  constexpr int CPR = D / 8;  // 16-byte chunks per 16-bit row
  static_assert(D % 16 == 0 && BN % 32 == 0 && BN <= kThreads, "tile shape");

  extern __shared__ __align__(16) unsigned char smem[];
  int64_t* s_koff = reinterpret_cast<int64_t*>(smem + L::kKoff);
  int64_t* s_voff = reinterpret_cast<int64_t*>(smem + L::kVoff);
  uint32_t* s_bad = reinterpret_cast<uint32_t*>(smem + L::kBad);
  T* sQ = reinterpret_cast<T*>(smem + L::kQ);
  T* sK = reinterpret_cast<T*>(smem + L::kK);
  T* sV = reinterpret_cast<T*>(smem + L::kV);
  uint8_t* sRaw = smem + L::kRaw;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;  // mma fragment row group and column pair
  const int h = (int)(blockIdx.x % (unsigned)P.Hq);
  const int tile = P.num_tiles - 1 - (int)(blockIdx.x / (unsigned)P.Hq);

  // The sequence of this tile: the last b whose first tile qsl[b] / BM + b is <= tile.
  int b = 0;
  {
    int lo = 0, hi = P.B - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if ((int64_t)P.qsl[mid * P.qsl_s] / BM + mid <= tile) lo = mid;
      else hi = mid - 1;
    }
    b = lo;
  }
  const int64_t q0 = P.qsl[b * P.qsl_s], n_b = (int64_t)P.qsl[(b + 1) * P.qsl_s] - q0;
  const int64_t row0 = (tile - (q0 / BM + b)) * (int64_t)BM;  // the tile's first query within the sequence
  if (row0 < 0 || row0 >= n_b || q0 < 0 || q0 + row0 >= P.T) return;  // surplus tile (or bad input)
  const int r0 = (int)(q0 + row0);                                      // its first row of q / out
  const int m_count = (int)min((int64_t)BM, min(n_b - row0, (int64_t)P.T - r0));
  const int seq_len = P.seq_lens[b * P.sl_s];
  const int64_t p0l = (int64_t)seq_len - n_b + row0;  // position of the first query
  const int p0 = (int)max(p0l, (int64_t)0);
  const int p_last = p0 + m_count - 1;
  int hi_k = min(p_last + 1, seq_len);
  const int lo_k = P.window > 0 ? max(0, p0 - P.window + 1) : 0;
  if (hi_k < lo_k || p0l < 0) hi_k = lo_k;  // p0l < 0: n_b > seq_len, nothing is visible
  const int n_first = lo_k / BN;
  const int ntiles = (hi_k + BN - 1) / BN - n_first;
  const int kh = h / P.group;

  // This warp's rows: [wr0, wr0 + wcount) of the tile, positions [pw_min, pw_max].
  const int wr0 = warp * 16 * MR;
  const int wcount = min(max(m_count - wr0, 0), 16 * MR);
  const int pw_min = p0 + wr0, pw_max = p0 + wr0 + wcount - 1;

  // Key rows of tile n: thread tid < BN resolves key n * BN + tid through the block table.
  auto in_range = [&](int n) { return n * BN + tid >= lo_k && n * BN + tid < hi_k; };
  auto fetch_block = [&](int n) -> int {  // the table entry, or -1 when not in range or past the table
    const int j = n * BN + tid, bi = j >> P.bs_log2;
    return in_range(n) && bi < P.max_blocks ? __ldg(P.bt + b * P.bt_s0 + bi * P.bt_s1) : -1;
  };
  auto put_block = [&](int n, int slot, int blk) {
    const int j = n * BN + tid;
    const bool ok = in_range(n) && blk >= 0 && blk < P.num_blocks;
    const int64_t row = j & ((1 << P.bs_log2) - 1);
    s_koff[slot * BN + tid] = ok ? (int64_t)blk * P.k_sb + row * P.k_sr + kh * P.k_sh : -1;
    s_voff[slot * BN + tid] = ok ? (int64_t)blk * P.v_sb + row * P.v_sr + kh * P.v_sh : -1;
    const unsigned bad = __ballot_sync(0xffffffffu, in_range(n) && !ok);  // tid < BN: whole warps
    if (lane == 0) s_bad[slot * (BN / 32) + warp] = bad;
  };
  // Start the loads of one key tile into `stage` (16-bit: straight into sK/sV; fp8: raw bytes).
  auto issue = [&](int slot, int stage) {
    const int64_t* ko = s_koff + slot * BN;
    const int64_t* vo = s_voff + slot * BN;
    if constexpr (!kF8) {
      const T* kb = static_cast<const T*>(P.k);
      const T* vb = static_cast<const T*>(P.v);
      T* dk = sK + stage * BN * ST;
      T* dv = sV + stage * BN * ST;
      for_chunks<BN * CPR>(tid, [&](int idx) {
        const int r = idx / CPR, c = idx % CPR;
        const int64_t a = ko[r], e = vo[r];
        cp_async16(smem_addr(dk + r * ST + c * 8), a >= 0 ? kb + a + c * 8 : kb, a >= 0);
        cp_async16(smem_addr(dv + r * ST + c * 8), e >= 0 ? vb + e + c * 8 : vb, e >= 0);
      });
    } else {
      constexpr int CPR8 = D / 16;
      const uint8_t* kb = static_cast<const uint8_t*>(P.k);
      const uint8_t* vb = static_cast<const uint8_t*>(P.v);
      uint8_t* dk = sRaw + stage * BN * D;
      uint8_t* dv = sRaw + (2 + stage) * BN * D;
      for_chunks<BN * CPR8>(tid, [&](int idx) {
        const int r = idx / CPR8, c = idx % CPR8;
        const int64_t a = ko[r], e = vo[r];
        cp_async16(smem_addr(dk + r * D + c * 16), a >= 0 ? kb + a + c * 16 : kb, a >= 0);
        cp_async16(smem_addr(dv + r * D + c * 16), e >= 0 ? vb + e + c * 16 : vb, e >= 0);
      });
    }
  };

  // Prologue: block rows of the first two key tiles, Q and the first key tile in flight.
  if (tid < BN) {
    const int b0 = ntiles > 0 ? fetch_block(n_first) : -1;
    const int b1 = ntiles > 1 ? fetch_block(n_first + 1) : -1;
    if (ntiles > 0) put_block(n_first, 0, b0);
    if (ntiles > 1) put_block(n_first + 1, 1, b1);
  }
  {
    const T* qb = static_cast<const T*>(P.q) + (int64_t)r0 * P.q_st + (int64_t)h * P.q_sh;
    for_chunks<BM * CPR>(tid, [&](int idx) {
      const int r = idx / CPR, c = idx % CPR;
      const bool ok = r < m_count;
      cp_async16(smem_addr(sQ + r * ST + c * 8), ok ? qb + r * P.q_st + c * 8 : qb, ok);
    });
  }
  __syncthreads();  // block rows visible
  if (ntiles > 0) issue(0, 0);
  cp_async_commit();

  float o[MR][NT][4];
  float row_m[MR][2], row_l[MR][2];
#pragma unroll
  for (int mi = 0; mi < MR; ++mi) {
#pragma unroll
    for (int dn = 0; dn < NT; ++dn) o[mi][dn][0] = o[mi][dn][1] = o[mi][dn][2] = o[mi][dn][3] = 0.f;
    row_m[mi][0] = row_m[mi][1] = -INFINITY;
    row_l[mi][0] = row_l[mi][1] = 0.f;
  }

  // ldmatrix addresses of this lane (bytes); tile offsets below are compile-time immediates.
  const uint32_t q_addr = smem_addr(sQ) + ((wr0 + (lane & 15)) * ST + (lane >> 4) * 8) * 2;
  const uint32_t k_addr0 = smem_addr(sK) + (((lane & 7) + ((lane >> 4) << 3)) * ST + ((lane >> 3) & 1) * 8) * 2;
  const uint32_t v_addr0 = smem_addr(sV) + ((lane & 15) * ST + (lane >> 4) * 8) * 2;

  int slot = 0;  // it % 3: block rows of tile it
  for (int it = 0; it < ntiles; ++it) {
    // Tile it has landed; every warp is done with tile it - 1 (its buffers and block rows are free).
    cp_async_wait<0>();
    __syncthreads();
    const int slot1 = slot == 2 ? 0 : slot + 1, slot2 = slot1 == 2 ? 0 : slot1 + 1;
    if (it + 1 < ntiles) issue(slot1, (it + 1) & 1);
    cp_async_commit();
    // Table entries of tile it + 2, read now and stored after the math (their latency is hidden).
    const int blk2 = (it + 2 < ntiles && tid < BN) ? fetch_block(n_first + it + 2) : -1;
    uint32_t k_addr = k_addr0, v_addr = v_addr0;
    if constexpr (kF8) {
      // Raw tile it -> 16-bit sK/sV (free: every warp passed the barrier above after tile it - 1).
      constexpr int CPR8 = D / 16;
      const uint8_t* rk = sRaw + (it & 1) * BN * D;
      const uint8_t* rv = sRaw + (2 + (it & 1)) * BN * D;
      for_chunks<BN * CPR8>(tid, [&](int idx) {
        const int r = idx / CPR8, c = idx % CPR8;
        f8x16_to<T>(rk + r * D + c * 16, sK + r * ST + c * 16);
        f8x16_to<T>(rv + r * D + c * 16, sV + r * ST + c * 16);
      });
      __syncthreads();
    } else {
      k_addr += (it & 1) * BN * ST * 2;
      v_addr += (it & 1) * BN * ST * 2;
    }

    const int ks = (n_first + it) * BN;  // first key of the tile
    const bool visible = wcount > 0 && ks <= pw_max && !(P.window > 0 && ks + BN - 1 <= pw_min - P.window);
    if (visible) {
      // S = Q K^T for the warp's rows and the tile's BN keys.
      float s[MR][SN][4];
#pragma unroll
      for (int mi = 0; mi < MR; ++mi)
#pragma unroll
        for (int ni = 0; ni < SN; ++ni) s[mi][ni][0] = s[mi][ni][1] = s[mi][ni][2] = s[mi][ni][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[MR][4];
#pragma unroll
        for (int mi = 0; mi < MR; ++mi)
          ldmatrix_x4(a[mi], q_addr + (mi * 16 * ST + kk * 16) * 2);
#pragma unroll
        for (int np = 0; np < BN / 16; ++np) {
          uint32_t bk[4];
          ldmatrix_x4(bk, k_addr + (np * 16 * ST + kk * 16) * 2);
#pragma unroll
          for (int mi = 0; mi < MR; ++mi) {
            mma16816<T>(s[mi][2 * np], a[mi], bk[0], bk[1]);
            mma16816<T>(s[mi][2 * np + 1], a[mi], bk[2], bk[3]);
          }
        }
      }
      // Scores in base 2 (softcap first), then the mask where the tile cuts a row's range.
      if (P.cap_out > 0.f) {
#pragma unroll
        for (int mi = 0; mi < MR; ++mi)
#pragma unroll
          for (int ni = 0; ni < SN; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              // tanh(y) = 1 - 2 / (1 + e^2y); |y| <= 15 keeps e^2y finite (tanh(15) rounds to 1).
              const float y = fminf(fmaxf(s[mi][ni][e] * P.cap_in, -15.f), 15.f);
              const float th = 1.f - __fdividef(2.f, 1.f + ex2(y * (2.f * kLog2e)));
              s[mi][ni][e] = P.cap_out * th;
            }
      } else {
#pragma unroll
        for (int mi = 0; mi < MR; ++mi)
#pragma unroll
          for (int ni = 0; ni < SN; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[mi][ni][e] *= P.score_scale;
      }
      const uint32_t bad_lo = s_bad[slot * (BN / 32)];
      uint32_t bad_hi = 0u;
      if constexpr (BN > 32) bad_hi = s_bad[slot * (BN / 32) + 1];
      if (ks + BN - 1 > pw_min || (P.window > 0 && ks <= pw_max - P.window) || (bad_lo | bad_hi) != 0u) {
#pragma unroll
        for (int mi = 0; mi < MR; ++mi)
#pragma unroll
          for (int hr = 0; hr < 2; ++hr) {
            // Row position p sees keys (lim, p]; lim = -1 without a window.
            const int p = pw_min + mi * 16 + hr * 8 + g, lim = P.window > 0 ? p - P.window : -1;
#pragma unroll
            for (int ni = 0; ni < SN; ++ni)
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const int col = ni * 8 + 2 * t4 + e, j = ks + col;
                const uint32_t bad = ((ni < 4 ? bad_lo : bad_hi) >> (col & 31)) & 1u;  // ni < 4: col < 32
                if (j > p || j <= lim || bad) s[mi][ni][2 * hr + e] = -INFINITY;
              }
          }
      }
      // Online softmax: a row lives in the 4 threads of a quad (t4); l stays per thread until the end.
      float corr[MR][2];
      bool rescale = false;
#pragma unroll
      for (int mi = 0; mi < MR; ++mi)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          float mx = -INFINITY;
#pragma unroll
          for (int ni = 0; ni < SN; ++ni) mx = fmaxf(mx, fmaxf(s[mi][ni][2 * hr], s[mi][ni][2 * hr + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float m_new = fmaxf(row_m[mi][hr], mx);
          const float m_use = m_new == -INFINITY ? 0.f : m_new;  // a row that sees nothing yet: no NaN
          corr[mi][hr] = ex2(row_m[mi][hr] - m_use);
          rescale = rescale || corr[mi][hr] != 1.f;
          row_m[mi][hr] = m_new;
          float sum = 0.f;
#pragma unroll
          for (int ni = 0; ni < SN; ++ni) {
            s[mi][ni][2 * hr] = ex2(s[mi][ni][2 * hr] - m_use);
            s[mi][ni][2 * hr + 1] = ex2(s[mi][ni][2 * hr + 1] - m_use);
            sum += s[mi][ni][2 * hr] + s[mi][ni][2 * hr + 1];
          }
          row_l[mi][hr] = row_l[mi][hr] * corr[mi][hr] + sum;
        }
      if (__any_sync(0xffffffffu, rescale)) {  // once the row maxima settle, most tiles skip this
#pragma unroll
        for (int mi = 0; mi < MR; ++mi)
#pragma unroll
          for (int dn = 0; dn < NT; ++dn)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[mi][dn][e] *= corr[mi][e >> 1];
      }
      // O += P V: the S accumulators of key columns 16kk..16kk+15 are P's A fragment.
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        uint32_t pa[MR][4];
#pragma unroll
        for (int mi = 0; mi < MR; ++mi) {
          pa[mi][0] = pack2<T>(s[mi][2 * kk][0], s[mi][2 * kk][1]);
          pa[mi][1] = pack2<T>(s[mi][2 * kk][2], s[mi][2 * kk][3]);
          pa[mi][2] = pack2<T>(s[mi][2 * kk + 1][0], s[mi][2 * kk + 1][1]);
          pa[mi][3] = pack2<T>(s[mi][2 * kk + 1][2], s[mi][2 * kk + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          uint32_t bv[4];
          ldmatrix_x4_trans(bv, v_addr + (kk * 16 * ST + dp * 16) * 2);
#pragma unroll
          for (int mi = 0; mi < MR; ++mi) {
            mma16816<T>(o[mi][2 * dp], pa[mi], bv[0], bv[1]);
            mma16816<T>(o[mi][2 * dp + 1], pa[mi], bv[2], bv[3]);
          }
        }
      }
    }
    if (it + 2 < ntiles && tid < BN) put_block(n_first + it + 2, slot2, blk2);
    slot = slot1;
  }
  cp_async_wait<0>();
  if (ntiles == 0) __syncthreads();  // Q's loads (by any thread) are done before sQ is reused below
  if (wcount == 0) return;

  // Normalise, round once, stage the warp's rows in its own (no longer needed) rows of sQ and
  // write them out in 16-byte pieces.
  __syncwarp();
#pragma unroll
  for (int mi = 0; mi < MR; ++mi)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float l = row_l[mi][hr];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const float inv = l > 0.f ? P.out_scale / l : 0.f;
      T* dst = sQ + (wr0 + mi * 16 + hr * 8 + g) * ST + 2 * t4;
#pragma unroll
      for (int dn = 0; dn < NT; ++dn)
        *reinterpret_cast<uint32_t*>(dst + dn * 8) = pack2<T>(o[mi][dn][2 * hr] * inv, o[mi][dn][2 * hr + 1] * inv);
    }
  __syncwarp();
  T* out = static_cast<T*>(P.out);
  for (int idx = lane; idx < wcount * CPR; idx += 32) {
    const int r = idx / CPR, c = idx % CPR;
    *reinterpret_cast<uint4*>(out + ((int64_t)(r0 + wr0 + r) * P.Hq + h) * D + c * 8) =
        *reinterpret_cast<const uint4*>(sQ + (wr0 + r) * ST + c * 8);
  }
#endif
}

// ---- host side ------------------------------------------------------------------------------------

// Compute capability major and opt-in shared memory per block of a device (cached; 0 if unknown).
struct DeviceLimits {
  int cc_major = 0, smem_optin = 0;
};
DeviceLimits device_limits(int dev) {
  static DeviceLimits cache[64];
  static bool known[64] = {};
  if (dev >= 0 && dev < 64 && known[dev]) return cache[dev];
  DeviceLimits d;
  if (cudaDeviceGetAttribute(&d.cc_major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&d.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return {};
  }
  if (dev >= 0 && dev < 64) {
    cache[dev] = d;
    known[dev] = true;
  }
  return d;
}

template <class T, class C, int D>
bool launch(PrefillParams P, cudaStream_t stream, int dev) {
  using L = Smem<D, sizeof(C) == 1>;
  constexpr int BM = L::BM;
  const int64_t tiles = (int64_t)P.T / BM + P.B;
  if (tiles * P.Hq > INT32_MAX) return false;
  if ((size_t)device_limits(dev).smem_optin < L::kBytes) return false;
  P.num_tiles = (int)tiles;
  auto kernel = prefill_kernel<T, C, D>;
  TALLOW_CUDA_CHECK("paged_attention",
                    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)L::kBytes));
  kernel<<<(unsigned)(tiles * P.Hq), kThreads, L::kBytes, stream>>>(P);
  TALLOW_CUDA_CHECK_LAUNCH("paged_attention");
  return true;
}

template <class T, class C>
bool launch_d(int64_t D, const PrefillParams& P, cudaStream_t stream, int dev) {
  switch (D) {
    case 64: return launch<T, C, 64>(P, stream, dev);
    case 80: return launch<T, C, 80>(P, stream, dev);
    case 96: return launch<T, C, 96>(P, stream, dev);
    case 128: return launch<T, C, 128>(P, stream, dev);
    case 256: return launch<T, C, 256>(P, stream, dev);
    default: return false;
  }
}

bool aligned16_strides(const Tensor& t, std::initializer_list<int> dims) {
  if (!aligned_to(t.data_ptr(), 16)) return false;
  for (int d : dims)
    if ((t.stride(d) * t.element_size()) % 16 != 0) return false;
  return true;
}

}  // namespace

bool paged_prefill_attention(const Tensor& out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                             const Tensor& block_tables, const Tensor& seq_lens, const Tensor& query_start_loc,
                             float scale, int64_t sliding_window, float softcap, float k_scale, float v_scale) {
  // Shapes, dtypes and layouts this kernel takes; anything else goes to the fallback.
  if (q.dim() != 3 || k_cache.dim() != 4 || v_cache.dim() != 4 || out.dim() != 3) return false;
  if (block_tables.dim() != 2 || seq_lens.dim() != 1 || query_start_loc.dim() != 1) return false;
  const DType qt = q.dtype(), ct = k_cache.dtype();
  if (qt != DType::F16 && qt != DType::BF16) return false;
  if (out.dtype() != qt || v_cache.dtype() != ct || (ct != qt && ct != DType::F8E4M3)) return false;
  for (const Tensor* t : {&block_tables, &seq_lens, &query_start_loc})
    if (t->dtype() != DType::I32) return false;
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t NB = std::min(k_cache.size(0), v_cache.size(0)), BS = k_cache.size(1), Hk = k_cache.size(2);
  const int64_t B = seq_lens.size(0);
  if (D != 64 && D != 80 && D != 96 && D != 128 && D != 256) return false;
  if (k_cache.size(3) != D || v_cache.size(3) != D || v_cache.size(1) != BS || v_cache.size(2) != Hk) return false;
  if (out.shape() != Shape{T, Hq, D} || !out.is_contiguous()) return false;
  if (BS < 8 || (BS & (BS - 1)) != 0 || Hk < 1 || Hq % Hk != 0) return false;
  if (B < 1 || query_start_loc.size(0) != B + 1 || block_tables.size(0) < B) return false;
  if (T >= INT32_MAX || Hq >= INT32_MAX || block_tables.size(1) >= INT32_MAX) return false;
  if (q.stride(2) != 1 || k_cache.stride(3) != 1 || v_cache.stride(3) != 1) return false;
  if (!aligned16_strides(q, {0, 1}) || !aligned16_strides(k_cache, {0, 1, 2}) ||
      !aligned16_strides(v_cache, {0, 1, 2}) || !aligned_to(out.data_ptr(), 16))
    return false;
  const Device dev = q.device();
  if (dev.is_cpu()) return false;
  for (const Tensor* t : {&out, &k_cache, &v_cache, &block_tables, &seq_lens, &query_start_loc})
    if (t->device() != dev) return false;
  if (device_limits(dev.index).cc_major < 8) return false;
  if (T == 0 || Hq == 0) return true;

  int bs_log2 = 0;
  while ((int64_t{1} << bs_log2) < BS) ++bs_log2;
  const bool f8 = ct == DType::F8E4M3;
  const float ks = f8 ? k_scale : 1.f, vs = f8 ? v_scale : 1.f;
  PrefillParams P{};
  P.q = q.data_ptr();
  P.q_st = q.stride(0);
  P.q_sh = q.stride(1);
  P.k = k_cache.data_ptr();
  P.k_sb = k_cache.stride(0);
  P.k_sr = k_cache.stride(1);
  P.k_sh = k_cache.stride(2);
  P.v = v_cache.data_ptr();
  P.v_sb = v_cache.stride(0);
  P.v_sr = v_cache.stride(1);
  P.v_sh = v_cache.stride(2);
  P.bt = static_cast<const int32_t*>(block_tables.data_ptr());
  P.bt_s0 = block_tables.stride(0);
  P.bt_s1 = block_tables.stride(1);
  P.seq_lens = static_cast<const int32_t*>(seq_lens.data_ptr());
  P.sl_s = seq_lens.stride(0);
  P.qsl = static_cast<const int32_t*>(query_start_loc.data_ptr());
  P.qsl_s = query_start_loc.stride(0);
  P.out = out.data_ptr();
  P.num_blocks = NB;
  P.T = (int)T;
  P.B = (int)B;
  P.Hq = (int)Hq;
  P.group = (int)(Hq / Hk);
  P.max_blocks = (int)block_tables.size(1);
  P.bs_log2 = bs_log2;
  // A window at least 2^30 wide sees every key of any i32-indexed sequence: the same as none.
  P.window = sliding_window > 0 && sliding_window < (int64_t{1} << 30) ? (int)sliding_window : 0;
  P.score_scale = scale * ks * kLog2e;
  P.cap_in = softcap > 0.f ? scale * ks / softcap : 0.f;
  P.cap_out = softcap > 0.f ? softcap * kLog2e : 0.f;
  P.out_scale = vs;

  OpContext ctx(q);
  if (qt == DType::F16)
    return f8 ? launch_d<__half, uint8_t>(D, P, ctx.stream, dev.index) : launch_d<__half, __half>(D, P, ctx.stream, dev.index);
  return f8 ? launch_d<__nv_bfloat16, uint8_t>(D, P, ctx.stream, dev.index)
            : launch_d<__nv_bfloat16, __nv_bfloat16>(D, P, ctx.stream, dev.index);
}

}  // namespace tallow::cuda
