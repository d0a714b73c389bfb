// rms_norm_linear, linear_add, gated_linear_add: argument checks, then the CUDA kernels
// (cuda/gemm.cu) or the compositions (CPU and any other backend).
#include "ops/fused_linear.h"

#include "ops/common.h"
#include "ops/elementwise.h"
#include "ops/gated_linear.h"
#include "ops/matmul.h"
#include "ops/norm.h"
#ifdef TALLOW_WITH_CUDA
#include "ops_cuda.h"
#endif

namespace tallow::ops {

namespace {

// The residual of linear_add / gated_linear_add: contiguous, x's dtype and device, shape [..., N]
// with x's leading dims.
void check_residual(const char* op, const Tensor& x, const Tensor& w, const Tensor& residual) {
  check_defined(op, residual, "residual");
  check_same_dtype(op, x, "x", residual, "residual");
  check_same_device(op, x, residual);
  Shape want = x.shape();
  want.back() = w.size(0);
  TALLOW_CHECK(residual.shape() == want, op, ": residual must have shape ", shape_str(want), " (x ",
               shape_str(x.shape()), ", w ", shape_str(w.shape()), "), got ", shape_str(residual.shape()));
  TALLOW_CHECK(residual.is_contiguous(), op, ": residual must be contiguous (it is updated in place)");
}

// Operands a fused kernel may take (anything else goes to the composition, which checks it): the
// same f16/bf16 dtype on the same device.
bool same_float_operands(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && (a.dtype() == DType::F16 || a.dtype() == DType::BF16) && a.device() == b.device();
}

}  // namespace

Tensor rms_norm_linear(const Tensor& x, const Tensor& norm_w, float eps, bool gemma_offset, const Tensor& w,
                       const std::optional<Tensor>& bias) {
  const char* op = "rms_norm_linear";
  check_defined(op, x, "x");
  check_defined(op, norm_w, "norm_w");
  check_defined(op, w, "w");
  TALLOW_CHECK(w.dim() == 2 && x.dim() >= 1 && x.size(-1) == w.size(1), op, ": x ", shape_str(x.shape()),
               " and w ", shape_str(w.shape()), " do not chain (x.shape[-1] must be w.shape[1])");
  TALLOW_CHECK(norm_w.dim() == 1 && norm_w.size(0) == x.size(-1), op, ": norm_w must have shape [", x.size(-1),
               "], got ", shape_str(norm_w.shape()));
#ifdef TALLOW_WITH_CUDA
  if (x.device().type == DeviceType::CUDA && same_float_operands(x, w) && same_float_operands(x, norm_w)) {
    if (auto fused = cuda::rms_norm_linear(x, norm_w, eps, gemma_offset ? 1.f : 0.f, w, bias)) return *fused;
  }
#endif
  return linear(rms_norm(x, norm_w, eps, gemma_offset), w, bias);
}

Tensor linear_add(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias, const Tensor& residual) {
  const char* op = "linear_add";
  check_defined(op, x, "x");
  check_defined(op, w, "w");
  TALLOW_CHECK(w.dim() == 2 && x.dim() >= 1 && x.size(-1) == w.size(1), op, ": x ", shape_str(x.shape()),
               " and w ", shape_str(w.shape()), " do not chain (x.shape[-1] must be w.shape[1])");
  check_residual(op, x, w, residual);
#ifdef TALLOW_WITH_CUDA
  if (x.device().type == DeviceType::CUDA && same_float_operands(x, w) && cuda::linear_add(x, w, bias, residual))
    return residual;
#endif
  return add(residual, linear(x, w, bias), residual);
}

Tensor gated_linear_add(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias,
                        const std::string& activation, const Tensor& residual) {
  const char* op = "gated_linear_add";
  check_defined(op, x, "x");
  check_defined(op, w, "w");
  TALLOW_CHECK(w.dim() == 2 && x.dim() >= 1 && x.size(-1) == 2 * w.size(1), op, ": x ", shape_str(x.shape()),
               " and w ", shape_str(w.shape()), ": x.shape[-1] must be 2 * w.shape[1] (gate and up halves)");
  check_residual(op, x, w, residual);
#ifdef TALLOW_WITH_CUDA
  if (x.device().type == DeviceType::CUDA && same_float_operands(x, w) &&
      cuda::gated_linear_add(x, w, bias, activation, residual))
    return residual;
#endif
  return add(residual, gated_linear(x, w, bias, activation), residual);
}

}  // namespace tallow::ops
