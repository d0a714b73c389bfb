#include "ops/cast.h"

#include "core/simd.h"
#include "ops/common.h"
#include "ops/rows.h"

namespace tallow::ops {

namespace {

// Scalar load/store for every non-block dtype: floats go through f32, integers through i64.
template <class T> struct Scalar;
template <> struct Scalar<float> { static constexpr bool kInt = false; };
template <> struct Scalar<f16_t> { static constexpr bool kInt = false; };
template <> struct Scalar<bf16_t> { static constexpr bool kInt = false; };
template <> struct Scalar<f8e4m3_t> { static constexpr bool kInt = false; };
template <> struct Scalar<int8_t> { static constexpr bool kInt = true; };
template <> struct Scalar<uint8_t> { static constexpr bool kInt = true; };
template <> struct Scalar<int32_t> { static constexpr bool kInt = true; };
template <> struct Scalar<int64_t> { static constexpr bool kInt = true; };
template <> struct Scalar<bool> { static constexpr bool kInt = true; };

template <class T> inline float load_f(T v) {
  if constexpr (Scalar<T>::kInt) return (float)v; else return to_f32(v);
}
template <class T> inline int64_t load_i(T v) {
  if constexpr (Scalar<T>::kInt) return (int64_t)v; else return (int64_t)to_f32(v);
}
template <class T> inline T store_f(float v) {
  if constexpr (std::is_same_v<T, bool>) return v != 0.0f;
  else if constexpr (Scalar<T>::kInt) return (T)v;
  else return from_f32<T>(v);
}

template <class S, class D>
TALLOW_SIMD_CLONES void cast_row(const S* TALLOW_RESTRICT s, int64_t ss, D* TALLOW_RESTRICT d, int64_t n) {
  if constexpr (Scalar<S>::kInt && Scalar<D>::kInt) {
    for (int64_t i = 0; i < n; ++i) d[i] = std::is_same_v<D, bool> ? (D)(s[i * ss] != 0) : (D)load_i(s[i * ss]);
  } else if (ss == 1) {
    TALLOW_PRAGMA_SIMD
    for (int64_t i = 0; i < n; ++i) d[i] = store_f<D>(load_f(s[i]));
  } else {
    for (int64_t i = 0; i < n; ++i) d[i] = store_f<D>(load_f(s[i * ss]));
  }
}

template <class F>
void dispatch_scalar(DType dt, F&& f) {
  switch (dt) {
    case DType::F32: return f(float{});
    case DType::F16: return f(f16_t{});
    case DType::BF16: return f(bf16_t{});
    case DType::F8E4M3: return f(f8e4m3_t{});
    case DType::I8: return f(int8_t{});
    case DType::U8: return f(uint8_t{});
    case DType::I32: return f(int32_t{});
    case DType::I64: return f(int64_t{});
    case DType::Bool: return f(bool{});
    default: throw TypeError(str_cat("cast: unsupported dtype ", dtype_name(dt)));
  }
}

}  // namespace

Tensor cast(const Tensor& x, DType dtype) {
  check_defined("cast", x, "x");
  if (is_block_dtype(x.dtype())) return dequantize(x, dtype);
  TALLOW_CHECK_TYPE(!is_block_dtype(dtype), "cast: cannot cast ", dtype_name(x.dtype()), shape_str(x.shape()), " to ",
                    dtype_name(dtype), " (quantization is not a cast)");
  if (!x.device().is_cpu()) return device_op(&BackendOps::cast, "cast", x)(x, dtype);
  Tensor o = Tensor::empty(x.shape(), dtype, x.device());
  if (dtype == x.dtype()) {
    o.copy_(x);
    return o;
  }
  const int64_t n = x.dim() ? x.size(-1) : 1, sx = x.dim() ? x.stride(-1) : 1;
  dispatch_scalar(x.dtype(), [&](auto s_tag) {
    using S = decltype(s_tag);
    dispatch_scalar(dtype, [&](auto d_tag) {
      using D = decltype(d_tag);
      parallel_rows(num_rows(o), n, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) cast_row<S, D>(row_ptr<const S>(x, r), sx, row_ptr<D>(o, r), n);
      });
    });
  });
  return o;
}

}  // namespace tallow::ops
