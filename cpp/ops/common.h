// Shared helpers for op entry points: argument checks that raise Python-visible errors naming
// the op and the shapes, and dtype dispatch to templated kernels.
#pragma once
#include <initializer_list>
#include <optional>

#include "core/backend.h"
#include "core/error.h"
#include "core/half.h"
#include "core/tensor.h"

namespace tallow::ops {

inline void check_defined(const char* op, const Tensor& t, const char* name) {
  TALLOW_CHECK(t.defined(), op, ": ", name, " is an undefined tensor");
}

inline void check_float(const char* op, const Tensor& t, const char* name) {
  TALLOW_CHECK_TYPE(t.dtype() == DType::F32 || t.dtype() == DType::F16 || t.dtype() == DType::BF16, op, ": ", name,
                    " must be float32, float16 or bfloat16, got ", dtype_name(t.dtype()), " tensor of shape ",
                    shape_str(t.shape()));
}

inline void check_dtype(const char* op, const Tensor& t, const char* name, std::initializer_list<DType> allowed) {
  for (DType d : allowed)
    if (t.dtype() == d) return;
  std::string names;
  for (DType d : allowed) names += std::string(names.empty() ? "" : ", ") + dtype_name(d);
  throw TypeError(str_cat(op, ": ", name, " must be one of {", names, "}, got ", dtype_name(t.dtype()),
                          " tensor of shape ", shape_str(t.shape())));
}

inline void check_same_dtype(const char* op, const Tensor& a, const char* an, const Tensor& b, const char* bn) {
  TALLOW_CHECK_TYPE(a.dtype() == b.dtype(), op, ": ", an, " (", dtype_name(a.dtype()), shape_str(a.shape()), ") and ",
                    bn, " (", dtype_name(b.dtype()), shape_str(b.shape()), ") must have the same dtype");
}

inline void check_contiguous(const char* op, const Tensor& t, const char* name) {
  TALLOW_CHECK(t.is_contiguous(), op, ": ", name, " of shape ", shape_str(t.shape()), " and strides ",
               shape_str(t.strides()), " must be contiguous");
}

inline void check_dim(const char* op, const Tensor& t, const char* name, int64_t ndim) {
  TALLOW_CHECK(t.dim() == ndim, op, ": ", name, " must be ", ndim, "-D, got shape ", shape_str(t.shape()));
}

inline void check_same_device(const char* op, const Tensor& a, const Tensor& b) {
  TALLOW_CHECK(a.device() == b.device(), op, ": tensors on different devices (", a.device().str(), " and ",
               b.device().str(), ")");
}

// Checks a caller-provided output or allocates one.
inline Tensor make_out(const char* op, const std::optional<Tensor>& out, const Shape& shape, DType dtype, Device device) {
  if (!out || !out->defined()) return Tensor::empty(shape, dtype, device);
  TALLOW_CHECK(out->shape() == shape, op, ": out has shape ", shape_str(out->shape()), ", expected ", shape_str(shape));
  TALLOW_CHECK_TYPE(out->dtype() == dtype, op, ": out has dtype ", dtype_name(out->dtype()), ", expected ",
                    dtype_name(dtype));
  TALLOW_CHECK(out->device() == device, op, ": out is on ", out->device().str(), ", expected ", device.str());
  TALLOW_CHECK(out->is_contiguous(), op, ": out of shape ", shape_str(shape), " must be contiguous");
  return *out;
}

// Raised by an entry point for a device this build or this op does not support; names the op, the
// device, why, and the shapes of the tensors in `args` (default: t's).
[[noreturn]] inline void unsupported_device(const char* op, const Tensor& t,
                                            std::initializer_list<const Tensor*> args = {}) {
  std::string shapes;
  for (const Tensor* a : args)
    if (a) shapes += (shapes.empty() ? "" : ", ") + (a->defined() ? shape_str(a->shape()) : std::string("undefined"));
  if (args.size() == 0) shapes = shape_str(t.shape());
  const BackendOps* b = t.device().is_cpu() ? nullptr : find_backend(t.device().type);
  const std::string why = t.device().is_cpu() ? std::string("no CPU kernel")
                          : b ? str_cat("the ", b->name, " backend registered no ", op, " kernel")
                              : std::string("no backend registered for this device type");
  throw ValueError(str_cat(op, ": no kernel for device ", t.device().str(), " in this build (", why, "; shapes ",
                           shapes, ")"));
}

// The entry point of the backend registered for t's (non-CPU) device, e.g.
//   if (!a.device().is_cpu()) return device_op(&BackendOps::matmul, op, a, {&a, &b})(a, b, out);
// and ValueError (unsupported_device) when no backend registered it.
template <class F>
F device_op(F BackendOps::*entry, const char* op, const Tensor& t, std::initializer_list<const Tensor*> args = {}) {
  const BackendOps* b = find_backend(t.device().type);
  if (b && b->*entry) return b->*entry;
  unsupported_device(op, t, args);
}

// The entry point, or nullptr (for ops with a composition to fall back on).
template <class F>
F find_device_op(F BackendOps::*entry, const Device& d) {
  const BackendOps* b = d.is_cpu() ? nullptr : find_backend(d.type);
  return b ? b->*entry : nullptr;
}

}  // namespace tallow::ops

// Calls BODY with `scalar_t` bound to the storage type of a float dtype (float, f16_t, bf16_t).
#define TALLOW_DISPATCH_FLOAT(OP, DTYPE, ...)                                                  \
  [&] {                                                                                        \
    switch (DTYPE) {                                                                           \
      case ::tallow::DType::F32: { using scalar_t = float; return __VA_ARGS__(); }             \
      case ::tallow::DType::F16: { using scalar_t = ::tallow::f16_t; return __VA_ARGS__(); }   \
      case ::tallow::DType::BF16: { using scalar_t = ::tallow::bf16_t; return __VA_ARGS__(); } \
      default:                                                                                 \
        throw ::tallow::TypeError(::tallow::str_cat(OP, ": unsupported dtype ",               \
                                                    ::tallow::dtype_name(DTYPE)));            \
    }                                                                                          \
  }()
