#include "ops/attention.h"
#include "ops/common.h"

namespace tallow::ops {

Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, float scale, bool causal, int64_t sliding_window,
                 float softcap) {
  throw NotImplementedError("attention: not implemented yet");
}

}  // namespace tallow::ops
