// gated_linear: argument checks, then the CUDA kernel (cuda/gemm.cu) or the composition of the
// gated activation and linear (CPU and any other backend).
#include "ops/gated_linear.h"

#include "ops/activation.h"
#include "ops/common.h"
#include "ops/matmul.h"

namespace tallow::ops {

Tensor gated_linear(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias, const std::string& activation,
                    const std::optional<Tensor>& out) {
  const char* op = "gated_linear";
  check_defined(op, x, "x");
  check_defined(op, w, "w");
  TALLOW_CHECK(activation == "silu" || activation == "gelu_tanh" || activation == "gelu", op,
               ": activation must be \"silu\", \"gelu_tanh\" or \"gelu\", got \"", activation, "\"");
  check_float(op, x, "x");
  check_float(op, w, "w");  // also rejects quantized block types
  check_same_dtype(op, x, "x", w, "w");
  check_same_device(op, x, w);
  TALLOW_CHECK(w.dim() == 2, op, ": w must be 2-D [N, K], got shape ", shape_str(w.shape()), " (x ",
               shape_str(x.shape()), ")");
  TALLOW_CHECK(x.dim() >= 1, op, ": x must be at least 1-D [..., 2K], got shape ", shape_str(x.shape()));
  const int64_t N = w.size(0), K = w.size(1);
  TALLOW_CHECK(x.size(-1) == 2 * K, op, ": x ", shape_str(x.shape()), " and w ", shape_str(w.shape()),
               ": x.shape[-1] = ", x.size(-1), " must be 2 * w.shape[1] = ", 2 * K, " (gate and up halves)");
  const bool has_bias = bias && bias->defined();
  if (has_bias) {
    check_same_dtype(op, x, "x", *bias, "bias");
    check_same_device(op, x, *bias);
    TALLOW_CHECK(bias->dim() == 1 && bias->size(0) == N, op, ": bias must have shape [", N, "] for w ",
                 shape_str(w.shape()), ", got ", shape_str(bias->shape()));
  }
  Shape oshape = x.shape();
  oshape.back() = N;
  const Tensor o = make_out(op, out, oshape, x.dtype(), x.device());
  // The backend's fused kernel where it has one; else (CPU, or a backend without it) the composition.
  if (const auto fused = find_device_op(&BackendOps::gated_linear, x.device())) return fused(x, w, bias, activation, o);
  const Tensor y = activation == "silu" ? silu_and_mul(x) : gelu_and_mul(x, activation == "gelu" ? "none" : "tanh");
  return linear(y, w, bias, o);
}

}  // namespace tallow::ops
