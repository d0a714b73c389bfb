// rms_norm, fused_add_rms_norm and layer_norm on CUDA (see norm.cuh).
#include "launch.cuh"
#include "norm.cuh"
#include "ops_cuda.h"

namespace tallow::cuda {

namespace {

struct NormArgs {
  int64_t H;
  float eps;
  float w_add;  // 1 for Gemma's (1 + w)
  bool cache;   // row cached in shared memory
};

// mode 0: rms_norm; 1: fused add (residual R updated in place, x is X); 2: layer_norm.
template <class X, class R, int VEC, int kMode>
__global__ void norm_kernel(const X* __restrict__ x, Strided xrows, R* res, Strided rrows, const X* __restrict__ w,
                            const X* __restrict__ b, X* __restrict__ out, NormArgs a) {
  extern __shared__ float srow[];
  __shared__ float red[32];
  const int64_t row = blockIdx.x;
  const X* xr = x + xrows.offset(row);
  R* rr = kMode == 1 ? res + rrows.offset(row) : nullptr;
  X* orow = out + row * a.H;
  const int64_t nv = a.H / VEC;
  float acc = 0.f;
  for (int64_t v = threadIdx.x; v < nv; v += blockDim.x) {
    float f[VEC];
    load_vec<X, VEC>(xr, v * VEC, f);
    if constexpr (kMode == 1) {
      float r[VEC];
      load_vec<R, VEC>(rr, v * VEC, r);
#pragma unroll
      for (int j = 0; j < VEC; ++j) f[j] = to_float(from_float<R>(f[j] + r[j]));  // the stored residual
      store_vec<R, VEC>(rr, v * VEC, f);
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      acc += kMode == 2 ? f[j] : f[j] * f[j];
      if (a.cache) srow[v * VEC + j] = f[j];
    }
  }
  const float total = block_sum(acc, red);
  float inv, mean = 0.f;
  if constexpr (kMode == 2) {
    mean = total / (float)a.H;
    float var = 0.f;
    for (int64_t v = threadIdx.x; v < nv; v += blockDim.x) {
      float f[VEC];
      if (a.cache) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) f[j] = srow[v * VEC + j];
      } else {
        load_vec<X, VEC>(xr, v * VEC, f);
      }
#pragma unroll
      for (int j = 0; j < VEC; ++j) var += (f[j] - mean) * (f[j] - mean);
    }
    var = block_sum(var, red);
    inv = 1.0f / sqrtf(var / (float)a.H + a.eps);
  } else {
    inv = 1.0f / sqrtf(total / (float)a.H + a.eps);
  }
  for (int64_t v = threadIdx.x; v < nv; v += blockDim.x) {
    float f[VEC];
    if (a.cache) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) f[j] = srow[v * VEC + j];
    } else if constexpr (kMode == 1) {
      load_vec<R, VEC>(rr, v * VEC, f);
    } else {
      load_vec<X, VEC>(xr, v * VEC, f);
    }
    float wv[VEC], bv[VEC];
    if (w) {
      load_vec<X, VEC>(w, v * VEC, wv);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) wv[j] = 1.f;
    }
    if (kMode == 2 && b) {
      load_vec<X, VEC>(b, v * VEC, bv);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) bv[j] = 0.f;
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      if constexpr (kMode == 2) f[j] = (f[j] - mean) * inv * wv[j] + bv[j];
      else f[j] = f[j] * inv * (wv[j] + a.w_add);
    }
    store_vec<X, VEC>(orow, v * VEC, f);
  }
}

bool rows_aligned(const Tensor& t, int64_t bytes) {
  if (!aligned_to(t.data_ptr(), (size_t)bytes)) return false;
  for (int64_t d = 0; d + 1 < t.dim(); ++d)
    if (t.size(d) > 1 && (t.stride(d) * t.element_size()) % bytes != 0) return false;
  return true;
}

template <int kMode>
void launch(const char* op, const Tensor& x, const Tensor* res, const Tensor* w, const Tensor* b, const Tensor& o,
            float eps, float w_add) {
  const int64_t H = x.size(-1), rows = o.numel() / std::max<int64_t>(H, 1);
  if (rows == 0 || H == 0) return;
  TALLOW_CHECK(rows <= 0x7fffffff, op, ": too many rows (", rows, ")");
  OpContext ctx(x);
  const Strided xr = row_index(op, x);
  const Strided rr = res ? row_index(op, *res) : Strided{};
  TALLOW_CUDA_DISPATCH_FLOAT(op, x.dtype(), [&] {
    using X = scalar_t;
    auto go = [&](auto r_tag) {
      using R = decltype(r_tag);
      constexpr int V = 16 / (int)sizeof(X) < 16 / (int)sizeof(R) ? 16 / (int)sizeof(X) : 16 / (int)sizeof(R);
      const int64_t xa = (int64_t)sizeof(X) * V;
      bool vec = H % V == 0 && rows_aligned(x, xa) && rows_aligned(o, xa);
      if (res) vec = vec && rows_aligned(*res, (int64_t)sizeof(R) * V);
      if (w) vec = vec && aligned_to(w->data_ptr(), (size_t)xa);
      if (b) vec = vec && aligned_to(b->data_ptr(), (size_t)xa);
      NormArgs a{H, eps, w_add, H <= kNormMaxCachedFloats};
      const int64_t nv = vec ? H / V : H;
      int threads = (int)std::min<int64_t>(1024, std::max<int64_t>(32, (nv + 31) / 32 * 32));
      if (threads > 256 && nv < 4 * threads) threads = std::max(256, (int)((nv / 4 + 31) / 32 * 32));
      const size_t smem = a.cache ? (size_t)H * sizeof(float) : 0;
      const X* pw = w ? static_cast<const X*>(w->data_ptr()) : nullptr;
      const X* pb = b ? static_cast<const X*>(b->data_ptr()) : nullptr;
      R* pr = res ? static_cast<R*>(res->data_ptr()) : nullptr;
      auto run = [&](auto kernel) {
        if (smem > 48 * 1024)
          TALLOW_CUDA_CHECK(op, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        kernel<<<(unsigned)rows, threads, smem, ctx.stream>>>(static_cast<const X*>(x.data_ptr()), xr, pr, rr, pw, pb,
                                                             static_cast<X*>(o.data_ptr()), a);
      };
      if (vec) run(norm_kernel<X, R, V, kMode>);
      else run(norm_kernel<X, R, 1, kMode>);
    };
    if constexpr (kMode == 1) {
      switch (res->dtype()) {
        case DType::F32: go(float{}); break;
        case DType::F16: go(__half{}); break;
        case DType::BF16: go(__nv_bfloat16{}); break;
        default: throw TypeError(str_cat(op, ": unsupported residual dtype ", dtype_name(res->dtype())));
      }
    } else {
      go(X{});
    }
  });
  TALLOW_CUDA_CHECK_LAUNCH(op);
}

}  // namespace

Tensor rms_norm(const Tensor& x_in, const Tensor& w, float eps, bool gemma_offset, const std::optional<Tensor>& out) {
  Tensor o = make_out("rms_norm", out, x_in.shape(), x_in.dtype(), x_in.device());
  const Tensor x = last_dim_contiguous(x_in), wc = contiguous(w);
  launch<0>("rms_norm", x, nullptr, &wc, nullptr, o, eps, gemma_offset ? 1.f : 0.f);
  return o;
}

Tensor fused_add_rms_norm(const Tensor& x_in, const Tensor& residual, const Tensor& w, float eps, bool gemma_offset) {
  // x aliasing residual is read from a copy (the kernel updates residual in place).
  const Tensor x = x_in.storage() == residual.storage() ? contiguous(x_in.clone()) : last_dim_contiguous(x_in);
  const Tensor wc = contiguous(w);
  Tensor o = Tensor::empty(x.shape(), x.dtype(), x.device());
  launch<1>("fused_add_rms_norm", x, &residual, &wc, nullptr, o, eps, gemma_offset ? 1.f : 0.f);
  return o;
}

Tensor layer_norm(const Tensor& x_in, const std::optional<Tensor>& w, const std::optional<Tensor>& b, float eps,
                  const std::optional<Tensor>& out) {
  Tensor o = make_out("layer_norm", out, x_in.shape(), x_in.dtype(), x_in.device());
  const Tensor x = last_dim_contiguous(x_in);
  const bool hw = w && w->defined(), hb = b && b->defined();
  const Tensor wc = hw ? contiguous(*w) : Tensor(), bc = hb ? contiguous(*b) : Tensor();
  launch<2>("layer_norm", x, nullptr, hw ? &wc : nullptr, hb ? &bc : nullptr, o, eps, 0.f);
  return o;
}

}  // namespace tallow::cuda
