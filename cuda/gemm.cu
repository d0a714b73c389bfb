// matmul and linear on CUDA.
//
// cuBLASLt computes every product with f32 accumulation (CUBLAS_COMPUTE_32F: f16/bf16 operands on
// the tensor cores; f32 operands in full f32, TF32 off). Row-major tensors are handed to cuBLASLt
// as their column-major transposes: C^T[N, M] = B^T[N, K] * A^T[K, M], any operand with one unit
// stride is used in place (the other stride is its leading dimension), batch dims that collapse to
// one stride (0 for broadcast) become a strided batch. Plans (descriptors + the heuristic's algo)
// are cached per shape/layout; a 32 MiB workspace per device is allocated at its first use, and one per
// stream made private (runtime.h: set_private_scratch), so products queued on two such streams (a
// decode step split over two streams, runner.py) never share one.
//
// Decode shapes (f16/bf16 linear with M <= skinny_max_m() rows, 16-byte rows) take tallow's own GEMV
// kernel (gemv.cu), which streams w once at HBM bandwidth on the tensor cores; so does gated_linear's
// (the MLP's down projection with silu_and_mul folded into its x loads).
#include <cublasLt.h>
#include <cublas_v2.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "core/tuning.h"
#include "gemv.cuh"
#include "launch.cuh"
#include "ops_cuda.h"

namespace tallow::cuda {

namespace {

// ---- cuBLASLt -----------------------------------------------------------------------------------
constexpr size_t kWorkspaceBytes = size_t(32) << 20;
constexpr int kCandidates = 16;

struct DeviceBlas {
  cublasLtHandle_t handle = nullptr;
  cublasHandle_t blas = nullptr;  // cublasGemmEx, a further candidate when large products are timed
  void* workspace = nullptr;      // of the stream blas_for was asked for (set by blas_for on every call)
  std::map<cudaStream_t, void*> workspaces;
};

// The device's handles (made at first use). Ops are issued from one thread at a time.
std::mutex& blas_mu() {
  static std::mutex mu;
  return mu;
}

DeviceBlas& device_blas(int device) {
  static std::vector<DeviceBlas> per_device;
  if ((size_t)device >= per_device.size()) per_device.resize((size_t)device + 1);
  DeviceBlas& b = per_device[(size_t)device];
  if (!b.handle) {
    TALLOW_CUBLAS_CHECK("matmul", cublasLtCreate(&b.handle));
    TALLOW_CUBLAS_CHECK("matmul", cublasCreate(&b.blas));
  }
  return b;
}

cublasLtHandle_t lt_handle(int device) {
  std::lock_guard<std::mutex> lk(blas_mu());
  return device_blas(device).handle;
}

// The handles with `workspace` (also cuBLAS's) that of `stream`'s scratch key (the device's shared
// one, or a private stream's own: runtime.h), made at its first product and kept, since captured
// graphs point at it.
DeviceBlas& blas_for(int device, cudaStream_t stream) {
  const cudaStream_t key = (cudaStream_t)scratch_key(stream);
  std::lock_guard<std::mutex> lk(blas_mu());
  DeviceBlas& b = device_blas(device);
  void*& ws = b.workspaces[key];
  if (!ws) TALLOW_CUDA_CHECK("matmul", cudaMalloc(&ws, kWorkspaceBytes));
  if (b.workspace != ws) TALLOW_CUBLAS_CHECK("matmul", cublasSetWorkspace(b.blas, ws, kWorkspaceBytes));
  b.workspace = ws;
  return b;
}

// One operand as cuBLASLt sees it (column-major): rows x cols with leading dim ld, op(trans).
struct LtMat {
  int64_t rows, cols, ld;
  bool trans;
  int64_t batch_stride;
};

struct PlanKey {
  int device, dtype;
  int64_t m, n, k, batch;
  LtMat a, b;
  int64_t ldc, c_stride;
  bool bias;
  int align_a, align_b, align_c;
  auto tie() const {
    return std::make_tuple(device, dtype, m, n, k, batch, a.rows, a.cols, a.ld, a.trans, a.batch_stride, b.rows, b.cols,
                           b.ld, b.trans, b.batch_stride, ldc, c_stride, bias, align_a, align_b, align_c);
  }
  bool operator<(const PlanKey& o) const { return tie() < o.tie(); }
};

struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulAlgo_t algo{};
  std::vector<cublasLtMatmulAlgo_t> candidates;  // the heuristic's top picks, timed at first use
  bool tuned = false;
  bool use_gemmex = false;  // cublasGemm(Strided)BatchedEx won the timing
};

cudaDataType_t cuda_type(DType d) {
  switch (d) {
    case DType::F32: return CUDA_R_32F;
    case DType::F16: return CUDA_R_16F;
    default: return CUDA_R_16BF;
  }
}

int alignment(const void* p) {
  for (int a : {16, 8, 4}) if (aligned_to(p, a)) return a;
  return 2;
}

cublasLtMatrixLayout_t make_layout(cudaDataType_t t, int64_t rows, int64_t cols, int64_t ld, int64_t batch,
                                   int64_t stride) {
  cublasLtMatrixLayout_t l = nullptr;
  TALLOW_CUBLAS_CHECK("matmul", cublasLtMatrixLayoutCreate(&l, t, (uint64_t)rows, (uint64_t)cols, ld));
  if (batch > 1) {
    const int32_t bc = (int32_t)batch;
    TALLOW_CUBLAS_CHECK("matmul", cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc, sizeof bc));
    TALLOW_CUBLAS_CHECK("matmul", cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                                  &stride, sizeof stride));
  }
  return l;
}

Plan& get_plan(const PlanKey& key, DType dt) {
  static std::mutex mu;
  static std::map<PlanKey, Plan> plans;
  std::lock_guard<std::mutex> lk(mu);
  auto it = plans.find(key);
  if (it != plans.end()) return it->second;
  Plan p;
  const cudaDataType_t t = cuda_type(dt);
  TALLOW_CUBLAS_CHECK("matmul", cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = key.a.trans ? CUBLAS_OP_T : CUBLAS_OP_N, tb = key.b.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  TALLOW_CUBLAS_CHECK("matmul", cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  TALLOW_CUBLAS_CHECK("matmul", cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  if (key.bias) {
    const cublasLtEpilogue_t ep = CUBLASLT_EPILOGUE_BIAS;
    TALLOW_CUBLAS_CHECK("matmul", cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof ep));
    const cudaDataType_t bt = t;
    TALLOW_CUBLAS_CHECK("matmul",
                        cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt));
  }
  p.la = make_layout(t, key.a.rows, key.a.cols, key.a.ld, key.batch, key.a.batch_stride);
  p.lb = make_layout(t, key.b.rows, key.b.cols, key.b.ld, key.batch, key.b.batch_stride);
  p.lc = make_layout(t, key.m, key.n, key.ldc, key.batch, key.c_stride);
  cublasLtMatmulPreference_t pref = nullptr;
  TALLOW_CUBLAS_CHECK("matmul", cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = kWorkspaceBytes;
  TALLOW_CUBLAS_CHECK("matmul", cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                                     sizeof ws));
  const uint32_t aa = key.align_a, ab = key.align_b, ac = key.align_c;
  TALLOW_CUBLAS_CHECK("matmul", cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aa, sizeof aa));
  TALLOW_CUBLAS_CHECK("matmul", cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ab, sizeof ab));
  TALLOW_CUBLAS_CHECK("matmul", cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ac, sizeof ac));
  TALLOW_CUBLAS_CHECK("matmul", cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ac, sizeof ac));
  cublasLtMatmulHeuristicResult_t res[kCandidates]{};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt_handle(key.device), p.op, p.la, p.lb, p.lc, p.lc,
                                                           pref, kCandidates, res, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  TALLOW_CUBLAS_CHECK("matmul (heuristic)", st);
  if (found == 0) throw CudaError(str_cat("matmul: cuBLASLt has no algorithm for m=", key.m, " n=", key.n, " k=", key.k));
  p.algo = res[0].algo;
  // Large products time the heuristic's top picks once (its first choice is not always the fastest).
  if ((double)key.m * key.n * key.k * key.batch >= 1e9)
    for (int i = 0; i < found; ++i) p.candidates.push_back(res[i].algo);
  p.tuned = p.candidates.size() <= 1;
  return plans.emplace(key, p).first->second;
}

// Timed winners by shape bucket. Products that differ only in M (the engine's token count, which
// changes with every mixed prefill + decode step) within one bucket (a quarter octave: M in 129..160
// shares one) reuse the bucket's winner, checked with cublasLtMatmulAlgoCheck for the new shape,
// instead of timing the candidates again: every timing run synchronises the stream, which stalls the
// engine's overlap of host and GPU (H100, nano-vllm workload: mixed steps 40.8 -> 33.5 ms).
struct TunedAlgo {
  cublasLtMatmulAlgo_t algo;
  bool gemmex;
};

PlanKey bucket_of(const PlanKey& key) {  // key.n is our M (cuBLASLt sees C^T)
  PlanKey b = key;  // quarter-octave buckets: 129..160, 161..192, ..., 225..256, 257..320, ...
  int64_t top = 1;
  while (top * 2 <= key.n) top *= 2;
  const int64_t step = std::max<int64_t>(1, top / 4);
  b.n = ceil_div(key.n, step) * step;
  b.c_stride = 0;
  if (b.b.trans) b.b.rows = b.b.ld = 0;  // our A as cuBLASLt's B: M is one of its extents (and its ld when transposed)
  else b.b.cols = 0;
  return b;
}

std::mutex& tuned_mu() {
  static std::mutex mu;
  return mu;
}
std::map<PlanKey, TunedAlgo>& tuned_by_bucket() {
  static std::map<PlanKey, TunedAlgo> m;
  return m;
}

// The bucket's winner for plan p (true), if one was timed and it runs this shape.
bool reuse_bucket_winner(const PlanKey& key, Plan& p, cublasLtHandle_t handle) {
  if (key.batch != 1) return false;
  TunedAlgo t;
  {
    std::lock_guard<std::mutex> lk(tuned_mu());
    auto it = tuned_by_bucket().find(bucket_of(key));
    if (it == tuned_by_bucket().end()) return false;
    t = it->second;
  }
  if (!t.gemmex) {
    cublasLtMatmulHeuristicResult_t r{};
    if (cublasLtMatmulAlgoCheck(handle, p.op, p.la, p.lb, p.lc, p.lc, &t.algo, &r) != CUBLAS_STATUS_SUCCESS ||
        r.workspaceSize > kWorkspaceBytes)
      return false;
    p.algo = t.algo;
  }
  p.use_gemmex = t.gemmex;
  return true;
}

void keep_bucket_winner(const PlanKey& key, const Plan& p) {
  if (key.batch != 1) return;
  std::lock_guard<std::mutex> lk(tuned_mu());
  tuned_by_bucket()[bucket_of(key)] = TunedAlgo{p.algo, p.use_gemmex};
}

// The plan's product through cublasGemmStridedBatchedEx (same operands and layouts as cuBLASLt's).
cublasStatus_t gemmex(DeviceBlas& b, const PlanKey& key, DType dt, const void* a, const void* bm, void* c,
                      cudaStream_t stream) {
  cublasStatus_t st = cublasSetStream(b.blas, stream);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  const cudaDataType_t t = cuda_type(dt);
  const float alpha = 1.f, beta = 0.f;
  return cublasGemmStridedBatchedEx(b.blas, key.a.trans ? CUBLAS_OP_T : CUBLAS_OP_N, key.b.trans ? CUBLAS_OP_T : CUBLAS_OP_N,
                                    (int)key.m, (int)key.n, (int)key.k, &alpha, a, t, (int)key.a.ld, key.a.batch_stride,
                                    bm, t, (int)key.b.ld, key.b.batch_stride, &beta, c, t, (int)key.ldc, key.c_stride,
                                    (int)key.batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

// A row-major matrix view X[R, C] (strides rs, cs) as the column-major transpose cuBLASLt needs:
// X^T is C x R column-major when cs == 1 (ld rs); when rs == 1, X itself is R x C column-major (ld cs)
// and op = T gives X^T.
bool lt_view(int64_t R, int64_t C, int64_t rs, int64_t cs, LtMat& out) {
  if (cs == 1 || C == 1) {
    out = {C, R, std::max<int64_t>({rs, C, 1}), false, 0};
    return true;
  }
  if (rs == 1 || R == 1) {
    out = {R, C, std::max<int64_t>({cs, R, 1}), true, 0};
    return true;
  }
  return false;
}

// Collapses batch dims (all but the last two) of t into one stride; false when they do not collapse.
bool batch_stride(const Tensor& t, int64_t& count, int64_t& stride) {
  count = 1;
  stride = 0;
  bool first = true;
  for (int64_t d = t.dim() - 3; d >= 0; --d) {
    const int64_t s = t.size(d);
    if (s == 1) continue;
    if (first) {
      stride = t.stride(d);
      first = false;
    } else if (t.stride(d) != stride * count) {
      return false;
    }
    count *= s;
  }
  return true;
}

// C[batch][M, N] (contiguous) = A[batch][M, K] * B[batch][K, N] (+ bias[N]); A, B shaped [..., M, K] /
// [..., K, N] with identical batch dims (expanded), any strides. ldc > 0 (batch 1 only): C's row stride,
// so C may be a column slice of a wider row-major matrix.
void lt_gemm(const char* op, const Tensor& A_in, const Tensor& B_in, const Tensor* bias, Tensor& C, int64_t M, int64_t N,
             int64_t K, cudaStream_t stream, int64_t ldc = 0) {
  Tensor A = A_in, B = B_in;
  int64_t ba = 1, sa = 0, bb = 1, sb = 0;
  if (!batch_stride(A, ba, sa)) A = contiguous(A), batch_stride(A, ba, sa);
  if (!batch_stride(B, bb, sb)) B = contiguous(B), batch_stride(B, bb, sb);
  const int64_t batch = std::max(ba, bb);
  if (ba != batch) sa = 0;  // broadcast (all batch dims of size 1 or stride 0)
  if (bb != batch) sb = 0;
  LtMat la, lb;
  if (!lt_view(M, K, A.stride(-2), A.stride(-1), la)) {
    A = contiguous(A);
    batch_stride(A, ba, sa);
    lt_view(M, K, A.stride(-2), A.stride(-1), la);
  }
  if (!lt_view(K, N, B.stride(-2), B.stride(-1), lb)) {
    B = contiguous(B);
    batch_stride(B, bb, sb);
    lt_view(K, N, B.stride(-2), B.stride(-1), lb);
  }
  la.batch_stride = ba == batch ? sa : 0;
  lb.batch_stride = bb == batch ? sb : 0;
  // cuBLASLt's A is our B^T (N x K), its B is our A^T (K x M), its C is C^T (N x M, ld N).
  PlanKey key{};
  key.device = C.device().index;
  key.dtype = (int)C.dtype();
  key.m = N;
  key.n = M;
  key.k = K;
  key.batch = batch;
  key.a = lb;
  key.b = la;
  TALLOW_CHECK(ldc <= 0 || (batch == 1 && ldc >= N), op, ": row stride ", ldc, " of out needs one product of ", N,
               " columns");
  key.ldc = ldc > 0 ? ldc : N;
  key.c_stride = M * N;
  key.bias = bias != nullptr;
  key.align_a = alignment(B.data_ptr());
  key.align_b = alignment(A.data_ptr());
  key.align_c = alignment(C.data_ptr());
  Plan& p = get_plan(key, C.dtype());
  if (bias) {
    const void* bp = bias->data_ptr();
    TALLOW_CUBLAS_CHECK(op, cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof bp));
  }
  const float alpha = 1.f, beta = 0.f;
  DeviceBlas& blas = blas_for(key.device, stream);
  if (!p.tuned && !is_capturing(stream) && reuse_bucket_winner(key, p, blas.handle)) p.tuned = true;
  if (!p.tuned && !is_capturing(stream)) {
    // Time each candidate (2 runs, the second counted) on the real operands; keep the fastest.
    cudaEvent_t e0, e1;
    TALLOW_CUDA_CHECK(op, cudaEventCreate(&e0));
    TALLOW_CUDA_CHECK(op, cudaEventCreate(&e1));
    float best = 1e30f;
    for (const auto& algo : p.candidates) {
      float ms = 1e30f;
      bool ok = true;
      for (int r = 0; r < 2 && ok; ++r) {
        TALLOW_CUDA_CHECK(op, cudaEventRecord(e0, stream));
        ok = cublasLtMatmul(blas.handle, p.op, &alpha, B.data_ptr(), p.la, A.data_ptr(), p.lb, &beta, C.data_ptr(),
                            p.lc, C.data_ptr(), p.lc, &algo, blas.workspace, kWorkspaceBytes, stream) ==
             CUBLAS_STATUS_SUCCESS;
        TALLOW_CUDA_CHECK(op, cudaEventRecord(e1, stream));
        TALLOW_CUDA_CHECK(op, cudaEventSynchronize(e1));
        if (ok) TALLOW_CUDA_CHECK(op, cudaEventElapsedTime(&ms, e0, e1));
      }
      if (ok && ms < best) {
        best = ms;
        p.algo = algo;
      }
    }
    if (!bias) {  // cuBLAS's own heuristics (cublasGemmEx) as one more candidate
      float ms = 1e30f;
      bool ok = true;
      for (int r = 0; r < 2 && ok; ++r) {
        TALLOW_CUDA_CHECK(op, cudaEventRecord(e0, stream));
        ok = gemmex(blas, key, C.dtype(), B.data_ptr(), A.data_ptr(), C.data_ptr(), stream) == CUBLAS_STATUS_SUCCESS;
        TALLOW_CUDA_CHECK(op, cudaEventRecord(e1, stream));
        TALLOW_CUDA_CHECK(op, cudaEventSynchronize(e1));
        if (ok) TALLOW_CUDA_CHECK(op, cudaEventElapsedTime(&ms, e0, e1));
      }
      p.use_gemmex = ok && ms < best;
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    p.tuned = true;
    keep_bucket_winner(key, p);
  }
  if (p.use_gemmex) {
    TALLOW_CUBLAS_CHECK(op, gemmex(blas, key, C.dtype(), B.data_ptr(), A.data_ptr(), C.data_ptr(), stream));
    return;
  }
  TALLOW_CUBLAS_CHECK(op, cublasLtMatmul(blas.handle, p.op, &alpha, B.data_ptr(), p.la, A.data_ptr(), p.lb, &beta,
                                         C.data_ptr(), p.lc, C.data_ptr(), p.lc, &p.algo, blas.workspace,
                                         kWorkspaceBytes, stream));
}

// Whether gemv takes o[M, N] = x2[M, K] * w[N, K]^T (o contiguous).
bool skinny_ok(const Tensor& x2, const Tensor& w, const Tensor& o, int64_t M, int64_t K) {
  if (M < 1 || M > skinny_max_m() || !o.is_contiguous()) return false;
  return gemv_supported(x2.dtype(), M, w.size(0), K, x2.data_ptr(), x2.stride(0), x2.stride(1), w.data_ptr(),
                        w.stride(0), w.stride(1), w.size(0));
}

}  // namespace

// gemv is weight-bandwidth-bound up to M = 16 (cuBLASLt is not): KernelTuning::skinny_max_m.
int skinny_max_m() { return (int)kernel_tuning().skinny_max_m; }
void set_skinny_max_m(int m) { mutable_kernel_tuning().skinny_max_m = m < 0 ? 0 : (m > 16 ? 16 : m); }

Tensor linear(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias, const std::optional<Tensor>& out) {
  const char* op = "linear";
  const int64_t K = x.size(-1), N = w.size(0);
  Shape oshape = x.shape();
  oshape.back() = N;
  Tensor o = make_out(op, out, oshape, x.dtype(), x.device());
  const int64_t M = K ? x.numel() / K : shape_numel(Shape(x.shape().begin(), x.shape().end() - 1));
  if (o.numel() == 0) return o;
  OpContext ctx(x);
  const bool hb = bias && bias->defined();
  const Tensor bc = hb ? contiguous(*bias) : Tensor();
  // x as [M, K] (a view when the leading dims collapse, else a copy).
  Tensor x2 = x.dim() == 2 ? x : (x.dim() == 1 ? x.view({1, K}) : x.reshape({M, K}));
  Tensor o2 = o.view({M, N});
  if (K == 0) {  // empty sum: bias or zeros
    TALLOW_CUDA_CHECK(op, cudaMemsetAsync(o2.data_ptr(), 0, (size_t)o2.nbytes(), ctx.stream));
    if (hb) add(o2, bc, o2);
    return o;
  }
  if (skinny_ok(x2, w, o2, M, K)) {
    gemv(x.dtype(), x2.data_ptr(), x2.stride(0), (int)M, w.data_ptr(), w.stride(0), hb ? bc.data_ptr() : nullptr,
         o2.data_ptr(), N, N, K, ctx.stream);
    return o;
  }
  lt_gemm(op, x2, w.transpose(0, 1), hb ? &bc : nullptr, o2, M, N, K, ctx.stream);
  return o;
}

// o2[M, N] (row stride o2.stride(0) >= N, unit column stride: e.g. a column slice of a wider output) =
// x2[M, K] * w[N, K]^T (+ bias[N], contiguous); x2 and w 2-D with K > 0. The same kernels as linear.
void linear_2d_into(const Tensor& x2, const Tensor& w, const Tensor* bias, Tensor& o2) {
  const char* op = "linear";
  const int64_t M = x2.size(0), K = x2.size(1), N = w.size(0);
  TALLOW_CHECK(o2.dim() == 2 && o2.size(0) == M && o2.size(1) == N && o2.stride(1) == 1 && o2.stride(0) >= N, op,
               ": out view of shape ", shape_str(o2.shape()), " must be [", M, ", ", N, "] with unit column stride");
  if (M == 0 || N == 0) return;
  OpContext ctx(x2);
  if (M <= skinny_max_m() && gemv_supported(x2.dtype(), M, N, K, x2.data_ptr(), x2.stride(0), x2.stride(1),
                                            w.data_ptr(), w.stride(0), w.stride(1), o2.stride(0))) {
    gemv(x2.dtype(), x2.data_ptr(), x2.stride(0), (int)M, w.data_ptr(), w.stride(0), bias ? bias->data_ptr() : nullptr,
         o2.data_ptr(), o2.stride(0), N, K, ctx.stream);
    return;
  }
  lt_gemm(op, x2, w.transpose(0, 1), bias, o2, M, N, K, ctx.stream, o2.stride(0));
}

// gated_linear (ops/gated_linear.h): decode shapes through the gated gemv, which applies the activation
// while loading x (one kernel, the same weight stream as linear); else silu_and_mul / gelu_and_mul,
// then linear. Both round act(gate) * up to x's dtype before the product.
Tensor gated_linear(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias, const std::string& activation,
                    const std::optional<Tensor>& out) {
  const char* op = "gated_linear";
  const int64_t N = w.size(0), K = w.size(1);
  Shape oshape = x.shape();
  oshape.back() = N;
  Tensor o = make_out(op, out, oshape, x.dtype(), x.device());
  if (o.numel() == 0) return o;
  const int act = activation == "silu" ? kGemvSilu : (activation == "gelu_tanh" ? kGemvGeluTanh : kGemvGeluErf);
  const int64_t M = o.numel() / N;
  OpContext ctx(x);
  const bool hb = bias && bias->defined();
  if (K > 0 && M <= skinny_max_m() && x.stride(-1) == 1) {
    const Tensor x2 = x.dim() == 2 ? x : (x.dim() == 1 ? x.view({1, 2 * K}) : x.reshape({M, 2 * K}));
    if (gemv_gated_supported(x.dtype(), M, N, K, x2.data_ptr(), x2.stride(0), x2.stride(1), w.data_ptr(), w.stride(0),
                             w.stride(1), N)) {
      const Tensor bc = hb ? contiguous(*bias) : Tensor();
      gemv_gated(x.dtype(), x2.data_ptr(), x2.stride(0), (int)M, act, w.data_ptr(), w.stride(0),
                 hb ? bc.data_ptr() : nullptr, o.data_ptr(), N, N, K, ctx.stream);
      return o;
    }
  }
  const Tensor y = act == kGemvSilu ? silu_and_mul(x) : gelu_and_mul(x, act == kGemvGeluTanh ? "tanh" : "none");
  return linear(y, w, bias, o);
}

Tensor matmul(const Tensor& a, const Tensor& b, const std::optional<Tensor>& out) {
  const char* op = "matmul";
  const int64_t M = a.size(-2), K = a.size(-1), N = b.size(-1);
  // Broadcast batch dims.
  const Shape ab(a.shape().begin(), a.shape().end() - 2), bb(b.shape().begin(), b.shape().end() - 2);
  const size_t nb = std::max(ab.size(), bb.size());
  Shape batch(nb);
  for (size_t i = 0; i < nb; ++i) {
    const int64_t da = i + ab.size() >= nb ? ab[i + ab.size() - nb] : 1;
    const int64_t db = i + bb.size() >= nb ? bb[i + bb.size() - nb] : 1;
    batch[i] = da == 1 ? db : da;
  }
  Shape oshape = batch;
  oshape.push_back(M);
  oshape.push_back(N);
  Tensor o = make_out(op, out, oshape, a.dtype(), a.device());
  if (o.numel() == 0) return o;
  OpContext ctx(a);
  if (K == 0) {
    TALLOW_CUDA_CHECK(op, cudaMemsetAsync(o.data_ptr(), 0, (size_t)o.nbytes(), ctx.stream));
    return o;
  }
  Shape sa = batch, sb = batch;
  sa.push_back(M);
  sa.push_back(K);
  sb.push_back(K);
  sb.push_back(N);
  const Tensor ea = a.expand(sa), eb = b.expand(sb);
  // Decode-shaped products against a [K, N] view of an [N, K] weight go to the skinny kernel.
  if (nb == 0 || shape_numel(batch) == 1) {
    const Tensor a2 = ea.reshape({M, K}), b2 = eb.reshape({K, N});
    Tensor o2 = o.view({M, N});
    const Tensor wt = b2.transpose(0, 1);  // [N, K]
    if (skinny_ok(a2, wt, o2, M, K)) {
      gemv(a.dtype(), a2.data_ptr(), a2.stride(0), (int)M, wt.data_ptr(), wt.stride(0), nullptr, o2.data_ptr(), N, N,
           K, ctx.stream);
      return o;
    }
  }
  lt_gemm(op, ea, eb, nullptr, o, M, N, K, ctx.stream);
  return o;
}

}  // namespace tallow::cuda
