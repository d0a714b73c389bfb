#include "ops/softmax.h"
#include "ops/common.h"

namespace tallow::ops {

Tensor softmax(const Tensor& x, float scale, float softcap, const std::optional<Tensor>& out) {
  throw NotImplementedError("softmax: not implemented yet");
}

}  // namespace tallow::ops
