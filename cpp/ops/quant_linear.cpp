// dequant_linear: argument checks, tiling over W's rows and the thread split; the per-tile product is
// gemm::run (gemm_kernel.h) and the per-row dequantization dequantize_row_f32 (dequant.cpp).
#include "ops/quant_linear.h"

#include <algorithm>
#include <cstdlib>

#include "core/parallel.h"
#include "ops/cast.h"
#include "ops/common.h"
#include "ops/dequant_row.h"
#include "ops/gemm_kernel.h"
#include "ops/matmul.h"
#include "ops/rows.h"

namespace tallow::ops {

namespace {

constexpr const char* kOp = "dequant_linear";

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Grow-only, 64-byte aligned f32 buffer per thread for one dequantized tile (gemm::scratch's slots
// belong to the GEMM, which runs on this thread while the tile is live).
float* tile_buffer(int64_t n) {
  struct Buf {
    float* p = nullptr;
    int64_t cap = 0;
    ~Buf() { gemm::aligned_free(p); }
  };
  static thread_local Buf b;
  if (n > b.cap) {
    gemm::aligned_free(b.p);
    b.p = nullptr;
    b.cap = 0;
    const int64_t cap = std::max<int64_t>(1024, ceil_div(n, 1024) * 1024);
    b.p = static_cast<float*>(gemm::aligned_malloc((size_t)cap * sizeof(float)));
    if (!b.p) throw std::bad_alloc();
    b.cap = cap;
  }
  return b.p;
}

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

// At most this many rows of x: fused per-thread tiles (the GEMM's dot-product path); above, wide tiles.
constexpr int64_t kFusedMaxM = 16;
constexpr int64_t kWideTileBytes = int64_t(4) << 20;

// Rows of W per fused tile: ~48 KiB of f32, so the tile is read back from L1/L2 right after it is written;
// a multiple of 8 (the dot-product path's row groups), and at least ~4 tiles per thread where N allows.
int64_t tile_rows(int64_t K, int64_t N, int threads) {
  int64_t r = (int64_t(48) << 10) / (4 * std::max<int64_t>(K, 1));
  r = std::clamp<int64_t>(r / 8 * 8, 8, 64);
  const int64_t want = 4 * (int64_t)threads;
  if (threads > 1 && ceil_div(N, r) < want) r = std::max<int64_t>(8, ceil_div(ceil_div(N, want), 8) * 8);
  return r;
}

}  // namespace

Tensor dequant_linear(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias,
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
  if (!x.device().is_cpu())
    throw ValueError(str_cat(op, ": no kernel for device ", x.device().str(), " (x ", shape_str(x.shape()), ", w ",
                             dtype_name(w.dtype()), shape_str(w.shape()),
                             "); CPU only: on this device compose dequantize and linear"));
  Shape oshape(x.shape().begin(), x.shape().end() - 1);
  oshape.push_back(N);
  Tensor o = make_out(op, out, oshape, x.dtype(), x.device());
  if (o.numel() == 0) return o;
  const int64_t M = o.numel() / N;

  // f32 operands for the GEMM: f16/bf16 x and bias are widened once (exactly), the f32 result rounded once.
  const bool f32 = x.dtype() == DType::F32;
  Tensor xx = f32 ? x : cast(x, DType::F32);
  int64_t rsa = K;
  if (!merged_row_stride(xx, &rsa) || (K > 1 && xx.stride(-1) != 1)) {
    xx = xx.contiguous();
    rsa = K;
  }
  Tensor bb;
  if (has_bias) bb = bias->dtype() == DType::F32 ? *bias : cast(*bias, DType::F32);
  Tensor o32 = f32 ? o : Tensor::empty(oshape, DType::F32, o.device());

  const DType wdt = w.dtype();
  const int64_t bs = dtype_block_size(wdt), ts = dtype_type_size(wdt);
  const uint8_t* wbase = static_cast<const uint8_t*>(w.storage()->data());
  const bool w_rows_packed = N <= 1 || w.stride(0) == K;  // a tile of rows is one run of whole blocks
  const float* xp = xx.data<float>();
  float* op32 = o32.data<float>();
  const float* bp = has_bias ? bb.data<float>() : nullptr;
  const int64_t bstride = has_bias ? bb.stride(0) : 1;

  // Rows [n0, n0 + nr) of W -> f32 at dst (row stride K).
  auto dequant_rows = [&](int64_t n0, int64_t nr, float* dst) {
    if (K == 0 || nr == 0) return;
    if (w_rows_packed) {
      dequantize_row_f32(wdt, wbase + row_offset(w, n0) / bs * ts, dst, nr * K);
    } else {
      for (int64_t r = 0; r < nr; ++r) dequantize_row_f32(wdt, wbase + row_offset(w, n0 + r) / bs * ts, dst + r * K, K);
    }
  };
  // out[:, n0 : n0 + nr] = x @ tile^T (+ bias[n0 : n0 + nr]) for a dequantized tile of nr rows of W.
  auto gemm_tile = [&](int64_t n0, int64_t nr, const float* tile) {
    gemm::Problem p;
    p.M = M, p.N = nr, p.K = K;
    p.a = xp, p.rsa = rsa, p.csa = 1;
    p.b = tile, p.rsb = 1, p.csb = K;  // B[k, n] = tile row n, element k
    p.c = op32 + n0, p.rsc = N, p.csc = 1;
    if (bp) p.bias = bp + n0 * bstride, p.bias_mode = 1, p.bias_stride = bstride;
    gemm::run(gemm::Elt::F32, p);
  };

  const int threads = get_num_threads();
  int64_t fused_max = kFusedMaxM;
  if (const char* e = std::getenv("TALLOW_QL_FUSED")) fused_max = std::atoi(e);  // EXPERIMENT
  if (M <= fused_max) {
    // Decode: each thread dequantizes a small tile and runs the GEMM's dot-product path on it at once,
    // while it is in L1/L2 (gemm::run runs inline on a pool thread). Every output is then summed as in
    // linear(x, dequantize(w)), whatever the tiling: bit-identical to it.
    int64_t R = tile_rows(K, N, threads);
    if (const char* e = std::getenv("TALLOW_QL_R")) R = std::atoi(e);  // EXPERIMENT
    const int64_t ntiles = ceil_div(N, R);
    // Tiles per chunk of the pool: below ~64K multiply-adds a chunk, waking threads costs more than it saves.
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, R * K * std::max<int64_t>(M, 4)));
    parallel_for(0, ntiles, grain, [&](int64_t t0, int64_t t1) {
      float* buf = tile_buffer(R * K);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n0 = t * R, nr = std::min(R, N - n0);
        static const int skip = std::getenv("TALLOW_QL_SKIP") ? std::atoi(std::getenv("TALLOW_QL_SKIP")) : 0;  // EXPERIMENT
        if (skip != 2) dequant_rows(n0, nr, buf);
        if (skip != 1) gemm_tile(n0, nr, buf);
      }
    });
  } else {
    // Prefill: W is dequantized a wide tile at a time (~kWideTileBytes of f32, all threads) and each tile
    // is one GEMM on all threads, so the GEMM's own blocking and packing see few, wide problems. A last
    // tile of <= 16 rows joins the one before it: a tile that narrow would take the GEMM's transposed
    // dot-product path, which sums in another order, and results would depend on the tile width.
    int64_t RB = std::max<int64_t>(64, kWideTileBytes / (4 * std::max<int64_t>(K, 1)) / 32 * 32);
    if (const char* e = std::getenv("TALLOW_QL_RB")) RB = std::atoi(e);
    int64_t ntiles = ceil_div(N, RB);
    if (ntiles > 1 && N - (ntiles - 1) * RB <= 16) --ntiles;
    const int64_t width = ntiles == 1 ? N : std::max(RB, N - (ntiles - 1) * RB);
    float* buf = tile_buffer(width * K);
    const int64_t rgrain = std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(K, 1));
    for (int64_t t = 0; t < ntiles; ++t) {
      const int64_t n0 = t * RB, nr = t == ntiles - 1 ? N - n0 : RB;
      parallel_for(0, nr, rgrain, [&](int64_t r0, int64_t r1) { dequant_rows(n0 + r0, r1 - r0, buf + r0 * K); });
      gemm_tile(n0, nr, buf);
    }
  }

  if (f32) return o;
  o.copy_(cast(o32, x.dtype()));
  return o;
}

}  // namespace tallow::ops
