#include "ops/rope.h"
#include "ops/common.h"

namespace tallow::ops {

void rotary_embedding(const Tensor& positions, Tensor& q, std::optional<Tensor> k, const Tensor& cos_sin_cache,
                      bool neox) {
  throw NotImplementedError("rotary_embedding: not implemented yet");
}

}  // namespace tallow::ops
