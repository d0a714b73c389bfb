#include "ops/random.h"

#include <cmath>

#include "core/parallel.h"
#include "ops/common.h"

namespace tallow::ops {

namespace {

template <class T>
void fill_range(T* p, int64_t begin, int64_t end, uint64_t key, float low, float span) {
  for (int64_t i = begin; i < end; ++i)
    p[i] = from_f32<T>(random_detail::affine(random_detail::bits24(key, (uint64_t)i), low, span));
}

}  // namespace

Tensor& fill_uniform_(Tensor& t, float low, float high, uint64_t seed) {
  const char* op = "fill_uniform_";
  check_defined(op, t, "t");
  check_float(op, t, "t");
  check_contiguous(op, t, "t");
  TALLOW_CHECK(std::isfinite(low) && std::isfinite(high) && low <= high, op, ": need finite low <= high, got low=",
               low, " high=", high, " (tensor of shape ", shape_str(t.shape()), ")");
  const float span = high - low;
  TALLOW_CHECK(std::isfinite(span), op, ": high - low overflows float32 (low=", low, ", high=", high, ")");
  const uint64_t key = random_detail::seed_key(seed);
  const int64_t n = t.numel();
  if (n == 0) return t;
  if (!t.device().is_cpu()) {
    device_op(&BackendOps::fill_uniform_, op, t)(t, low, span, key);
    return t;
  }
  TALLOW_DISPATCH_FLOAT(op, t.dtype(), [&] {
    scalar_t* p = t.data<scalar_t>();
    parallel_for(0, n, 1 << 16, [&](int64_t b, int64_t e) { fill_range(p, b, e, key, low, span); });
  });
  return t;
}

}  // namespace tallow::ops
