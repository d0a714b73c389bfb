#include "ops/cast.h"
#include "ops/common.h"

namespace tallow::ops {

Tensor dequantize(const Tensor& q, DType dtype) {
  throw NotImplementedError(str_cat("dequantize: not implemented yet for ", dtype_name(q.dtype())));
}

}  // namespace tallow::ops
