// Family status: CPU implementation complete and tested (tests/python/backend_ops/cases_topk.py).
// argmax and top-k over the last dimension, one row per task, rows in parallel.
//
// Order used by both (a total order on (value, index) pairs, so results are deterministic):
//   NaN is larger than every number (and +Inf); equal values (including +0 == -0, and NaN vs NaN)
//   rank by lower index first. top-k values come out descending, with their i64 indices.
// Values are compared after conversion to f32, which is exact for f16/bf16, so ranking never
// depends on rounding; top-k values are copied through unchanged (same dtype as x).
#include "ops/topk.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/simd.h"
#include "ops/common.h"
#include "ops/rows.h"

// `omp simd` with a max and a sum reduction (simd.h has the plain form only).
#if defined(_MSC_VER) && !defined(__clang__)
#define TOPK_SIMD_MAX_NANS(m, c) __pragma(omp simd reduction(max : m) reduction(+ : c))
#else
#define TOPK_PRAGMA(x) _Pragma(#x)
#define TOPK_SIMD_MAX_NANS(m, c) TOPK_PRAGMA(omp simd reduction(max : m) reduction(+ : c))
#endif

namespace tallow::ops {

namespace {

struct Entry {
  float v;
  int64_t i;
};

// true when a ranks before (is "larger" than) b.
inline bool ranks_before(const Entry& a, const Entry& b) {
  const bool an = std::isnan(a.v), bn = std::isnan(b.v);
  if (an || bn) return an && (!bn || a.i < b.i);
  return a.v > b.v || (a.v == b.v && a.i < b.i);
}

// Index of the largest element of a row of n >= 1 elements with stride sx.
template <class T>
TALLOW_SIMD_CLONES int64_t argmax_row(const T* TALLOW_RESTRICT x, int64_t sx, int64_t n) {
  if (sx != 1) {  // strided row: one plain pass
    Entry best{to_f32(x[0]), 0};
    for (int64_t i = 1; i < n; ++i) {
      const Entry e{to_f32(x[i * sx]), i};
      if (ranks_before(e, best)) best = e;
    }
    return best.i;
  }
  // Contiguous row: a vectorised pass for the maximum and a NaN count, then the first index
  // holding the answer (the first NaN if any, else the first element equal to the maximum).
  float m = -INFINITY;
  int nans = 0;
  TOPK_SIMD_MAX_NANS(m, nans)
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_f32(x[i]);
    nans += v != v;
    m = v > m ? v : m;
  }
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_f32(x[i]);
    if (nans ? v != v : v == m) return i;
  }
  return 0;  // unreachable: some element equals the maximum
}

template <class T>
void topk_row(const T* x, int64_t sx, int64_t n, int64_t k, std::vector<Entry>& buf, T* vals, int64_t* idx) {
  buf.resize((size_t)n);
  for (int64_t i = 0; i < n; ++i) buf[i] = {to_f32(x[i * sx]), i};
  if (k < n) {
    // nth_element + sort of the first k is O(n + k log k); partial_sort is O(n log k).
    std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end(), ranks_before);
    std::sort(buf.begin(), buf.begin() + k, ranks_before);
  } else {
    std::sort(buf.begin(), buf.end(), ranks_before);
  }
  for (int64_t j = 0; j < k; ++j) {
    idx[j] = buf[j].i;
    vals[j] = x[buf[j].i * sx];  // the original element, bit for bit (NaN payloads included)
  }
}

void check_input(const char* op, const Tensor& x) {
  check_defined(op, x, "x");
  check_float(op, x, "x");
  TALLOW_CHECK(x.dim() >= 1, op, ": x must have at least 1 dimension, got a 0-D tensor");
}

}  // namespace

Tensor argmax(const Tensor& x) {
  const char* op = "argmax";
  check_input(op, x);
  const int64_t n = x.size(-1);
  Shape oshape(x.shape().begin(), x.shape().end() - 1);
  TALLOW_CHECK(n > 0 || shape_numel(oshape) == 0, op, ": last dimension of x", shape_str(x.shape()),
               " is empty (no maximum)");
  if (!x.device().is_cpu()) return device_op(&BackendOps::argmax, op, x)(x);
  Tensor out = Tensor::empty(oshape, DType::I64, x.device());
  int64_t* o = out.data<int64_t>();
  const int64_t sx = x.stride(-1);
  TALLOW_DISPATCH_FLOAT(op, x.dtype(), [&] {
    parallel_rows(num_rows(x), n, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) o[r] = argmax_row<scalar_t>(row_ptr<const scalar_t>(x, r), sx, n);
    });
  });
  return out;
}

std::pair<Tensor, Tensor> topk(const Tensor& x, int64_t k) {
  const char* op = "topk";
  check_input(op, x);
  const int64_t n = x.size(-1);
  TALLOW_CHECK(k >= 0 && k <= n, op, ": k = ", k, " must be in [0, ", n, "] for x of shape ", shape_str(x.shape()));
  if (!x.device().is_cpu()) return device_op(&BackendOps::topk, op, x)(x, k);
  Shape oshape = x.shape();
  oshape.back() = k;
  Tensor vals = Tensor::empty(oshape, x.dtype(), x.device());
  Tensor idx = Tensor::empty(oshape, DType::I64, x.device());
  if (k == 0 || vals.numel() == 0) return {vals, idx};
  const int64_t sx = x.stride(-1);
  TALLOW_DISPATCH_FLOAT(op, x.dtype(), [&] {
    scalar_t* vo = vals.data<scalar_t>();
    int64_t* io = idx.data<int64_t>();
    // Sorting costs ~n log k per row; weight rows accordingly so short rows are batched.
    parallel_rows(num_rows(x), 4 * n, [&](int64_t r0, int64_t r1) {
      std::vector<Entry> buf;
      for (int64_t r = r0; r < r1; ++r)
        topk_row<scalar_t>(row_ptr<const scalar_t>(x, r), sx, n, k, buf, vo + r * k, io + r * k);
    });
  });
  return {vals, idx};
}

}  // namespace tallow::ops
