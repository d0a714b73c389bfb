#include "ops/activation.h"
#include "ops/common.h"

namespace tallow::ops {

Tensor silu_and_mul(const Tensor& x, const std::optional<Tensor>& out) {
  throw NotImplementedError("silu_and_mul: not implemented yet");
}
Tensor gelu_and_mul(const Tensor& x, const std::string& approximate, const std::optional<Tensor>& out) {
  throw NotImplementedError("gelu_and_mul: not implemented yet");
}

}  // namespace tallow::ops
