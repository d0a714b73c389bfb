#include "ops/matmul.h"
#include "ops/common.h"

namespace tallow::ops {

Tensor matmul(const Tensor& a, const Tensor& b, const std::optional<Tensor>& out) {
  throw NotImplementedError("matmul: not implemented yet");
}
Tensor linear(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias, const std::optional<Tensor>& out) {
  throw NotImplementedError("linear: not implemented yet");
}

}  // namespace tallow::ops
