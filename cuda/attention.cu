// attention on CUDA: one warp per (batch, query, query head), an online softmax over the visible
// keys (f32 scores, f32 accumulation, one rounding of the output). This is the plain baseline that
// paged/flash kernels will be checked against, not a fast kernel.
#include "attention.cuh"
#include "launch.cuh"
#include "ops_cuda.h"

namespace tallow::cuda {

namespace {

template <class T>
__global__ void attention_kernel(AttnProblem P) {
  constexpr int kPer = kAttnMaxHeadDim / 32;
  const int lane = threadIdx.x & 31;
  const int64_t w = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
  const int64_t total = P.B * P.Tq * P.Hq;
  if (w >= total) return;
  const int64_t h = w % P.Hq, i = (w / P.Hq) % P.Tq, b = w / (P.Hq * P.Tq);
  const int64_t kh = h / (P.Hq / P.Hk);
  const int64_t p = P.Tk - P.Tq + i;
  int64_t lo, hi;
  attn_visible_range(P, p, lo, hi);
  const T* q = static_cast<const T*>(P.q.base) + b * P.q.sb + i * P.q.st + h * P.q.sh;
  const T* kb = static_cast<const T*>(P.k.base) + b * P.k.sb + kh * P.k.sh;
  const T* vb = static_cast<const T*>(P.v.base) + b * P.v.sb + kh * P.v.sh;
  float qf[kPer], acc[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int64_t d = lane + 32 * j;
    qf[j] = d < P.D ? to_float(q[d]) : 0.f;
    acc[j] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  for (int64_t t = lo; t < hi; ++t) {
    const T* kr = kb + t * P.k.st;
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int64_t d = lane + 32 * j;
      if (d < P.D) s += qf[j] * to_float(kr[d]);
    }
    s = warp_sum(s) * P.scale;
    if (P.softcap > 0.f) s = P.softcap * tanhf(s / P.softcap);
    const float m_new = fmaxf(m, s);
    const float corr = expf(m - m_new), e = expf(s - m_new);
    l = l * corr + e;
    const T* vr = vb + t * P.v.st;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int64_t d = lane + 32 * j;
      if (d < P.Dv) acc[j] = acc[j] * corr + e * to_float(vr[d]);
    }
    m = m_new;
  }
  T* o = static_cast<T*>(P.out) + ((b * P.Tq + i) * P.Hq + h) * P.Dv;
  const float inv = hi > lo ? 1.0f / l : 0.f;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int64_t d = lane + 32 * j;
    if (d < P.Dv) o[d] = from_float<T>(hi > lo ? acc[j] * inv : 0.f);
  }
}

AttnOperand operand(const Tensor& t) {
  const int64_t o = t.dim() - 3;
  return {t.data_ptr(), o ? t.stride(0) : 0, t.stride(o), t.stride(o + 1)};
}

}  // namespace

Tensor attention(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, float scale, bool causal,
                 int64_t sliding_window, float softcap) {
  const char* op = "attention";
  const Tensor q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in), v = last_dim_contiguous(v_in);
  const int64_t nd = q.dim(), o = nd - 3;
  const int64_t B = nd == 4 ? q.size(0) : 1;
  const int64_t Tq = q.size(o), Hq = q.size(o + 1), D = q.size(o + 2);
  const int64_t Tk = k.size(o), Hk = k.size(o + 1), Dv = v.size(o + 2);
  TALLOW_CHECK(D <= kAttnMaxHeadDim && Dv <= kAttnMaxHeadDim, op, ": head dims up to ", kAttnMaxHeadDim,
               " are supported on CUDA, got q", shape_str(q.shape()), " v", shape_str(v.shape()));
  Shape oshape = q.shape();
  oshape.back() = Dv;
  Tensor out = Tensor::empty(oshape, q.dtype(), q.device());
  if (out.numel() == 0) return out;
  OpContext ctx(q);
  const AttnProblem P{B, Tq, Tk, Hq, Hk, D, Dv, scale, softcap, causal, sliding_window,
                      operand(q), operand(k), operand(v), out.data_ptr()};
  const int64_t warps = B * Tq * Hq;
  const int threads = 128;
  const unsigned blocks = (unsigned)ceil_div(warps * 32, threads);
  TALLOW_CUDA_DISPATCH_FLOAT(op, q.dtype(), [&] { attention_kernel<scalar_t><<<blocks, threads, 0, ctx.stream>>>(P); });
  TALLOW_CUDA_CHECK_LAUNCH(op);
  return out;
}

}  // namespace tallow::cuda
