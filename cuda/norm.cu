// rms_norm, fused_add_rms_norm and layer_norm on CUDA (see norm.cuh).
//
// PDL (pdl.cuh): under graph capture on sm_90+ the kernels are launched with programmatic dependent
// launch (with TALLOW_PDL=1, and for up to 16 rows by default). Each one first lets its own dependents launch (a next gemv starts streaming weights while
// this tiny kernel runs), warms L2 with its weight (a prefetch reads nothing), then waits for the
// previous kernel before its first global load or store. x is read with plain loads (no __restrict__,
// so never ld.global.nc, which ptxas may hoist above the wait): the previous kernel writes it.
#include <cstdlib>
#include <string>
#include <type_traits>

#include "pdl.cuh"
#include "launch.cuh"
#include "norm.cuh"
#include "ops_cuda.h"

namespace tallow::cuda {

namespace {

// Rows up to which the norms use PDL under capture on sm_90 (see the launch; H100, nano-vllm run, 1024
// against 16 on one machine: 19,546 vs 19,627 output tok/s, so 16).
constexpr int64_t kPdlMaxRows = 16;

struct NormArgs {
  int64_t H;
  float eps;
  float w_add;  // 1 for Gemma's (1 + w)
  bool cache;   // row cached in shared memory
};

// mode 0: rms_norm; 1: fused add (residual R updated in place, x is X); 2: layer_norm.
// The row is cached in shared memory in its storage type (C: the residual's type in mode 1, else
// X), one Pack per thread and step, so a warp's accesses are contiguous (no bank conflicts).
template <class X, class R, int VEC, int kMode>
__global__ void norm_kernel(const X* x, Strided xrows, R* res, Strided rrows, const X* __restrict__ w,
                            const X* __restrict__ b, X* __restrict__ out, NormArgs a) {
  using C = std::conditional_t<kMode == 1, R, X>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Pack<C, VEC>* cache = reinterpret_cast<Pack<C, VEC>*>(smem_raw);
  __shared__ float red[32];
  pdl_launch_dependents();
  pdl_wait();
  const int64_t row = blockIdx.x;
  const X* xr = x + row_offset(xrows, row);
  R* rr = kMode == 1 ? res + row_offset(rrows, row) : nullptr;
  X* orow = out + row * a.H;
  const int64_t nv = a.H / VEC;
  // The row's values (as stored: x, or the updated residual) for vector v.
  auto row_vec = [&](int64_t v, float (&f)[VEC]) {
    if (a.cache) {
      const Pack<C, VEC> p = cache[v];
#pragma unroll
      for (int j = 0; j < VEC; ++j) f[j] = to_float(p.v[j]);
    } else if constexpr (kMode == 1) {
      load_vec<R, VEC>(rr, v * VEC, f);
    } else {
      load_vec<X, VEC>(xr, v * VEC, f);
    }
  };
  float acc = 0.f;
  for (int64_t v = threadIdx.x; v < nv; v += blockDim.x) {
    float f[VEC];
    load_vec<X, VEC>(xr, v * VEC, f);
    Pack<C, VEC> p;
    if constexpr (kMode == 1) {
      float r[VEC];
      load_vec<R, VEC>(rr, v * VEC, r);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        p.v[j] = from_float<R>(f[j] + r[j]);  // the stored residual ...
        f[j] = to_float(p.v[j]);              // ... is what gets normed
      }
      *reinterpret_cast<Pack<R, VEC>*>(rr + v * VEC) = p;
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) p.v[j] = from_float<C>(f[j]);  // exact: C == X here
    }
    if (a.cache) cache[v] = p;
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc += kMode == 2 ? f[j] : f[j] * f[j];
  }
  const float total = block_sum(acc, red);
  float inv, mean = 0.f;
  if constexpr (kMode == 2) {
    mean = total / (float)a.H;
    float var = 0.f;
    for (int64_t v = threadIdx.x; v < nv; v += blockDim.x) {
      float f[VEC];
      row_vec(v, f);
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
    row_vec(v, f);
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

// The same three norms with the row held in registers: each thread owns up to KMAX packs (all its
// loads are issued before the reduction waits on them). Used when nv <= KMAX * blockDim.x. KMAX = 1
// is the few-rows (decode) launch, latency-bound: one pack per thread, up to 1024 threads, and w and b
// loaded with x (one memory round trip). With KMAX = 4 (up to 512 threads, so up to 128 registers
// without spills) RMSNorm's w still comes with x (a batch-256 decode step's norms are as
// latency-bound: 64 threads a row, the reduction's round trip need not be followed by another);
// layer_norm's w and b come after the reduction.
template <class X, class R, int VEC, int kMode, int KMAX>
__global__ void __launch_bounds__(KMAX == 1 ? 1024 : 512, 1) norm_reg_kernel(const X* x, Strided xrows, R* res, Strided rrows,
                                                        const X* __restrict__ w, const X* __restrict__ b,
                                                        X* __restrict__ out, NormArgs a) {
  using C = std::conditional_t<kMode == 1, R, X>;
  constexpr bool kEarlyW = KMAX == 1 || kMode != 2;
  __shared__ float red[32];
  const int nv = (int)(a.H / VEC);
  pdl_launch_dependents();
  if (w) {
#pragma unroll
    for (int k = 0; k < KMAX; ++k) {
      const int v = threadIdx.x + k * blockDim.x;
      if (v < nv) prefetch_l2(w + (int64_t)v * VEC);
    }
  }
  pdl_wait();
  const int64_t row = blockIdx.x;
  const X* xr = x + row_offset(xrows, row);
  R* rr = kMode == 1 ? res + row_offset(rrows, row) : nullptr;
  X* orow = out + row * a.H;
  Pack<X, VEC> xp[KMAX], wp[KMAX], bp[KMAX];
  Pack<C, VEC> cp[KMAX];
#pragma unroll
  for (int k = 0; k < KMAX; ++k) {
    const int v = threadIdx.x + k * blockDim.x;
    if (v < nv) {
      xp[k] = *reinterpret_cast<const Pack<X, VEC>*>(xr + (int64_t)v * VEC);
      if constexpr (kMode == 1) cp[k] = *reinterpret_cast<const Pack<R, VEC>*>(rr + (int64_t)v * VEC);
      if (kEarlyW && w) wp[k] = *reinterpret_cast<const Pack<X, VEC>*>(w + (int64_t)v * VEC);
      if (kEarlyW && kMode == 2 && b) bp[k] = *reinterpret_cast<const Pack<X, VEC>*>(b + (int64_t)v * VEC);
    }
  }
  float acc = 0.f;
#pragma unroll
  for (int k = 0; k < KMAX; ++k) {
    const int v = threadIdx.x + k * blockDim.x;
    if (v >= nv) continue;
    if constexpr (kMode == 1) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) cp[k].v[j] = from_float<R>(to_float(xp[k].v[j]) + to_float(cp[k].v[j]));
      *reinterpret_cast<Pack<R, VEC>*>(rr + (int64_t)v * VEC) = cp[k];
    } else {
      cp[k] = xp[k];
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float f = to_float(cp[k].v[j]);
      acc += kMode == 2 ? f : f * f;
    }
  }
  const float total = block_sum(acc, red);
  float inv, mean = 0.f;
  if constexpr (kMode == 2) {
    mean = total / (float)a.H;
    float var = 0.f;
#pragma unroll
    for (int k = 0; k < KMAX; ++k) {
      const int v = threadIdx.x + k * blockDim.x;
      if (v >= nv) continue;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float d = to_float(cp[k].v[j]) - mean;
        var += d * d;
      }
    }
    var = block_sum(var, red);
    inv = 1.0f / sqrtf(var / (float)a.H + a.eps);
  } else {
    inv = 1.0f / sqrtf(total / (float)a.H + a.eps);
  }
#pragma unroll
  for (int k = 0; k < KMAX; ++k) {
    const int v = threadIdx.x + k * blockDim.x;
    if (v >= nv) continue;
    if (!kEarlyW && w) wp[k] = *reinterpret_cast<const Pack<X, VEC>*>(w + (int64_t)v * VEC);
    if (!kEarlyW && kMode == 2 && b) bp[k] = *reinterpret_cast<const Pack<X, VEC>*>(b + (int64_t)v * VEC);
    float f[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float fv = to_float(cp[k].v[j]);
      const float wv = w ? to_float(wp[k].v[j]) : 1.f;
      const float bv = kMode == 2 && b ? to_float(bp[k].v[j]) : 0.f;
      if constexpr (kMode == 2) f[j] = (fv - mean) * inv * wv + bv;
      else f[j] = fv * inv * (wv + a.w_add);
    }
    store_vec<X, VEC>(orow, (int64_t)v * VEC, f);
  }
}

bool rows_aligned(const Tensor& t, int64_t bytes) {
  if (!aligned_to(t.data_ptr(), (size_t)bytes)) return false;
  for (int64_t d = 0; d + 1 < t.dim(); ++d)
    if (t.size(d) > 1 && (t.stride(d) * t.element_size()) % bytes != 0) return false;
  return true;
}

// Rows up to which a norm takes the one-pack-a-thread launch: one CTA an SM. In a graph of back-to-back norms the one-pack launch was also faster at 192-512 rows
// (H100, fused add + norm, hidden 1024: 2.46 / 2.62 / 3.34 us -> 2.29 / 2.43 / 3.09;
// benchmarks/bench_norm.py), but the nano-vllm run with it up to 1024 rows was not faster (two A/B
// pairs on one H100: 19,546 vs 19,720 and 19,504 vs 19,523 output tok/s), so the default stays.
int64_t few_rows_max() { return (int64_t)sm_count(); }

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
      using C = std::conditional_t<kMode == 1, R, X>;
      NormArgs a{H, eps, w_add, H * (int64_t)sizeof(C) <= kNormMaxCachedBytes};
      const int64_t nv = vec ? H / V : H;
      int threads = (int)std::min<int64_t>(1024, std::max<int64_t>(32, (nv + 31) / 32 * 32));
      if (threads > 256 && nv < 4 * threads) threads = std::max(256, (int)((nv / 4 + 31) / 32 * 32));
      const size_t smem = a.cache ? (size_t)H * sizeof(C) : 0;
      const X* pw = w ? static_cast<const X*>(w->data_ptr()) : nullptr;
      const X* pb = b ? static_cast<const X*>(b->data_ptr()) : nullptr;
      R* pr = res ? static_cast<R*>(res->data_ptr()) : nullptr;
      const X* px = static_cast<const X*>(x.data_ptr());
      X* po = static_cast<X*>(o.data_ptr());
      // Decode-sized launches (a few rows) use PDL under capture on sm_90+: their launch then overlaps
      // the previous GEMV's tail (H100, Llama-3-8B batch 1: 168.4 -> 169.5-169.8 tok/s).
      const bool pdl = rows <= kPdlMaxRows && pdl_capable(ctx.stream);
      auto run = [&](auto kernel) {
        if (smem > 48 * 1024)
          TALLOW_CUDA_CHECK(op, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        TALLOW_CUDA_CHECK(op, launch_kernel(kernel, dim3((unsigned)rows), dim3(threads), smem, ctx.stream, pdl, px, xr,
                                            pr, rr, pw, pb, po, a));
      };
      constexpr int KMAX = 4;
      if (vec && nv <= 1024 && rows <= few_rows_max()) {
        // A few rows (decode) are latency-bound: one pack per thread, as many threads as packs.
        const int t = (int)std::max<int64_t>(32, (nv + 31) / 32 * 32);
        TALLOW_CUDA_CHECK(op, launch_kernel(norm_reg_kernel<X, R, V, kMode, 1>, dim3((unsigned)rows), dim3(t), 0,
                                            ctx.stream, pdl, px, xr, pr, rr, pw, pb, po, a));
      } else if (vec && nv <= (int64_t)KMAX * 512) {
        // Registers: enough threads that each holds at most KMAX packs (at least 2 per thread when possible).
        const int64_t want = std::max<int64_t>(32, (ceil_div(nv, KMAX) + 31) / 32 * 32);
        const int t = (int)std::min<int64_t>(512, std::max<int64_t>(want, std::min<int64_t>(128, (nv / 2 + 31) / 32 * 32)));
        TALLOW_CUDA_CHECK(op, launch_kernel(norm_reg_kernel<X, R, V, kMode, KMAX>, dim3((unsigned)rows), dim3(t), 0,
                                            ctx.stream, pdl, px, xr, pr, rr, pw, pb, po, a));
      } else if (vec) {
        run(norm_kernel<X, R, V, kMode>);
      } else {
        run(norm_kernel<X, R, 1, kMode>);
      }
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
  for (int64_t d = 0; d < residual.dim(); ++d)
    TALLOW_CHECK(residual.stride(d) != 0 || residual.size(d) <= 1, "fused_add_rms_norm: residual of shape ",
                 shape_str(residual.shape()), " is a broadcast view (stride 0) and cannot be updated in place");
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
