// Split-K GEMM for decode batches: out[M, N] = x[M, K] * w[N, K]^T (+ bias[N]) for f16/bf16 with
// M <= 256 rows and few output columns, on the tensor cores (mma.sync m16n8k16, f32 accumulation).
//
// Why: at such shapes (Qwen3-0.6B's o_proj [1024 x 2048] and down_proj [1024 x 3072], M = 32-256)
// cuBLASLt's kernels cut the output into small tiles (64 x 32) so that the grid fills the SMs, and
// then read x and w again from L2 for every tile: ~50 MB of L2 traffic for a 4 MB weight. Here a
// CTA's tile spans every row (64, 128 or 256: M rounded up) and 64 columns, so x is read N / 64
// times and w once, and the K range is cut among the `split` CTAs of a thread-block cluster (sm_90)
// so that the grid still fills the SMs.
//
// Loads: a cp.async pipeline of `kStages` k-blocks of 64 (x rows, then w rows), 128-byte rows of
// shared memory with the 16-byte chunks XOR-swizzled by row, so ldmatrix reads are conflict-free.
// Rows past M or N and chunks past K are zero-filled (cp.async with source size 0: no traffic).
// Math: 8 warps, 4 along M (BM / 4 rows each) x 2 along N (32 columns each).
// Split reduction: after the main loop every CTA of the cluster owns a band of the tile's rows and
// receives the other CTAs' partial sums of that band in its shared memory (distributed shared
// memory stores), then adds them in rank order: deterministic, no atomics, no scratch, one launch,
// nothing that graph capture forbids.
// PDL (pdl.cuh, under graph capture when enabled): the first stages' weight rows go out before
// griddepcontrol.wait (weights are never written on the decode path), x after it.
#include "splitk_gemm.cuh"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>

#include "attention/ptx.cuh"
#include "cluster.cuh"
#include "common.cuh"
#include "launch.cuh"
#include "pdl.cuh"

namespace tallow::cuda {

namespace {

constexpr int kBN = 64;        // output columns of a CTA
constexpr int kBK = 64;        // k of one pipeline stage (128-byte shared rows)
constexpr int kThreads = 256;  // 8 warps: 4 along M x 2 along N
constexpr int kStages = 4;
constexpr int kMaxSplit = 8;   // the portable cluster size

struct Args {
  const void* x;
  const void* w;
  const void* bias;
  void* out;
  int64_t ldx, ldw, ldo;
  int M, N, K;
  int split, kblocks;  // CTAs per column tile (cluster), k-blocks of kBK in all
  int pdl;
};

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#endif
}

// The shared-memory offset of 16-byte chunk `ch` (0-7) of row `row` in a tile of 128-byte rows.
__device__ __forceinline__ int swz(int row, int ch) { return row * 128 + ((ch ^ (row & 7)) << 4); }

template <class T, int BM>
__global__ void __launch_bounds__(kThreads, 1) splitk_kernel(const Args a) {
  constexpr int MT = BM / 64;  // m16 tiles per warp
  constexpr int A_BYTES = BM * kBK * 2, STAGE = A_BYTES + kBN * kBK * 2;
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int wm = warp & 3, wn = warp >> 2;
  const int split = a.split;
  const int rank = split > 1 ? (int)(blockIdx.x % (unsigned)split) : 0;  // == the cluster rank
  const int n0 = (int)(blockIdx.x / (unsigned)split) * kBN;
  const int kb0 = (int)((int64_t)a.kblocks * rank / split), kb1 = (int)((int64_t)a.kblocks * (rank + 1) / split);
  const int nkb = kb1 - kb0;
  pdl_launch_dependents();

  const T* x = static_cast<const T*>(a.x);
  const T* w = static_cast<const T*>(a.w);
  // Stage s of the pipeline holds k-block kb0 + i in slot i % kStages.
  auto load_w = [&](int i) {
    if (i >= nkb) return;
    unsigned char* sb = smem + (i % kStages) * STAGE + A_BYTES;
    const int k = (kb0 + i) * kBK;
#pragma unroll
    for (int j = 0; j < kBN * 8 / kThreads; ++j) {
      const int c = tid + j * kThreads, r = c >> 3, ch = c & 7, n = n0 + r, kk = k + ch * 8;
      const bool ok = n < a.N && kk < a.K;
      cp_async16(smem_addr(sb + swz(r, ch)), ok ? w + (int64_t)n * a.ldw + kk : w, ok);
    }
  };
  auto load_x = [&](int i) {
    if (i >= nkb) return;
    unsigned char* sa = smem + (i % kStages) * STAGE;
    const int k = (kb0 + i) * kBK;
#pragma unroll
    for (int j = 0; j < BM * 8 / kThreads; ++j) {
      const int c = tid + j * kThreads, r = c >> 3, ch = c & 7, kk = k + ch * 8;
      const bool ok = r < a.M && kk < a.K;
      cp_async16(smem_addr(sa + swz(r, ch)), ok ? x + (int64_t)r * a.ldx + kk : x, ok);
    }
  };

  // Prologue: commit groups {w of stages 0..S-2}, {x 0}, ..., {x S-2}; then one group per k-block.
  // At k-block i the wait leaves S - 2 groups in flight: all of block i's loads have landed.
  for (int i = 0; i < kStages - 1; ++i) load_w(i);
  cp_async_commit();
  if (a.pdl) pdl_wait();  // x is the previous kernel's output
  for (int i = 0; i < kStages - 1; ++i) {
    load_x(i);
    cp_async_commit();
  }

  float acc[MT][4][4];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int n = 0; n < 4; ++n) acc[m][n][0] = acc[m][n][1] = acc[m][n][2] = acc[m][n][3] = 0.f;

  // ldmatrix lane addressing: A (x4 = a 16 x 16 tile: rows lane % 16, k-chunk lane / 16); B (x4 = two
  // n8 tiles x k16: rows 8 (lane / 16) + lane % 8, k-chunk (lane / 8) % 2).
  const int a_row0 = wm * (BM / 4) + (lane & 15), a_ch = lane >> 4;
  const int b_row0 = wn * 32 + ((lane >> 4) << 3) + (lane & 7), b_ch = (lane >> 3) & 1;
#pragma unroll 1
  for (int i = 0; i < nkb; ++i) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // block i is visible to every warp; slot (i - 1) % S is free
    load_w(i + kStages - 1);
    load_x(i + kStages - 1);
    cp_async_commit();
    const unsigned char* sa = smem + (i % kStages) * STAGE;
    const unsigned char* sb = sa + A_BYTES;
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk) {
      uint32_t af[MT][4], bf[2][4];
#pragma unroll
      for (int m = 0; m < MT; ++m) ldmatrix_x4(af[m], smem_addr(sa + swz(a_row0 + 16 * m, 2 * kk + a_ch)));
#pragma unroll
      for (int h = 0; h < 2; ++h) ldmatrix_x4(bf[h], smem_addr(sb + swz(b_row0 + 16 * h, 2 * kk + b_ch)));
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < 4; ++n) mma16816<T>(acc[m][n], af[m], bf[n >> 1][(n & 1) * 2], bf[n >> 1][(n & 1) * 2 + 1]);
    }
  }
  cp_async_wait<0>();  // (the last groups are empty)

  // acc[m][n][e]: row wm * BM / 4 + 16 m + g (+ 8 for e >= 2), column wn * 32 + 8 n + 2 t4 (+ 1 for odd e).
  T* out = static_cast<T*>(a.out);
  auto finish = [&](int r, int c, float s) {  // r < M, c < kBN
    const int n = n0 + c;
    if (n >= a.N) return;
    if (a.bias) s += to_float(static_cast<const T*>(a.bias)[n]);
    out[(int64_t)r * a.ldo + n] = from_float<T>(s);
  };
  if (split == 1) {
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = wm * (BM / 4) + 16 * m + g + 8 * (e >> 1), c = wn * 32 + 8 * n + 2 * t4 + (e & 1);
          if (r < a.M) finish(r, c, acc[m][n][e]);
        }
    return;
  }

  // Bands: rank q finishes rows [q * band, (q + 1) * band) of the tile's first min(M, BM) rows; its
  // gather[src][band][kBN] receives every rank's partial sums of them (the pipeline's memory, free
  // once every CTA of the cluster is past its loop: the first barrier, which also makes sure that
  // every CTA of the cluster runs, so its shared memory exists).
  const int rows = a.M < BM ? a.M : BM, band = (rows + split - 1) / split;
  float* gather = reinterpret_cast<float*>(smem);
  cluster_arrive_release();
  cluster_wait();
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = wm * (BM / 4) + 16 * m + g + 8 * h, c = wn * 32 + 8 * n + 2 * t4;
        if (r >= rows) continue;
        const int owner = r / band;
        store_remote2(gather + ((int64_t)rank * band + (r - owner * band)) * kBN + c, owner, acc[m][n][2 * h],
                      acc[m][n][2 * h + 1]);
      }
  cluster_arrive_release();
  cluster_wait();
  const int r0 = rank * band, nr = std::min(band, rows - r0);
  for (int idx = tid; idx < nr * kBN; idx += kThreads) {
    const int i = idx / kBN, c = idx % kBN;
    float s = gather[(int64_t)i * kBN + c];
    for (int q = 1; q < split; ++q) s += gather[((int64_t)q * band + i) * kBN + c];
    finish(r0 + i, c, s);
  }
}

// ---- host ---------------------------------------------------------------------------------------

int device_major() {
  static int majors[64] = {};
  int dev = 0;
  TALLOW_CUDA_CHECK("linear", cudaGetDevice(&dev));
  dev = dev < 64 ? dev : 63;
  if (!majors[dev]) TALLOW_CUDA_CHECK("linear", cudaDeviceGetAttribute(&majors[dev], cudaDevAttrComputeCapabilityMajor, dev));
  return majors[dev];
}

template <int BM>
constexpr size_t smem_bytes() {
  return std::max<size_t>((size_t)kStages * (BM * kBK * 2 + kBN * kBK * 2), (size_t)(BM + kMaxSplit) * kBN * 4);
}

template <class T, int BM>
void launch(Args a, cudaStream_t stream) {
  auto kernel = splitk_kernel<T, BM>;
  constexpr size_t smem = smem_bytes<BM>();
  static std::once_flag opted[64];  // per device: allow the dynamic shared memory
  int dev = 0;
  TALLOW_CUDA_CHECK("linear", cudaGetDevice(&dev));
  std::call_once(opted[dev < 64 ? dev : 63], [&] {
    TALLOW_CUDA_CHECK("linear", cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  });
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3((unsigned)(ceil_div(a.N, kBN) * a.split));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attrs[2];
  int na = 0;
  if (a.split > 1) {
    attrs[na].id = cudaLaunchAttributeClusterDimension;
    attrs[na].val.clusterDim.x = (unsigned)a.split;
    attrs[na].val.clusterDim.y = 1;
    attrs[na].val.clusterDim.z = 1;
    ++na;
  }
  if (a.pdl) {
    attrs[na].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[na].val.programmaticStreamSerializationAllowed = 1;
    ++na;
  }
  cfg.attrs = attrs;
  cfg.numAttrs = (unsigned)na;
  TALLOW_CUDA_CHECK("linear", cudaLaunchKernelEx(&cfg, kernel, a));
}

template <class T>
void launch_bm(const Args& a, cudaStream_t s) {
  if (a.M <= 64) launch<T, 64>(a, s);
  else if (a.M <= 128) launch<T, 128>(a, s);
  else launch<T, 256>(a, s);
}

std::atomic<int>& max_m() {
  static std::atomic<int> v{[] {
    const char* e = std::getenv("TALLOW_SPLITK_MAX_M");
    return e ? std::clamp(std::atoi(e), 0, 256) : 256;
  }()};
  return v;
}
std::atomic<int64_t>& max_n() {
  static std::atomic<int64_t> v{[] {
    const char* e = std::getenv("TALLOW_SPLITK_MAX_N");
    return e ? std::max<int64_t>(std::atoll(e), 0) : (int64_t)2048;
  }()};
  return v;
}

std::atomic<int>& forced_split() {
  static std::atomic<int> v{0};
  return v;
}

}  // namespace

int splitk_forced_split() { return forced_split().load(); }
void set_splitk_forced_split(int split) {
  TALLOW_CHECK(split == 0 || split == 1 || split == 2 || split == 4 || split == 8,
               "set_splitk_forced_split: split must be 0 (the heuristic), 1, 2, 4 or 8, got ", split);
  forced_split().store(split);
}

int splitk_max_m() { return max_m().load(); }
void set_splitk_max_m(int m) { max_m().store(std::clamp(m, 0, 256)); }
int64_t splitk_max_n() { return max_n().load(); }
void set_splitk_max_n(int64_t n) { max_n().store(std::max<int64_t>(n, 0)); }

bool splitk_supported(DType dt, int64_t M, int64_t N, int64_t K, const void* x, int64_t ldx, int64_t x_kstride,
                      const void* w, int64_t ldw, int64_t w_kstride, int64_t ldo) {
  if (dt != DType::F16 && dt != DType::BF16) return false;
  if (M < 1 || M > 256 || N < 1 || N > INT32_MAX || K < 8 || K % 8 != 0 || K > INT32_MAX - kBK) return false;
  if (x_kstride != 1 || w_kstride != 1 || ldo < N) return false;
  if (!aligned_to(w, 16) || !aligned_to(x, 16) || ldw % 8 != 0 || ldw < K || ldx % 8 != 0 || ldx < K) return false;
  return device_major() >= 9;
}

void splitk_gemm(DType dt, const void* x, int64_t ldx, int M, const void* w, int64_t ldw, const void* bias, void* out,
                 int64_t ldo, int64_t N, int64_t K, void* stream, int split) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int kblocks = (int)ceil_div(K, kBK);
  const int64_t tiles = ceil_div(N, kBN);
  if (split <= 0) {  // the largest cluster that keeps the grid within one CTA an SM, >= 2 k-blocks a CTA
    split = 1;
    while (split < kMaxSplit && tiles * split * 2 <= sm_count() && kblocks >= 4 * split) split *= 2;
  }
  TALLOW_CHECK(split == 1 || split == 2 || split == 4 || split == 8, "linear: split-K cluster size must be 1, 2, 4 or 8, got ",
               split);
  split = std::min(split, kblocks);
  while (split & (split - 1)) --split;  // a power of two (kblocks may be 3, 5, ...)
  Args a{x, w, bias, out, ldx, ldw, ldo, M, (int)N, (int)K, split, kblocks, use_pdl(stream) ? 1 : 0};
  if (dt == DType::BF16) launch_bm<__nv_bfloat16>(a, s);
  else launch_bm<__half>(a, s);
}

}  // namespace tallow::cuda
