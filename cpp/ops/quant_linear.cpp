// quant_linear: argument checks, the device dispatch and the two CPU paths: decode (M <= kDecodeMaxM rows
// of x, a type with a quantized dot kernel): x quantized once to 8 bits, integer dots on W's blocks
// (quant_dot.h), the threads splitting W's rows; otherwise W dequantized tile by tile, each tile one
// gemm::run (gemm_kernel.h; per-row dequantization: dequantize_row_f32, dequant.cpp).
//
// Measured (2 threads pinned to 2 cores of an idle 16-core Intel Xeon host (the GPU machine's CPU; the
// 2-core build machine was too loaded to time), W cycled over > 128 MB of copies, random blocks; GB/s =
// W's quantized bytes per call; standalone C++ driver, dequantized tiles = the previous build):
//   M = 1, GB/s quant dots vs dequantized tiles: q4_1 lm_head 49152x576 9.1 vs 5.4, 4096x4096 10.0 vs 5.7,
//   gate_up 3072x576 7.4 vs 5.4; q8_0 lm_head 11.8 vs 10.0, 4096x4096 10.8 vs 8.0; q4_k 4096x4096 8.9 vs 4.5;
//   q6_k 4096x4096 11.0 vs 5.7. M = 2 and 4: still faster on most shapes (q4_1 4096x4096 M=4: 5.2 vs 4.1),
//   q8_0 qkv 960x576 at M = 4 slower (5.4 vs 6.7). M = 8: slower for q4_1 / q4_k (q4_1 qkv 2.1 vs 3.3;
//   the decode kernels re-unpack each W block per 4 rows of x), faster for q8_0; M = 16: slower for all
//   (q4_1 1.3 vs 2.0). Hence kDecodeMaxM = 4. Not tried: an int8 GEMM over the quantized x for prefill
//   (M > 4 keeps the dequantized f32 tiles).
#include "ops/quant_linear.h"

#include <algorithm>
#include <vector>

#include "core/parallel.h"
#include "ops/cast.h"
#include "ops/common.h"
#include "ops/dequant_row.h"
#include "ops/gemm_kernel.h"
#include "ops/matmul.h"
#include "ops/quant_dot.h"
#include "ops/rows.h"

namespace tallow::ops {

namespace {

constexpr const char* kOp = "quant_linear";

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A grow-only, 64-byte aligned buffer per thread and Tag: no allocation per call. Tags: the f32 tile of
// dequantized W (gemm::scratch's slots belong to the GEMM, which runs on this thread while the tile is live),
// and the decode path's quantized rows of x (the pool's workers only read it while the call runs).
template <class Tag>
uint8_t* thread_buffer(int64_t nbytes) {
  struct Buf {
    uint8_t* p = nullptr;
    int64_t cap = 0;
    ~Buf() { gemm::aligned_free(p); }
  };
  static thread_local Buf b;
  if (nbytes > b.cap) {
    gemm::aligned_free(b.p);
    b.p = nullptr;
    b.cap = 0;
    const int64_t cap = std::max<int64_t>(4096, ceil_div(nbytes, 4096) * 4096);
    b.p = static_cast<uint8_t*>(gemm::aligned_malloc((size_t)cap));
    if (!b.p) throw std::bad_alloc();
    b.cap = cap;
  }
  return b.p;
}
struct TileTag {};
struct ActTag {};
float* tile_buffer(int64_t n) { return reinterpret_cast<float*>(thread_buffer<TileTag>(n * (int64_t)sizeof(float))); }
uint8_t* act_buffer(int64_t n) { return thread_buffer<ActTag>(n); }

// Row stride of x viewed as [rows, K] (dims [0, dim-2] merged), or false when they cannot be merged.
bool merged_row_stride(const Tensor& x, int64_t* stride) {
  if (x.dim() < 2) {
    *stride = x.size(-1);
    return true;
  }
  const int64_t last = x.dim() - 2;
  int64_t s = x.stride(last), span = x.size(last);
  for (int64_t d = last - 1; d >= 0; --d) {
    if (x.size(d) == 1) continue;
    if (span == 1) {
      s = x.stride(d), span = x.size(d);
      continue;
    }
    if (x.stride(d) != s * span) return false;
    span *= x.size(d);
  }
  *stride = s;
  return true;
}

// x, bias and out as f32 for the kernels: f16/bf16 x and bias widened once (exactly), x made row-mergeable;
// finish() rounds the f32 result once into out.
struct F32Operands {
  bool f32;
  Tensor xx, bb, o32;
  int64_t rsa;  // row stride of xx viewed as [rows, K]
  const float* xp;
  float* op;
  const float* bp = nullptr;
  int64_t bstride = 1;

  F32Operands(const Tensor& x, const Tensor* bias, const Tensor& o, int64_t K)
      : f32(x.dtype() == DType::F32), xx(f32 ? x : cast(x, DType::F32)), rsa(K) {
    if (!merged_row_stride(xx, &rsa) || (K > 1 && xx.stride(-1) != 1)) {
      xx = xx.contiguous();
      rsa = K;
    }
    if (bias) {
      bb = bias->dtype() == DType::F32 ? *bias : cast(*bias, DType::F32);
      bp = bb.data<float>();
      bstride = bb.stride(0);
    }
    o32 = f32 ? o : Tensor::empty(o.shape(), DType::F32, o.device());
    xp = xx.data<float>();
    op = o32.data<float>();
  }
  Tensor finish(Tensor& o) const {
    if (!f32) o.copy_(cast(o32, o.dtype()));
    return o;
  }
};

// At most this many rows of x: the GEMM's dot-product path (decode); above it, its packed path.
constexpr int64_t kFusedMaxM = 16;
// At most this many rows of x: the quantized-dot decode path (quant_dot.h) for the types it covers. Measured
// (see the top of this file) faster than the dequantized tiles up to M = 4 and slower from M = 8 on.
constexpr int64_t kDecodeMaxM = 4;

// Rows of W per tile, a multiple of 8. M <= 16: ~48 KiB of f32 (8-64 rows), so the tile is read back
// from L1/L2 right after it is written, and at least ~4 tiles per thread where N allows. M > 16: up to
// 128 rows (<= ~1 MiB, L2) so packing x once per tile stays a small share of the tile's flops, at least 24
// rows, and a tile count that is a multiple of the thread count, so the threads finish together.
int64_t tile_rows(int64_t M, int64_t N, int64_t K, int threads) {
  const int64_t k4 = 4 * std::max<int64_t>(K, 1);
  if (M <= kFusedMaxM) {
    int64_t r = std::clamp<int64_t>((int64_t(48) << 10) / k4 / 8 * 8, 8, 64);
    const int64_t want = 4 * (int64_t)threads;
    if (threads > 1 && ceil_div(N, r) < want) r = std::max<int64_t>(8, ceil_div(ceil_div(N, want), 8) * 8);
    return r;
  }
  const int64_t rmax = std::clamp<int64_t>((int64_t(1) << 20) / k4 / 8 * 8, 24, 128);
  const int64_t ntiles = ceil_div(ceil_div(N, rmax), (int64_t)threads) * threads;
  return std::max<int64_t>(24, ceil_div(ceil_div(N, ntiles), 8) * 8);
}

}  // namespace

Tensor quant_linear(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias,
                      const std::optional<Tensor>& out) {
  const char* op = kOp;
  check_defined(op, x, "x");
  check_defined(op, w, "w");
  check_float(op, x, "x");
  const bool float_w = w.dtype() == DType::F32 || w.dtype() == DType::F16 || w.dtype() == DType::BF16;
  TALLOW_CHECK_TYPE(is_block_dtype(w.dtype()) || float_w, op,
                    ": w must be a GGUF block dtype (q4_0 ... q8_k) or float32/float16/bfloat16, got ",
                    dtype_name(w.dtype()), " tensor of shape ", shape_str(w.shape()), " (x ", shape_str(x.shape()),
                    ")");
  if (float_w) {
    check_same_dtype(op, x, "x", w, "w");
    return linear(x, w, bias, out);
  }
  check_same_device(op, x, w);
  TALLOW_CHECK(w.dim() == 2, op, ": w must be 2-D [N, K], got ", dtype_name(w.dtype()), " shape ",
               shape_str(w.shape()), " (x ", shape_str(x.shape()), ")");
  TALLOW_CHECK(x.dim() >= 1, op, ": x must be at least 1-D [..., K], got shape ", shape_str(x.shape()));
  const int64_t N = w.size(0), K = w.size(1);
  TALLOW_CHECK(x.size(-1) == K, op, ": x ", shape_str(x.shape()), " and w ", dtype_name(w.dtype()),
               shape_str(w.shape()), ": x.shape[-1] = ", x.size(-1), " must equal w.shape[1] = ", K);
  TALLOW_CHECK(K <= 1 || w.stride(1) == 1, op, ": w ", dtype_name(w.dtype()), shape_str(w.shape()),
               " with strides ", shape_str(w.strides()), " must be contiguous along K");
  const bool has_bias = bias && bias->defined();
  if (has_bias) {
    check_same_dtype(op, x, "x", *bias, "bias");
    check_same_device(op, x, *bias);
    TALLOW_CHECK(bias->dim() == 1 && bias->size(0) == N, op, ": bias must have shape [", N, "] for w ",
                 dtype_name(w.dtype()), shape_str(w.shape()), ", got ", shape_str(bias->shape()));
  }
  Shape oshape(x.shape().begin(), x.shape().end() - 1);
  oshape.push_back(N);
  if (!x.device().is_cpu()) {
    const auto kernel = device_op(&BackendOps::quant_linear, op, x, {&x, &w});
    return kernel(x, w, bias, make_out(op, out, oshape, x.dtype(), x.device()));
  }
  Tensor o = make_out(op, out, oshape, x.dtype(), x.device());
  if (o.numel() == 0) return o;
  const int64_t M = o.numel() / N;

  // f32 operands for the kernels: f16/bf16 x and bias are widened once (exactly), the f32 result rounded once.
  F32Operands f(x, has_bias ? &*bias : nullptr, o, K);
  const int64_t rsa = f.rsa;
  const float* xp = f.xp;
  float* op32 = f.op;
  const float* bp = f.bp;
  const int64_t bstride = f.bstride;

  const DType wdt = w.dtype();
  const int64_t bs = dtype_block_size(wdt), ts = dtype_type_size(wdt);
  const uint8_t* wbase = static_cast<const uint8_t*>(w.storage()->data());
  const bool w_rows_packed = N <= 1 || w.stride(0) == K;  // a tile of rows is one run of whole blocks

  // Rows [n0, n0 + nr) of W -> f32 at dst (row stride K).
  auto dequant_rows = [&](int64_t n0, int64_t nr, float* dst) {
    if (K == 0 || nr == 0) return;
    if (w_rows_packed) {
      dequantize_row_f32(wdt, wbase + row_offset(w, n0) / bs * ts, dst, nr * K);
    } else {
      for (int64_t r = 0; r < nr; ++r) dequantize_row_f32(wdt, wbase + row_offset(w, n0 + r) / bs * ts, dst + r * K, K);
    }
  };
  // out[:, n0 : n0 + nr] = x @ tile^T (+ bias[n0 : n0 + nr]) for a dequantized tile of nr rows of W. (Posing
  // it as out^T = tile · xT with x transposed once per call, so both operands pack by plain copies, measured
  // 1.4-1.5x slower at M = 256 than this: the GEMM's own choice of orientation per tile.)
  auto gemm_tile = [&](int64_t n0, int64_t nr, const float* tile) {
    gemm::Problem p;
    p.M = M, p.N = nr, p.K = K;
    p.a = xp, p.rsa = rsa, p.csa = 1;
    p.b = tile, p.rsb = 1, p.csb = K;  // B[k, n] = tile row n, element k
    p.c = op32 + n0, p.rsc = N, p.csc = 1;
    if (bp) p.bias = bp + n0 * bstride, p.bias_mode = 1, p.bias_stride = bstride;
    gemm::run(gemm::Elt::F32, p);
  };

  if (M <= kDecodeMaxM && K > 0 && qdot::supported(wdt)) {
    // Decode: x's rows quantized once (at most 4 x K x ~1.2 bytes), then integer dots straight on W's
    // blocks. Chunks of >= 16 W rows (~64K multiply-adds or more): waking a thread costs more below that.
    const int64_t arb = qdot::act_row_bytes(wdt, K);
    uint8_t* act = act_buffer(M * arb);
    qdot::quantize_rows(wdt, xp, rsa, M, K, act);
    const int64_t wrs = N > 1 ? w.stride(0) / bs * ts : 0;
    const uint8_t* w0 = wbase + row_offset(w, 0) / bs * ts;
    const int64_t grain = std::max<int64_t>(16, (int64_t(1) << 16) / std::max<int64_t>(1, K * M));
    parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
      qdot::dot_rows(wdt, w0, wrs, n0, n1, act, M, K, op32, N, bp, bstride);
    });
  } else {
    const int threads = get_num_threads();
    const int64_t R = tile_rows(M, N, K, threads);
    int64_t ntiles = ceil_div(N, R);
    // Above 16 rows of x a tile of <= 16 rows of W would switch the GEMM to its transposed dot-product
    // path, another summation order: a short last tile joins the one before it (the buffer has room).
    if (M > kFusedMaxM && ntiles > 1 && N - (ntiles - 1) * R <= 16) --ntiles;
    // Tiles per chunk of the pool: below ~64K multiply-adds a chunk, waking threads costs more than it saves.
    const int64_t grain =
        std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, R * K * std::max<int64_t>(M, 4)));
    parallel_for(0, ntiles, grain, [&](int64_t t0, int64_t t1) {
      float* buf = tile_buffer((R + 16) * K);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n0 = t * R, nr = t == ntiles - 1 ? N - n0 : R;
        dequant_rows(n0, nr, buf);
        gemm_tile(n0, nr, buf);
      }
    });
  }

  return f.finish(o);
}

Tensor quant_linear_parts(const Tensor& x, const std::vector<Tensor>& parts, const std::optional<Tensor>& bias,
                          const std::optional<Tensor>& out) {
  const char* op = "quant_linear_parts";
  check_defined(op, x, "x");
  check_float(op, x, "x");
  TALLOW_CHECK(!parts.empty(), op, ": parts must hold at least one weight [N_i, K] (x ", shape_str(x.shape()), ")");
  TALLOW_CHECK(x.dim() >= 1, op, ": x must be at least 1-D [..., K], got shape ", shape_str(x.shape()));
  const int64_t K = x.size(-1);
  int64_t N = 0;
  bool all_dot = true;  // every part has a quantized dot kernel (else: one quant_linear per part)
  for (size_t i = 0; i < parts.size(); ++i) {
    const Tensor& w = parts[i];
    check_defined(op, w, "parts[i]");
    TALLOW_CHECK(w.dim() == 2 && w.size(1) == K, op, ": parts[", i, "] must be [N_i, K = x.shape[-1] = ", K,
                 "], got ", dtype_name(w.dtype()), shape_str(w.shape()), " (x ", shape_str(x.shape()), ")");
    check_same_device(op, x, w);
    N += w.size(0);
    all_dot = all_dot && qdot::supported(w.dtype()) && (K <= 1 || w.stride(1) == 1);
  }
  const bool has_bias = bias && bias->defined();
  if (has_bias) {
    check_same_dtype(op, x, "x", *bias, "bias");
    check_same_device(op, x, *bias);
    TALLOW_CHECK(bias->dim() == 1 && bias->size(0) == N, op, ": bias must have shape [", N,
                 "] (the parts' rows together), got ", shape_str(bias->shape()));
  }
  TALLOW_CHECK(x.device().is_cpu(), op, ": CPU only, x is on ", x.device().str(),
               " (use one weight of all rows, or one quant_linear per part, there)");
  Shape oshape(x.shape().begin(), x.shape().end() - 1);
  oshape.push_back(N);
  Tensor o = make_out(op, out, oshape, x.dtype(), x.device());
  if (o.numel() == 0) return o;
  const int64_t M = o.numel() / N;

  if (!(M <= kDecodeMaxM && K > 0 && all_dot)) {
    // One product per part, each into its columns (through a scratch tensor when they are strided).
    int64_t start = 0;
    for (const Tensor& w : parts) {
      const int64_t n = w.size(0);
      std::optional<Tensor> b;
      if (has_bias) b = bias->narrow(0, start, n);
      Tensor dst = o.narrow(o.dim() - 1, start, n);
      if (dst.is_contiguous()) {
        quant_linear(x, w, b, dst);
      } else {
        dst.copy_(quant_linear(x, w, b));
      }
      start += n;
    }
    return o;
  }

  // Decode: as quant_linear's decode path, over all parts at once.
  F32Operands f(x, has_bias ? &*bias : nullptr, o, K);
  const int64_t rsa = f.rsa;
  const float* xp = f.xp;
  float* op32 = f.op;
  const float* bp = f.bp;
  const int64_t bstride = f.bstride;

  // x quantized once per activation format (per 32: Q4_0 ... IQ4_NL; per 256: the K-quants, IQ4_XS).
  struct Part {
    DType dt;
    const uint8_t* w0;
    int64_t wrs, start, n;
    const uint8_t* act;
  };
  std::vector<Part> ps;
  ps.reserve(parts.size());
  DType fmt_dt[2] = {DType::F32, DType::F32};  // a weight dtype for each format used (32, 256)
  for (const Tensor& w : parts) fmt_dt[qdot::act_block(w.dtype()) == 256] = w.dtype();
  int64_t fmt_off[2] = {0, 0}, total = 0;
  for (int f = 0; f < 2; ++f)
    if (fmt_dt[f] != DType::F32) fmt_off[f] = total, total += ceil_div(M * qdot::act_row_bytes(fmt_dt[f], K), 64) * 64;
  uint8_t* act = act_buffer(total);
  for (int f = 0; f < 2; ++f)
    if (fmt_dt[f] != DType::F32) qdot::quantize_rows(fmt_dt[f], xp, rsa, M, K, act + fmt_off[f]);
  int64_t start = 0;
  for (const Tensor& w : parts) {
    const DType dt = w.dtype();
    const int64_t bs = dtype_block_size(dt), ts = dtype_type_size(dt), n = w.size(0);
    const uint8_t* wbase = static_cast<const uint8_t*>(w.storage()->data());
    ps.push_back({dt, wbase + row_offset(w, 0) / bs * ts, n > 1 ? w.stride(0) / bs * ts : 0, start, n,
                  act + fmt_off[qdot::act_block(dt) == 256]});
    start += n;
  }
  const int64_t grain = std::max<int64_t>(16, (int64_t(1) << 16) / std::max<int64_t>(1, K * M));
  parallel_for(0, N, grain, [&](int64_t r0, int64_t r1) {
    for (const Part& p : ps) {
      const int64_t lo = std::max(r0, p.start), hi = std::min(r1, p.start + p.n);
      if (lo >= hi) continue;
      qdot::dot_rows(p.dt, p.w0, p.wrs, lo - p.start, hi - p.start, p.act, M, K, op32 + p.start, N,
                     bp ? bp + p.start * bstride : nullptr, bstride);
    }
  });
  return f.finish(o);
}

}  // namespace tallow::ops
