#include "ops/norm.h"
#include "ops/common.h"

namespace tallow::ops {

Tensor rms_norm(const Tensor& x, const Tensor& w, float eps, bool gemma_offset, const std::optional<Tensor>& out) {
  throw NotImplementedError("rms_norm: not implemented yet");
}
Tensor fused_add_rms_norm(const Tensor& x, const Tensor& residual, const Tensor& w, float eps, bool gemma_offset) {
  throw NotImplementedError("fused_add_rms_norm: not implemented yet");
}
Tensor layer_norm(const Tensor& x, const std::optional<Tensor>& w, const std::optional<Tensor>& b, float eps,
                  const std::optional<Tensor>& out) {
  throw NotImplementedError("layer_norm: not implemented yet");
}

}  // namespace tallow::ops
