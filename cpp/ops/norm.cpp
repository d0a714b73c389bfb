// Family status: CPU implementation complete and tested (tests/python/backend_ops/cases_norm.py).
// RMSNorm, fused residual-add RMSNorm and LayerNorm over the last dimension (CPU).
//
// All arithmetic is f32 (sums in f32 vector lanes per block of 128, blocks added in double), each output
// element is rounded once to the output dtype. The weight (and bias) are converted to f32 once per
// call, so `gemma_offset`'s (1 + w) is formed in f32 exactly as the kernel uses it.
//
// Layout: x may have any strides (a last dim with stride != 1 is first copied to a contiguous
// tensor); rows may be strided views. w / b are 1-D [H] of x's dtype with any stride. `out`, when
// given, must be contiguous with x's shape and dtype. fused_add_rms_norm updates `residual` in place,
// so residual's last dim must be contiguous (its rows may be strided); residual may have its own
// float dtype (e.g. an f32 residual stream with bf16 activations): x + residual is computed in f32,
// rounded to residual's dtype and stored, and the normed output is computed from that rounded
// value (vLLM's ordering); the output has x's dtype.
#include "ops/norm.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/simd.h"
#include "ops/common.h"
#include "ops/rows.h"

#define TALLOW_NORM_PRAGMA(x) _Pragma(#x)
#if defined(_MSC_VER) && !defined(__clang__)
#define TALLOW_SIMD_SUM(v) __pragma(omp simd reduction(+ : v))
#else
#define TALLOW_SIMD_SUM(v) TALLOW_NORM_PRAGMA(omp simd reduction(+ : v))
#endif

namespace tallow::ops {

namespace {

// x [..., H] -> (H, rows); raises for 0-d x.
void check_x(const char* op, const Tensor& x) {
  check_defined(op, x, "x");
  check_float(op, x, "x");
  TALLOW_CHECK(x.dim() >= 1, op, ": x must have at least 1 dimension, got a 0-d tensor");
}

// A 1-D [H] parameter of x's dtype on x's device, converted to f32 (plus `add`).
std::vector<float> param_f32(const char* op, const Tensor& p, const char* name, const Tensor& x, float add) {
  check_defined(op, p, name);
  check_float(op, p, name);
  check_same_dtype(op, x, "x", p, name);
  check_same_device(op, x, p);
  const int64_t h = x.size(-1);
  TALLOW_CHECK(p.dim() == 1 && p.size(0) == h, op, ": ", name, " must have shape [", h, "] to match x of shape ",
               shape_str(x.shape()), ", got ", shape_str(p.shape()));
  std::vector<float> v((size_t)h);
  if (!p.device().is_cpu()) return v;  // caller raises unsupported_device
  const int64_t s = p.stride(0);
  TALLOW_DISPATCH_FLOAT(op, p.dtype(), [&] {
    const scalar_t* src = row_ptr<const scalar_t>(p, 0);
    for (int64_t i = 0; i < h; ++i) v[(size_t)i] = to_f32(src[i * s]) + add;
  });
  return v;
}

Tensor last_dim_contiguous(const Tensor& x) { return x.dim() && x.stride(-1) != 1 && x.size(-1) > 1 ? x.contiguous() : x; }

// Sums are blocked: each block of kBlock elements is reduced in f32 vector lanes, block sums are
// added in double, so the error stays ~kBlock/lanes f32 ulps however long the row (and in the
// unvectorised baseline clone too).
constexpr int64_t kBlock = 128;

template <class T>
TALLOW_SIMD_CLONES void rms_row(const T* TALLOW_RESTRICT x, const float* TALLOW_RESTRICT w, T* TALLOW_RESTRICT o,
                                int64_t n, float eps) {
  double ss = 0.0;
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t i1 = std::min(n, i0 + kBlock);
    float b = 0.0f;
    TALLOW_SIMD_SUM(b)
    for (int64_t i = i0; i < i1; ++i) {
      const float v = to_f32(x[i]);
      b += v * v;
    }
    ss += b;
  }
  const float inv = (float)(1.0 / std::sqrt(ss / (double)n + (double)eps));
  TALLOW_PRAGMA_SIMD
  for (int64_t i = 0; i < n; ++i) o[i] = from_f32<T>(to_f32(x[i]) * inv * w[i]);
}

// r = round_R(r + x) in place; o = rms_norm(r) in X.
template <class X, class R>
TALLOW_SIMD_CLONES void add_rms_row(const X* TALLOW_RESTRICT x, R* TALLOW_RESTRICT r, const float* TALLOW_RESTRICT w,
                                    X* TALLOW_RESTRICT o, int64_t n, float eps) {
  double ss = 0.0;
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t i1 = std::min(n, i0 + kBlock);
    float b = 0.0f;
    TALLOW_SIMD_SUM(b)
    for (int64_t i = i0; i < i1; ++i) {
      const R s = from_f32<R>(to_f32(r[i]) + to_f32(x[i]));
      r[i] = s;
      const float v = to_f32(s);
      b += v * v;
    }
    ss += b;
  }
  const float inv = (float)(1.0 / std::sqrt(ss / (double)n + (double)eps));
  TALLOW_PRAGMA_SIMD
  for (int64_t i = 0; i < n; ++i) o[i] = from_f32<X>(to_f32(r[i]) * inv * w[i]);
}

template <class T>
TALLOW_SIMD_CLONES void layer_norm_row(const T* TALLOW_RESTRICT x, const float* TALLOW_RESTRICT w,
                                       const float* TALLOW_RESTRICT b, T* TALLOW_RESTRICT o, int64_t n, float eps) {
  double sum = 0.0;
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t i1 = std::min(n, i0 + kBlock);
    float s = 0.0f;
    TALLOW_SIMD_SUM(s)
    for (int64_t i = i0; i < i1; ++i) s += to_f32(x[i]);
    sum += s;
  }
  const float mean = (float)(sum / (double)n);
  double sq = 0.0;  // two-pass variance: no cancellation from E[x^2] - E[x]^2
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t i1 = std::min(n, i0 + kBlock);
    float s = 0.0f;
    TALLOW_SIMD_SUM(s)
    for (int64_t i = i0; i < i1; ++i) {
      const float d = to_f32(x[i]) - mean;
      s += d * d;
    }
    sq += s;
  }
  const float inv = (float)(1.0 / std::sqrt(sq / (double)n + (double)eps));
  TALLOW_PRAGMA_SIMD
  for (int64_t i = 0; i < n; ++i) o[i] = from_f32<T>((to_f32(x[i]) - mean) * inv * w[i] + b[i]);
}

void check_eps(const char* op, float eps) {
  TALLOW_CHECK(std::isfinite(eps) && eps >= 0.0f, op, ": eps must be finite and >= 0, got ", eps);
}

}  // namespace

Tensor rms_norm(const Tensor& x_in, const Tensor& w, float eps, bool gemma_offset, const std::optional<Tensor>& out) {
  const char* op = "rms_norm";
  check_x(op, x_in);
  check_eps(op, eps);
  const std::vector<float> wf = param_f32(op, w, "w", x_in, gemma_offset ? 1.0f : 0.0f);
  Tensor o = make_out(op, out, x_in.shape(), x_in.dtype(), x_in.device());
  if (!x_in.device().is_cpu()) return device_op(&BackendOps::rms_norm, op, x_in, {&x_in, &w})(x_in, w, eps, gemma_offset, o);
  const Tensor x = last_dim_contiguous(x_in);
  const int64_t n = x.size(-1);
  TALLOW_DISPATCH_FLOAT(op, x.dtype(), [&] {
    parallel_rows(num_rows(o), 2 * n, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        rms_row<scalar_t>(row_ptr<const scalar_t>(x, r), wf.data(), row_ptr<scalar_t>(o, r), n, eps);
    });
  });
  return o;
}

Tensor fused_add_rms_norm(const Tensor& x_in, const Tensor& residual, const Tensor& w, float eps, bool gemma_offset) {
  const char* op = "fused_add_rms_norm";
  check_x(op, x_in);
  check_eps(op, eps);
  check_defined(op, residual, "residual");
  check_float(op, residual, "residual");
  check_same_device(op, x_in, residual);
  TALLOW_CHECK(residual.shape() == x_in.shape(), op, ": residual has shape ", shape_str(residual.shape()),
               ", x has shape ", shape_str(x_in.shape()), "; they must match");
  TALLOW_CHECK(residual.stride(-1) == 1 || residual.size(-1) <= 1, op, ": residual of shape ",
               shape_str(residual.shape()), " and strides ", shape_str(residual.strides()),
               " is updated in place and needs a contiguous last dimension");
  const std::vector<float> wf = param_f32(op, w, "w", x_in, gemma_offset ? 1.0f : 0.0f);
  if (!x_in.device().is_cpu())
    return device_op(&BackendOps::fused_add_rms_norm, op, x_in, {&x_in, &residual, &w})(x_in, residual, w, eps,
                                                                                         gemma_offset);
  for (int64_t d = 0; d < residual.dim(); ++d)
    TALLOW_CHECK(residual.stride(d) != 0 || residual.size(d) <= 1, op, ": residual of shape ",
                 shape_str(residual.shape()), " is a broadcast view (stride 0) and cannot be updated in place");
  // x aliasing residual (e.g. the same tensor passed twice) is read from a copy.
  const Tensor x = x_in.storage() == residual.storage() ? x_in.clone() : last_dim_contiguous(x_in);
  Tensor o = Tensor::empty(x.shape(), x.dtype(), x.device());
  const int64_t n = x.size(-1);
  TALLOW_DISPATCH_FLOAT(op, x.dtype(), [&] {
    using X = scalar_t;
    TALLOW_DISPATCH_FLOAT(op, residual.dtype(), [&] {
      using R = scalar_t;
      parallel_rows(num_rows(o), 3 * n, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r)
          add_rms_row<X, R>(row_ptr<const X>(x, r), row_ptr<R>(residual, r), wf.data(), row_ptr<X>(o, r), n, eps);
      });
    });
  });
  return o;
}

Tensor layer_norm(const Tensor& x_in, const std::optional<Tensor>& w, const std::optional<Tensor>& b, float eps,
                  const std::optional<Tensor>& out) {
  const char* op = "layer_norm";
  check_x(op, x_in);
  check_eps(op, eps);
  const int64_t n = x_in.size(-1);
  const std::vector<float> wf =
      w && w->defined() ? param_f32(op, *w, "w", x_in, 0.0f) : std::vector<float>((size_t)n, 1.0f);
  const std::vector<float> bf =
      b && b->defined() ? param_f32(op, *b, "b", x_in, 0.0f) : std::vector<float>((size_t)n, 0.0f);
  Tensor o = make_out(op, out, x_in.shape(), x_in.dtype(), x_in.device());
  if (!x_in.device().is_cpu()) return device_op(&BackendOps::layer_norm, op, x_in)(x_in, w, b, eps, o);
  const Tensor x = last_dim_contiguous(x_in);
  TALLOW_DISPATCH_FLOAT(op, x.dtype(), [&] {
    parallel_rows(num_rows(o), 3 * n, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        layer_norm_row<scalar_t>(row_ptr<const scalar_t>(x, r), wf.data(), bf.data(), row_ptr<scalar_t>(o, r), n, eps);
    });
  });
  return o;
}

}  // namespace tallow::ops
