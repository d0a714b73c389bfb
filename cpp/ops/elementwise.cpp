#include "ops/elementwise.h"

#include "core/simd.h"
#include "ops/common.h"
#include "ops/rows.h"

namespace tallow::ops {

namespace {

Shape broadcast_shape(const char* op, const Shape& a, const Shape& b) {
  const size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t da = i + a.size() >= n ? a[i + a.size() - n] : 1;
    const int64_t db = i + b.size() >= n ? b[i + b.size() - n] : 1;
    TALLOW_CHECK(da == db || da == 1 || db == 1, op, ": shapes ", shape_str(a), " and ", shape_str(b),
                 " cannot be broadcast together");
    out[i] = da == 1 ? db : da;
  }
  return out;
}

enum class BinOp { Add, Mul };

template <class T, BinOp kOp>
TALLOW_SIMD_CLONES void binary_row(const T* TALLOW_RESTRICT a, int64_t sa, const T* TALLOW_RESTRICT b, int64_t sb,
                                   T* TALLOW_RESTRICT o, int64_t n) {
  if (sa == 1 && sb == 1) {
    TALLOW_PRAGMA_SIMD
    for (int64_t i = 0; i < n; ++i) {
      const float x = to_f32(a[i]), y = to_f32(b[i]);
      o[i] = from_f32<T>(kOp == BinOp::Add ? x + y : x * y);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const float x = to_f32(a[i * sa]), y = to_f32(b[i * sb]);
      o[i] = from_f32<T>(kOp == BinOp::Add ? x + y : x * y);
    }
  }
}

template <BinOp kOp>
Tensor binary(const char* op, const Tensor& a, const Tensor& b, const std::optional<Tensor>& out) {
  check_defined(op, a, "a");
  check_defined(op, b, "b");
  check_float(op, a, "a");
  check_same_dtype(op, a, "a", b, "b");
  check_same_device(op, a, b);
  const Shape shape = broadcast_shape(op, a.shape(), b.shape());
  Tensor o = make_out(op, out, shape, a.dtype(), a.device());
  if (!a.device().is_cpu())
    return device_op(kOp == BinOp::Add ? &BackendOps::add : &BackendOps::mul, op, a, {&a, &b})(a, b, o);
  const Tensor ea = a.expand(shape), eb = b.expand(shape);
  const int64_t n = shape.empty() ? 1 : shape.back();
  const int64_t sa = shape.empty() ? 1 : ea.stride(-1), sb = shape.empty() ? 1 : eb.stride(-1);
  const int64_t rows = num_rows(o);
  TALLOW_DISPATCH_FLOAT(op, a.dtype(), [&] {
    parallel_rows(rows, n, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        binary_row<scalar_t, kOp>(row_ptr<const scalar_t>(ea, r), sa, row_ptr<const scalar_t>(eb, r), sb,
                                  row_ptr<scalar_t>(o, r), n);
    });
  });
  return o;
}

template <class T>
TALLOW_SIMD_CLONES void scale_row(const T* TALLOW_RESTRICT a, int64_t sa, float s, T* TALLOW_RESTRICT o, int64_t n) {
  if (sa == 1) {
    TALLOW_PRAGMA_SIMD
    for (int64_t i = 0; i < n; ++i) o[i] = from_f32<T>(to_f32(a[i]) * s);
  } else {
    for (int64_t i = 0; i < n; ++i) o[i] = from_f32<T>(to_f32(a[i * sa]) * s);
  }
}

}  // namespace

Tensor add(const Tensor& a, const Tensor& b, const std::optional<Tensor>& out) {
  return binary<BinOp::Add>("add", a, b, out);
}

Tensor mul(const Tensor& a, const Tensor& b, const std::optional<Tensor>& out) {
  return binary<BinOp::Mul>("mul", a, b, out);
}

Tensor scale(const Tensor& a, float s, const std::optional<Tensor>& out) {
  check_defined("scale", a, "a");
  check_float("scale", a, "a");
  Tensor o = make_out("scale", out, a.shape(), a.dtype(), a.device());
  if (!a.device().is_cpu()) return device_op(&BackendOps::scale, "scale", a)(a, s, o);
  const int64_t n = a.dim() ? a.size(-1) : 1, sa = a.dim() ? a.stride(-1) : 1;
  TALLOW_DISPATCH_FLOAT("scale", a.dtype(), [&] {
    parallel_rows(num_rows(o), n, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) scale_row<scalar_t>(row_ptr<const scalar_t>(a, r), sa, s, row_ptr<scalar_t>(o, r), n);
    });
  });
  return o;
}

}  // namespace tallow::ops
