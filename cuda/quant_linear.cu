// quant_linear on CUDA (ops/quant_linear.h): out[..., N] = x[..., K] @ dequantize(w[N, K])^T + bias with
// w in a GGUF block dtype.
// - M <= 8 rows (decode, kMaxDecodeRows): x is quantized once per call to q8 blocks (32 int8, scale
//   amax / 127, round to nearest, plus d * sum q) in a scratch from the caching allocator; then one
//   kernel per weight type streams W once: a CTA takes 2-4 rows, its threads walk the rows' 32-weight
//   units side by side (so a warp's loads are contiguous), each unit decoded once and multiplied by
//   every x row with __dp4a (quant_dot.cuh); f32 partial sums reduced over the CTA, bias added, rounded
//   once to x's dtype.
// - More rows (prefill, and decode batches of 9-16): W dequantized into a scratch of x's dtype through
//   the same decoders (a warp per 32 units, stores staged in shared memory; dequantize_rows where W is
//   not aligned for the word loads), then the CUDA linear (its gemv up to 16 rows, else cuBLASLt); a W larger
//   than kPrefillChunkBytes in row chunks through one reused scratch, each product written into its columns.
// No host sync, no allocation outside the caching allocator: capturable in a CUDA graph. Under capture
// on sm_90 the product is launched with PDL (pdl.cuh) and loads its first weights while x is quantized.
#include <algorithm>
#include <climits>

#include "dequant.cuh"
#include "launch.cuh"
#include "ops_cuda.h"
#include "pdl.cuh"
#include "quant_dot.cuh"

namespace tallow::cuda {

namespace {

constexpr const char* kOp = "quant_linear";
// The q8 path up to this many rows of x. Measured (H200, benchmarks/bench_quant_linear_cuda.py, Llama-3-8B
// Q4_K / Q6_K shapes): at 8 rows it beats dequantize + linear on every shape (q/o 16.4 vs ~23 us), at 16
// rows it loses on every one (q/o 31.9 vs ~23 us, lm_head 781 vs ~680 us): its x loads grow with M.
constexpr int kMaxDecodeRows = 8;
constexpr int kThreads = 128;       // threads of a decode CTA
// More rows: W is dequantized in chunks of whole rows of about this many bytes of x's dtype (a multiple of
// kPrefillChunkRowAlign rows, at least one such group), each chunk's product run before the next chunk is
// decoded into the same scratch: the chunk stays resident in L2 (50 MB on H100) while the GEMM rereads it,
// instead of a full copy of W (1 GiB bf16 for a 128256 x 4096 lm head) allocated and streamed through HBM.
constexpr int64_t kPrefillChunkBytes = int64_t(20) << 20;
constexpr int64_t kPrefillChunkRowAlign = 128;  // whole GEMM tiles of output columns per chunk
// W rows a decode CTA takes (each thread decodes one unit of each, then reuses every x load that many
// times): 2 for 1-2 rows of x (more CTAs for small N), 4 from 3 rows, where the x loads from L1 dominate.
constexpr int rows_per_cta(int mb) { return mb <= 2 ? 2 : 4; }

// 0 f32, 1 f16, 2 bf16: x's dtype, read / written through one switch so the kernels are not
// instantiated per float dtype.
__device__ __forceinline__ float load_float(const void* p, int kind, int64_t i) {
  switch (kind) {
    case 0: return static_cast<const float*>(p)[i];
    case 1: return __half2float(static_cast<const __half*>(p)[i]);
    default: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  }
}
__device__ __forceinline__ void store_float(void* p, int kind, int64_t i, float v) {
  switch (kind) {
    case 0: static_cast<float*>(p)[i] = v; break;
    case 1: static_cast<__half*>(p)[i] = __float2half_rn(v); break;
    default: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
  }
}
int float_kind(DType t) { return t == DType::F32 ? 0 : (t == DType::F16 ? 1 : 2); }

// One warp per 32 elements of x: xq = round(x / d) with d = amax / 127 (0 for an all-zero block),
// xd = (d, d * sum xq). Row m of x starts at element rows.offset(m).
template <class T>
__global__ void quantize_q8_kernel(const T* __restrict__ x, Strided rows, int64_t K, int64_t n_blocks,
                                   int8_t* __restrict__ xq, float2* __restrict__ xd) {
  pdl_launch_dependents();  // the product may start streaming its weights now (it waits before reading xq)
  const int64_t b = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (b >= n_blocks) return;  // whole warps leave together (blockDim is a multiple of 32)
  const int64_t per_row = K / 32, m = b / per_row, k = (b % per_row) * 32 + lane;
  const float v = to_float(x[rows.offset(m) + k]);
  const float amax = warp_max(fabsf(v));
  const float d = amax / 127.f;
  const int q = amax == 0.f ? 0 : (int)roundf(v / d);
  xq[m * K + k] = (int8_t)q;
  const float sum = warp_sum((float)q);  // exact: |sum| <= 32 * 127
  if (lane == 0) xd[b] = make_float2(d, d * sum);
}

template <DType kT, int kMB>
__global__ void __launch_bounds__(kThreads) quant_gemv_kernel(const uint8_t* __restrict__ w, int64_t w_row_bytes,
                                                              int N, int K, const int8_t* __restrict__ xq,
                                                              const float2* __restrict__ xd, int M, const void* bias,
                                                              int64_t bias_stride, void* out, int kind) {
  constexpr int kSubs = deq::block_elems(kT) / 32, kBytes = deq::block_bytes(kT), kRows = rows_per_cta(kMB);
  const int units = K / 32, n0 = blockIdx.x * kRows;
  const uint8_t* wrow[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) wrow[r] = w + (int64_t)min(n0 + r, N - 1) * w_row_bytes;  // tail rows: reread, not written
  float acc[kRows][kMB];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int m = 0; m < kMB; ++m) acc[r][m] = 0.f;

  // Launched with PDL under graph capture: the first units' weights (never written by the q8 kernel
  // this launch follows) are loaded before the wait, so they stream while x is being quantized.
  auto decode_unit = [&](int u, qdot::Unit (&wu)[kRows]) {
    const int64_t boff = (int64_t)(u / kSubs) * kBytes;
#pragma unroll
    for (int r = 0; r < kRows; ++r) wu[r] = qdot::decode<kT>(wrow[r] + boff, u % kSubs);
  };
  qdot::Unit wu[kRows];
  if (threadIdx.x < units) decode_unit(threadIdx.x, wu);
  pdl_wait();
  for (int u = threadIdx.x; u < units; u += kThreads) {
    if (u != (int)threadIdx.x) decode_unit(u, wu);
#pragma unroll
    for (int m = 0; m < kMB; ++m) {
      if (m < M) {
        const int4* xp = reinterpret_cast<const int4*>(xq + (int64_t)m * K + 32 * u);
        const int4 a = __ldg(xp), b = __ldg(xp + 1);
        const int xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        const float2 d = __ldg(xd + (int64_t)m * units + u);
#pragma unroll
        for (int r = 0; r < kRows; ++r) acc[r][m] += qdot::dot<kT>(wu[r], xv, d);
      }
    }
  }

  __shared__ float part[kThreads / 32][kRows * kMB];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int m = 0; m < kMB; ++m) {
      if (m < M) {
        const float v = warp_sum(acc[r][m]);
        if (lane == 0) part[warp][r * kMB + m] = v;
      }
    }
  __syncthreads();
  for (int i = threadIdx.x; i < kRows * kMB; i += kThreads) {
    const int r = i / kMB, m = i % kMB, n = n0 + r;
    if (m >= M || n >= N) continue;
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < kThreads / 32; ++k) s += part[k][i];
    if (bias) s += load_float(bias, kind, n * bias_stride);
    store_float(out, kind, (int64_t)m * N + n, s);
  }
}

// Prefill: W [N, K] -> out [N, K] of x's dtype through the decoders (sc * v + mn in one fma: the same
// values as deq::element to within one f32 rounding, bit-equal for most types). A warp takes 32
// consecutive units (one a lane, a few word loads each) and stages their 32 x 32 values in shared
// memory, so its global stores are contiguous 16-byte packs.
constexpr int kDequantWarps = 8;
template <DType kT, class O>
__global__ void __launch_bounds__(kDequantWarps * 32) dequant_for_gemm_kernel(const uint8_t* __restrict__ w,
                                                                             int64_t w_row_bytes,
                                                                             int64_t units_per_row, int64_t n_units,
                                                                             O* __restrict__ out) {
  constexpr int kSubs = deq::block_elems(kT) / 32, kBytes = deq::block_bytes(kT), kPack = Vec16<O>::N;
  constexpr int kPacksPerUnit = 32 / kPack;
  __shared__ Vec16<O> stage[kDequantWarps][32 * kPacksPerUnit];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int64_t u0 = ((int64_t)blockIdx.x * kDequantWarps + warp) * 32; u0 < n_units;
       u0 += (int64_t)gridDim.x * kDequantWarps * 32) {
    const int64_t u = u0 + lane;
    if (u < n_units) {
      const int64_t r = u / units_per_row, c = u % units_per_row;
      const qdot::Unit q = qdot::decode<kT>(w + r * w_row_bytes + (c / kSubs) * kBytes, (int)(c % kSubs));
#pragma unroll
      for (int p = 0; p < kPacksPerUnit; ++p) {
        Vec16<O> v;
#pragma unroll
        for (int k = 0; k < kPack; ++k) {
          const int e = p * kPack + k;
          const int val = (int)(int8_t)(q.v[e >> 2] >> (8 * (e & 3)));
          v.v[k] = from_float<O>(fmaf(q.sc[e >> 4], (float)val, q.mn[e >> 4]));
        }
        stage[warp][lane * kPacksPerUnit + p] = v;
      }
    }
    __syncwarp();
    // Unit u's outputs start at out + 32 u (out is [N, K] contiguous): the warp's 32 units are one run.
    const int64_t left = n_units - u0;
    const int packs = (int)(left < 32 ? left : 32) * kPacksPerUnit;
    Vec16<O>* dst = reinterpret_cast<Vec16<O>*>(out + u0 * 32);
    for (int i = lane; i < packs; i += 32) dst[i] = stage[warp][i];
    __syncwarp();
  }
}

// Byte alignment the decode kernel's loads need of every weight block.
int decode_alignment(DType t) {
  switch (t) {
    case DType::Q4_K: case DType::Q5_K: return 16;
    case DType::Q4_1: case DType::Q5_1: case DType::Q8_1: case DType::Q2_K: case DType::Q8_K: case DType::IQ4_XS:
      return 4;
    default: return 2;
  }
}

template <DType kT>
void launch_quant_gemv(int mb, cudaStream_t s, const uint8_t* w, int64_t wrb, int N, int K,
                       const int8_t* xq, const float2* xd, int M, const void* bias, int64_t bstride, void* out,
                       int kind) {
  const dim3 grid((unsigned)ceil_div(N, rows_per_cta(mb)));
  const bool pdl = pdl_capable(s);
  auto go = [&](auto kernel) {
    TALLOW_CUDA_CHECK(kOp, launch_kernel(kernel, grid, dim3(kThreads), 0, s, pdl, w, wrb, N, K, xq, xd, M, bias,
                                         bstride, out, kind));
  };
  switch (mb) {
    case 1: go(quant_gemv_kernel<kT, 1>); break;
    case 2: go(quant_gemv_kernel<kT, 2>); break;
    case 4: go(quant_gemv_kernel<kT, 4>); break;
    default: go(quant_gemv_kernel<kT, 8>); break;
  }
}

}  // namespace

Tensor quant_linear(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias,
                    const std::optional<Tensor>& out) {
  const char* op = kOp;
  if (!is_block_dtype(w.dtype())) return linear(x, w, bias, out);  // float w: the plain product
  const int64_t N = w.size(0), K = w.size(1);
  Shape oshape(x.shape().begin(), x.shape().end() - 1);
  oshape.push_back(N);
  Tensor o = make_out(op, out, oshape, x.dtype(), x.device());
  if (o.numel() == 0) return o;
  const int64_t M = o.numel() / N;
  OpContext ctx(x);
  const DType wt = w.dtype();
  const int64_t bs = dtype_block_size(wt), ts = dtype_type_size(wt);
  const int64_t w_row_bytes = (N > 1 ? w.stride(0) : K) / bs * ts;
  const uint8_t* wbase = static_cast<const uint8_t*>(w.data_ptr());
  const bool has_bias = bias && bias->defined();

  const bool decode = K > 0 && M <= kMaxDecodeRows && K <= INT_MAX / 2 && N <= INT_MAX / 2 &&
                      aligned_to(wbase, (size_t)decode_alignment(wt)) && w_row_bytes % decode_alignment(wt) == 0;
  if (!decode) {
    // Rows [n0, n0 + nc) of W -> dst [nc, K] of x's dtype.
    auto dequant_chunk = [&](int64_t n0, int64_t nc, void* dst) {
      const uint8_t* src = wbase + n0 * w_row_bytes;
      if (K > 0 && aligned_to(wbase, (size_t)decode_alignment(wt)) && w_row_bytes % decode_alignment(wt) == 0) {
        const int64_t units_per_row = K / 32, n_units = nc * units_per_row;
        const unsigned grid = grid_for(ceil_div(n_units, 32) * 32, kDequantWarps * 32);
#define TALLOW_DEQ_GEMM_CASE(T)                                                                              \
  case DType::T:                                                                                             \
    dequant_for_gemm_kernel<DType::T, scalar_t><<<grid, kDequantWarps * 32, 0, ctx.stream>>>(               \
        src, w_row_bytes, units_per_row, n_units, static_cast<scalar_t*>(dst));                              \
    break;
        TALLOW_CUDA_DISPATCH_FLOAT(op, x.dtype(), [&] {
          switch (wt) {
            TALLOW_FOR_EACH_BLOCK_DTYPE(TALLOW_DEQ_GEMM_CASE)
            default: throw TypeError(str_cat(op, ": ", dtype_name(wt), " is not a GGUF block dtype"));
          }
        });
#undef TALLOW_DEQ_GEMM_CASE
        TALLOW_CUDA_CHECK_LAUNCH(op);
      } else {
        dequantize_rows(wt, src, nc, K, w_row_bytes, x.dtype(), dst, ctx.stream);
      }
    };
    const int64_t row_bytes = std::max<int64_t>(K, 1) * dtype_type_size(x.dtype());
    const int64_t chunk_rows =
        std::max<int64_t>(1, kPrefillChunkBytes / row_bytes / kPrefillChunkRowAlign) * kPrefillChunkRowAlign;
    if (N <= chunk_rows || K == 0) {  // W fits one chunk: dequantize it whole, then linear
      Tensor wd = Tensor::empty({N, K}, x.dtype(), x.device());
      dequant_chunk(0, N, wd.data_ptr());
      return linear(x, wd, bias, o);
    }
    // Chunks: out[:, n0:n0 + nc] = x @ W[n0:n0 + nc]^T (+ bias[n0:n0 + nc]), written in place (row stride N).
    // Every chunk's product sums over the whole of K, as the one product over W would.
    Tensor wd = Tensor::empty({chunk_rows, K}, x.dtype(), x.device());
    const Tensor x2 = x.dim() == 2 ? x : (x.dim() == 1 ? x.view({1, K}) : x.reshape({M, K}));
    Tensor o2 = o.view({M, N});
    const Tensor bc = has_bias ? contiguous(*bias) : Tensor();
    for (int64_t n0 = 0; n0 < N; n0 += chunk_rows) {
      const int64_t nc = std::min(chunk_rows, N - n0);
      const Tensor wc = nc == chunk_rows ? wd : wd.narrow(0, 0, nc);
      dequant_chunk(n0, nc, wd.data_ptr());
      const Tensor bslice = has_bias ? bc.narrow(0, n0, nc) : Tensor();
      Tensor oc = o2.narrow(1, n0, nc);
      linear_2d_into(x2, wc, has_bias ? &bslice : nullptr, oc);
    }
    return o;
  }

  // Activations -> q8 blocks.
  const Tensor xc = last_dim_contiguous(x);
  const Strided rows = row_index(op, xc);
  const int64_t n_blocks = M * (K / 32);
  Tensor xq = Tensor::empty({M * K}, DType::I8, x.device());
  Tensor xd = Tensor::empty({n_blocks * 2}, DType::F32, x.device());
  int8_t* pq = static_cast<int8_t*>(xq.data_ptr());
  float2* pd = static_cast<float2*>(xd.data_ptr());
  TALLOW_CUDA_DISPATCH_FLOAT(op, x.dtype(), [&] {
    quantize_q8_kernel<scalar_t><<<(unsigned)ceil_div(n_blocks * 32, 256), 256, 0, ctx.stream>>>(
        static_cast<const scalar_t*>(xc.data_ptr()), rows, K, n_blocks, pq, pd);
  });
  TALLOW_CUDA_CHECK_LAUNCH(op);

  // Products.
  const int mb = M <= 1 ? 1 : M <= 2 ? 2 : M <= 4 ? 4 : 8;
  const void* pb = has_bias ? bias->data_ptr() : nullptr;
  const int64_t bstride = has_bias ? bias->stride(0) : 0;
#define TALLOW_QGEMV_CASE(T)                                                                                     \
  case DType::T:                                                                                                 \
    launch_quant_gemv<DType::T>(mb, ctx.stream, wbase, w_row_bytes, (int)N, (int)K, pq, pd, (int)M, pb, \
                                bstride, o.data_ptr(), float_kind(x.dtype()));                                   \
    break;
  switch (wt) {
    TALLOW_FOR_EACH_BLOCK_DTYPE(TALLOW_QGEMV_CASE)
    default:
      throw TypeError(str_cat(op, ": w must be a GGUF block dtype, got ", dtype_name(wt), " (x ",
                              shape_str(x.shape()), ", w ", shape_str(w.shape()), ")"));
  }
#undef TALLOW_QGEMV_CASE
  TALLOW_CUDA_CHECK_LAUNCH(op);
  return o;
}

}  // namespace tallow::cuda
