// rotary_embedding on CUDA, in place on q and k (vLLM's convention; see cpp/ops/rope.h). One thread
// rotates one pair of one head. Positions are validated before anything is written (IndexError, as
// on the CPU); under graph capture the check cannot read back, so rows with an out-of-range position
// are skipped instead.
#include "launch.cuh"
#include "ops_cuda.h"
#include "norm.cuh"
#include "rope.cuh"

namespace tallow::cuda {

namespace {

template <class P>
__global__ void check_positions_kernel(const P* __restrict__ pos, int64_t n, int64_t max_pos, int* flag) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t p = (int64_t)pos[i];
    if (p < 0 || p >= max_pos) atomicMax(flag, 1);
  }
}

// One block per token (grid-stride): the position and the cos/sin row are read once per token, and
// the block's threads walk (head, chunk) items with 32-bit index math. A chunk is V consecutive
// pairs: neox pairs (i, i + half) as two V-element vectors, interleaved pairs as one 2V-element vector.
struct RopeTarget {
  void* x;
  Strided tokens;  // element offset of each token's first head
  int64_t head_stride;
  int heads;
};

template <class T, class P, int V, bool kNeox>
__global__ void rope_kernel(RopeTarget q, RopeTarget k, int64_t T_, const P* __restrict__ pos,
                            const float* __restrict__ cache, int64_t cache_stride, int64_t max_pos, int half) {
  const int chunks = half / V, qitems = q.heads * chunks, items = qitems + k.heads * chunks;
  for (int64_t t = blockIdx.x; t < T_; t += gridDim.x) {
    const int64_t ps = (int64_t)pos[t];
    if (ps < 0 || ps >= max_pos) continue;
    const float* cs = cache + ps * cache_stride;
    T* qb = static_cast<T*>(q.x) + q.tokens.offset(t);
    T* kb = k.heads ? static_cast<T*>(k.x) + k.tokens.offset(t) : nullptr;
    for (int it = threadIdx.x; it < items; it += blockDim.x) {
      const bool is_q = it < qitems;
      const int r = is_q ? it : it - qitems;
      const int h = r / chunks, p = (r - h * chunks) * V;
      const Pack<float, V> c = *reinterpret_cast<const Pack<float, V>*>(cs + p);
      const Pack<float, V> sn = *reinterpret_cast<const Pack<float, V>*>(cs + half + p);
      T* hp = is_q ? qb + h * q.head_stride : kb + h * k.head_stride;
      if constexpr (kNeox) {
        Pack<T, V> a = *reinterpret_cast<const Pack<T, V>*>(hp + p), b = *reinterpret_cast<const Pack<T, V>*>(hp + p + half);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float fa = to_float(a.v[j]), fb = to_float(b.v[j]);
          a.v[j] = from_float<T>(fa * c.v[j] - fb * sn.v[j]);
          b.v[j] = from_float<T>(fb * c.v[j] + fa * sn.v[j]);
        }
        *reinterpret_cast<Pack<T, V>*>(hp + p) = a;
        *reinterpret_cast<Pack<T, V>*>(hp + p + half) = b;
      } else {
        Pack<T, 2 * V> ab = *reinterpret_cast<const Pack<T, 2 * V>*>(hp + 2 * p);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float fa = to_float(ab.v[2 * j]), fb = to_float(ab.v[2 * j + 1]);
          ab.v[2 * j] = from_float<T>(fa * c.v[j] - fb * sn.v[j]);
          ab.v[2 * j + 1] = from_float<T>(fb * c.v[j] + fa * sn.v[j]);
        }
        *reinterpret_cast<Pack<T, 2 * V>*>(hp + 2 * p) = ab;
      }
    }
  }
}

// Element offsets of the token dims (all but the last two) of x.
Strided token_index(const char* op, const Tensor& x) {
  Shape lead(x.shape().begin(), x.shape().end() - 1);
  Shape st(x.strides().begin(), x.strides().end() - 1);
  Strided s;
  for (size_t d = 0; d + 1 < lead.size(); ++d) {
    if (lead[d] == 1) continue;
    TALLOW_CHECK(s.ndim < kMaxDims, op, ": too many dims in ", shape_str(x.shape()));
    s.size[s.ndim] = lead[d];
    s.stride[s.ndim] = st[d];
    s.ndim++;
  }
  if (s.ndim == 0) {
    s.ndim = 1;
    s.size[0] = 1;
    s.stride[0] = 0;
  }
  return s;
}

}  // namespace

void rotary_embedding(const Tensor& positions_in, Tensor& q, std::optional<Tensor> k, const Tensor& cache_in, bool neox) {
  const char* op = "rotary_embedding";
  OpContext ctx(q);
  const Tensor positions = contiguous(positions_in);
  const Tensor cache = cache_in;  // last dim contiguous (checked by the entry point)
  const int64_t T = positions.numel(), max_pos = cache.size(0), rot = cache.size(1), half = rot / 2;
  if (T == 0) return;
  const bool i32 = positions.dtype() == DType::I32;
  if (index_checks() && !is_capturing(ctx.stream)) {
    DeviceFlag flag(q, ctx.stream);
    if (i32)
      check_positions_kernel<<<grid_for(T, 256), 256, 0, ctx.stream>>>(positions.data<int32_t>(), T, max_pos, flag.ptr());
    else
      check_positions_kernel<<<grid_for(T, 256), 256, 0, ctx.stream>>>(positions.data<int64_t>(), T, max_pos, flag.ptr());
    TALLOW_CUDA_CHECK_LAUNCH(op);
    TALLOW_CHECK_INDEX(flag.read() == 0, op, ": a position is out of range of cos_sin_cache of shape ",
                       shape_str(cache.shape()), " (valid positions are 0 .. ", max_pos - 1, ")");
  }
  // q and k in one launch: the position and cos/sin row of a token are read once for both.
  const bool has_k = k && k->defined() && k->size(-2) > 0;
  const int64_t heads_total = q.size(-2) + (has_k ? k->size(-2) : 0);
  if (heads_total == 0) return;
  TALLOW_CHECK(heads_total * half < (int64_t)1 << 31, op, ": too many heads x pairs in q", shape_str(q.shape()));
  TALLOW_CUDA_DISPATCH_FLOAT(op, q.dtype(), [&] {
    using S = scalar_t;
    // Pairs per thread: 8-byte halves for neox (two per thread), one 16-byte vector for interleaved;
    // both give 2x more threads per token than 16-byte neox halves, which measured faster.
    constexpr int VN = 8 / sizeof(S), VI = 16 / sizeof(S) / 2;
    const int V = neox ? VN : VI;
    bool vec = half % V == 0 && cache.stride(0) % V == 0 && aligned_to(cache.data_ptr(), (size_t)V * sizeof(float)) &&
               (!neox || (half * sizeof(S)) % 8 == 0);
    auto target = [&](const Tensor& x) {
      vec = vec && aligned_to(x.data_ptr(), 16);
      for (int64_t d = 0; d + 1 < x.dim() && vec; ++d) vec = x.size(d) <= 1 || (x.stride(d) * sizeof(S)) % 16 == 0;
      return RopeTarget{x.data_ptr(), token_index(op, x), x.stride(-2), (int)x.size(-2)};
    };
    const RopeTarget tq = target(q), tk = has_k ? target(*k) : RopeTarget{nullptr, Strided{}, 0, 0};
    const int items = (int)(heads_total * (half / (vec ? V : 1)));
    const int threads = std::min(256, std::max(32, (items + 31) / 32 * 32));
    // Enough blocks to fill the device; each walks several tokens.
    const unsigned blocks = (unsigned)std::min<int64_t>(T, (int64_t)sm_count() * (2048 / threads));
    auto pick = [&](auto ptag) {
      using P = decltype(ptag);
      auto K = [&](auto kernel) {
        kernel<<<blocks, threads, 0, ctx.stream>>>(tq, tk, T, static_cast<const P*>(positions.data_ptr()),
                                                  cache.data<float>(), cache.stride(0), max_pos, (int)half);
      };
      if (vec && neox) K(rope_kernel<S, P, VN, true>);
      else if (vec) K(rope_kernel<S, P, VI, false>);
      else if (neox) K(rope_kernel<S, P, 1, true>);
      else K(rope_kernel<S, P, 1, false>);
    };
    if (i32) pick(int32_t{});
    else pick(int64_t{});
  });
  TALLOW_CUDA_CHECK_LAUNCH(op);
}

}  // namespace tallow::cuda
