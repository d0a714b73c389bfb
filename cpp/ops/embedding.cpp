#include "ops/embedding.h"
#include "ops/common.h"

namespace tallow::ops {

Tensor embedding(const Tensor& ids, const Tensor& table, std::optional<DType> out_dtype) {
  throw NotImplementedError("embedding: not implemented yet");
}

}  // namespace tallow::ops
