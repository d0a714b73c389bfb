// add / mul (numpy broadcasting, any strides) and scale on CUDA: f32 arithmetic, one rounding.
#include "elementwise.cuh"
#include "launch.cuh"
#include "ops_cuda.h"

namespace tallow::cuda {

namespace {

// Contiguous same-shape operands: 16-byte vectors.
template <class T, class Op>
__global__ void binary_vec_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ o, int64_t nvec, Op op) {
  constexpr int N = Vec16<T>::N;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < nvec; i += (int64_t)gridDim.x * blockDim.x) {
    const Vec16<T> va = load16(a + i * N), vb = load16(b + i * N);
    Vec16<T> r;
#pragma unroll
    for (int j = 0; j < N; ++j) r.v[j] = from_float<T>(op(to_float(va.v[j]), to_float(vb.v[j])));
    store16(o + i * N, r);
  }
}

template <class T, class Op>
__global__ void binary_kernel(const T* __restrict__ a, Strided ia, const T* __restrict__ b, Strided ib, T* __restrict__ o,
                              int64_t n, Op op) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    o[i] = from_float<T>(op(to_float(a[ia.offset(i)]), to_float(b[ib.offset(i)])));
}

template <class T>
__global__ void scale_kernel(const T* __restrict__ a, Strided ia, bool contig, float s, T* __restrict__ o, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    o[i] = from_float<T>(to_float(a[contig ? i : ia.offset(i)]) * s);
}

Shape broadcast_shape(const char* op, const Shape& a, const Shape& b) {
  const size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t da = i + a.size() >= n ? a[i + a.size() - n] : 1;
    const int64_t db = i + b.size() >= n ? b[i + b.size() - n] : 1;
    TALLOW_CHECK(da == db || da == 1 || db == 1, op, ": shapes ", shape_str(a), " and ", shape_str(b),
                 " cannot be broadcast together");
    out[i] = da == 1 ? db : da;
  }
  return out;
}

template <class Op>
Tensor binary(const char* op, const Tensor& a, const Tensor& b, const std::optional<Tensor>& out) {
  const Shape shape = broadcast_shape(op, a.shape(), b.shape());
  Tensor o = make_out(op, out, shape, a.dtype(), a.device());
  const int64_t n = o.numel();
  if (n == 0) return o;
  OpContext ctx(a);
  TALLOW_CUDA_DISPATCH_FLOAT(op, a.dtype(), [&] {
    using T = scalar_t;
    constexpr int N = Vec16<T>::N;
    const T* pa = static_cast<const T*>(a.data_ptr());
    const T* pb = static_cast<const T*>(b.data_ptr());
    T* po = static_cast<T*>(o.data_ptr());
    if (a.shape() == shape && b.shape() == shape && a.is_contiguous() && b.is_contiguous() && n % N == 0 &&
        aligned_to(pa, 16) && aligned_to(pb, 16) && aligned_to(po, 16)) {
      binary_vec_kernel<T, Op><<<grid_for(n / N, 256), 256, 0, ctx.stream>>>(pa, pb, po, n / N, Op{});
    } else {
      binary_kernel<T, Op><<<grid_for(n, 256), 256, 0, ctx.stream>>>(pa, broadcast_index(op, a, shape), pb,
                                                                     broadcast_index(op, b, shape), po, n, Op{});
    }
  });
  TALLOW_CUDA_CHECK_LAUNCH(op);
  return o;
}

}  // namespace

Tensor add(const Tensor& a, const Tensor& b, const std::optional<Tensor>& out) { return binary<AddOp>("add", a, b, out); }
Tensor mul(const Tensor& a, const Tensor& b, const std::optional<Tensor>& out) { return binary<MulOp>("mul", a, b, out); }

Tensor scale(const Tensor& a, float s, const std::optional<Tensor>& out) {
  Tensor o = make_out("scale", out, a.shape(), a.dtype(), a.device());
  const int64_t n = o.numel();
  if (n == 0) return o;
  OpContext ctx(a);
  TALLOW_CUDA_DISPATCH_FLOAT("scale", a.dtype(), [&] {
    using T = scalar_t;
    scale_kernel<T><<<grid_for(n, 256), 256, 0, ctx.stream>>>(static_cast<const T*>(a.data_ptr()),
                                                              broadcast_index("scale", a, a.shape()),
                                                              a.is_contiguous(), s, static_cast<T*>(o.data_ptr()), n);
  });
  TALLOW_CUDA_CHECK_LAUNCH("scale");
  return o;
}

}  // namespace tallow::cuda
