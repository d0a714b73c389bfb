// Row iteration for CPU kernels over strided tensors: a "row" is one index of all dims but the last.
#pragma once
#include <algorithm>

#include "core/parallel.h"
#include "core/tensor.h"

namespace tallow::ops {

inline int64_t num_rows(const Tensor& t) {
  return t.dim() == 0 ? 1 : (t.size(-1) == 0 ? 0 : t.numel() / t.size(-1));
}

// Element offset (from the storage start) of the first element of row r.
inline int64_t row_offset(const Tensor& t, int64_t r) {
  int64_t off = t.offset();
  for (int64_t d = t.dim() - 2; d >= 0; --d) {
    const int64_t n = t.shape()[d];
    off += (r % n) * t.strides()[d];
    r /= n;
  }
  return off;
}

// Pointer to row r's first element for a scalar dtype T.
template <class T>
inline T* row_ptr(const Tensor& t, int64_t r) {
  return static_cast<T*>(t.storage()->data()) + row_offset(t, r);
}

// Runs fn(r0, r1) over row ranges in parallel; `row_cost` is the work per row in elements.
template <class F>
inline void parallel_rows(int64_t rows, int64_t row_cost, F&& fn) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(row_cost, 1));
  parallel_for(0, rows, grain, fn);
}

}  // namespace tallow::ops
