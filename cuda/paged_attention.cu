// reshape_and_cache and paged_attention on CUDA (contracts in cpp/ops/paged_attention.h).
//
// reshape_and_cache writes K and V in one launch (eight elements a thread where rows and strides
// allow); fp8 caches get e4m3(x / scale), bit-exact with the CPU, a NaN keeping its sign.
// paged_attention dispatch: i64 indices are cast to i32 on the device; then a decode batch (one
// query row per sequence, T == B, read from shapes) goes to the split-KV decode kernel
// (attention/decode.cu), other batches to the tensor-core prefill kernel (attention/prefill.cu);
// what neither supports (f32 q, other head dims, ...) runs the simple kernel here: one warp per
// (query token, query head), an online softmax over the keys it sees, read through the block table
// (f32 scores and accumulation).
// Slots, block ids, seq_lens and query_start_loc are checked before any write / read when the
// stream is not capturing a graph (the check reads back a device flag); under capture out-of-range
// slots are skipped and out-of-range blocks contribute nothing.
#include <type_traits>

#include "attention.cuh"
#include "attention/decode.cuh"
#include "attention/prefill.cuh"
#include "launch.cuh"
#include "ops_cuda.h"
#include "paged_attention.cuh"

namespace tallow::cuda {

namespace {

IndexArg index_arg(const Tensor& t) {
  return {t.data_ptr(), t.dtype() == DType::I32, t.dim() > 0 ? t.stride(0) : 0, t.dim() > 1 ? t.stride(1) : 0};
}
CacheArg cache_arg(const Tensor& t) { return {t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)}; }

// ---- reshape_and_cache ------------------------------------------------------------------------------

__global__ void check_slots_kernel(IndexArg slots, int64_t T, int64_t nslots, int* flag) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < T; i += (int64_t)gridDim.x * blockDim.x)
    if (slots(i) >= nslots) atomicMax(flag, 1);
}

// Eight consecutive elements, moved with the widest aligned accesses (16 bytes at most).
template <class T>
struct alignas(8 * sizeof(T) > 16 ? 16 : 8 * sizeof(T)) Pack8 {
  T v[8];
};

// K and V of one step in one launch.
template <class S, class C>
struct KVWrite {
  const S* src[2];  // k, v
  int64_t st[2], sh[2];
  C* cache[2];
  CacheArg ca[2];
  int64_t d[2];  // head dims of k and v
  float scale[2];
};

// Work item i covers W elements: items of one (token, head) run over K's row then V's row, so both
// are coalesced. W = 8 needs every row and stride aligned to Pack8 (pack8_ok), W = 1 nothing.
template <class S, class C, int W>
__global__ void write_kv_kernel(KVWrite<S, C> a, IndexArg slots, int64_t T, int64_t H, int64_t bs, int64_t nslots) {
  const int64_t nk = a.d[0] / W, per = nk + a.d[1] / W, n = T * H * per;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t c = i % per;
    const int64_t h = (i / per) % H, t = i / (per * H);
    const int64_t slot = slots(t);
    if (slot < 0 || slot >= nslots) continue;
    const int which = c >= nk;
    if (which) c -= nk;
    const int64_t blk = slot / bs, row = slot % bs;
    const S* src = a.src[which] + t * a.st[which] + h * a.sh[which] + W * c;
    C* dst = a.cache[which] + blk * a.ca[which].sb + row * a.ca[which].sr + h * a.ca[which].sh + W * c;
    const float scale = a.scale[which];
    if constexpr (W == 8) {
      const Pack8<S> x = *reinterpret_cast<const Pack8<S>*>(src);
      Pack8<C> y;
#pragma unroll
      for (int k = 0; k < 8; ++k) y.v[k] = cache_value<C>(x.v[k], scale);
      *reinterpret_cast<Pack8<C>*>(dst) = y;
    } else {
      *dst = cache_value<C>(*src, scale);
    }
  }
}

// One cache's rows (when k and v, or their caches, differ in dtype: two launches).
template <class S, class C, int W>
void write_one(const Tensor& src, const Tensor& cache, int64_t d, float scale, IndexArg slots, int64_t T, int64_t H,
               int64_t bs, int64_t nslots, cudaStream_t stream) {
  KVWrite<S, C> a{};
  a.src[0] = static_cast<const S*>(src.data_ptr());
  a.st[0] = src.stride(0), a.sh[0] = src.stride(1);
  a.cache[0] = static_cast<C*>(cache.data_ptr());
  a.ca[0] = cache_arg(cache);
  a.d[0] = d;
  a.scale[0] = scale;
  a.src[1] = a.src[0], a.cache[1] = a.cache[0], a.ca[1] = a.ca[0], a.st[1] = a.st[0], a.sh[1] = a.sh[0];
  a.scale[1] = scale;
  a.d[1] = 0;
  write_kv_kernel<S, C, W><<<grid_for(T * H * (d / W), 256), 256, 0, stream>>>(a, slots, T, H, bs, nslots);
}

template <class T>
bool pack8_ok(const Tensor& t, int64_t d) {
  if (d % 8 != 0 || !aligned_to(t.data_ptr(), alignof(Pack8<T>))) return false;
  for (int64_t i = 0; i + 1 < t.dim(); ++i)
    if (t.stride(i) % 8 != 0) return false;
  return true;
}

// f(q tag, cache tag) for the float dtypes (q) and the cache dtypes (also fp8).
template <class F>
void dispatch2(const char* op, DType a, DType b, F&& f) {
  auto inner = [&](auto ta) {
    switch (b) {
      case DType::F32: return f(ta, float{});
      case DType::F16: return f(ta, __half{});
      case DType::BF16: return f(ta, __nv_bfloat16{});
      case DType::F8E4M3: return f(ta, F8E4M3{});
      default: throw TypeError(str_cat(op, ": unsupported dtype ", dtype_name(b), " on CUDA"));
    }
  };
  switch (a) {
    case DType::F32: return inner(float{});
    case DType::F16: return inner(__half{});
    case DType::BF16: return inner(__nv_bfloat16{});
    default: throw TypeError(str_cat(op, ": unsupported dtype ", dtype_name(a), " on CUDA"));
  }
}

// ---- paged_attention ----------------------------------------------------------------------------

// Per sequence: query_start_loc non-decreasing from 0 to T (flag 3), seq_len between its new
// tokens and the table's capacity (flag 2), every block id it reads in range (flag 1; entries
// past its blocks and blocks wholly before its sliding window are not read, so not checked).
__global__ void check_indices_kernel(IndexArg bt, IndexArg seq_lens, IndexArg qsl, int64_t B, int64_t T, int64_t BS,
                                     int64_t NB, int64_t max_blocks, int64_t window, int* flag) {
  const int64_t b = blockIdx.x;
  if (b >= B) return;
  const int64_t q0 = qsl(b), n = qsl(b + 1) - q0, len = seq_lens(b);
  if (threadIdx.x == 0) {
    if (n < 0 || (b == 0 && q0 != 0) || (b == B - 1 && q0 + n != T)) atomicMax(flag, 3);
    if (len < n || len > max_blocks * BS) atomicMax(flag, 2);
  }
  if (n <= 0 || len < n || len > max_blocks * BS) return;
  const int64_t first = window > 0 ? (len - n - window + 1 > 0 ? len - n - window + 1 : 0) / BS : 0;
  for (int64_t i = first + threadIdx.x; i < (len + BS - 1) / BS; i += blockDim.x) {
    const int64_t id = bt(b, i);
    if (id < 0 || id >= NB) atomicMax(flag, 1);
  }
}

struct PagedProblem {
  int64_t T, Hq, Hk, D, Dv, B, BS, NB, max_blocks;
  float scale, softcap, vscale;  // scale includes k_scale, vscale is v_scale (fp8 caches; else 1)
  int64_t window;
  const void* q;
  int64_t qst, qsh;
  CacheArg k, v;
  IndexArg bt, seq_lens, qsl;
  void* out;  // contiguous [T, Hq, Dv]
};

template <class Q, class C>
__global__ void paged_attention_kernel(PagedProblem P) {
  constexpr int kPer = kAttnMaxHeadDim / 32;
  const int lane = threadIdx.x & 31;
  const int64_t w = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
  if (w >= P.T * P.Hq) return;
  const int64_t h = w % P.Hq, t = w / P.Hq, kh = h / (P.Hq / P.Hk);
  // The sequence of token t: the last b with query_start_loc[b] <= t (binary search).
  int64_t lo_b = 0, hi_b = P.B - 1;
  while (lo_b < hi_b) {
    const int64_t mid = (lo_b + hi_b + 1) / 2;
    if (P.qsl(mid) <= t) lo_b = mid;
    else hi_b = mid - 1;
  }
  const int64_t b = lo_b;
  const int64_t q0 = P.qsl(b), nq = P.qsl(b + 1) - q0, len = P.seq_lens(b);
  const int64_t p = len - nq + (t - q0);
  int64_t lo = 0, hi = p + 1 < len ? p + 1 : len;
  if (hi > P.max_blocks * P.BS) hi = P.max_blocks * P.BS;  // never past the block table
  if (P.window > 0) lo = p - P.window + 1 > 0 ? p - P.window + 1 : 0;
  if (hi < lo) hi = lo;
  const Q* q = static_cast<const Q*>(P.q) + t * P.qst + h * P.qsh;
  float qf[kPer], acc[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int64_t d = lane + 32 * j;
    qf[j] = d < P.D ? to_float(q[d]) : 0.f;
    acc[j] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  for (int64_t j = lo; j < hi; ++j) {
    const int64_t blk = P.bt(b, j / P.BS), row = j % P.BS;
    if (blk < 0 || blk >= P.NB) continue;
    const C* kr = static_cast<const C*>(P.k.base) + blk * P.k.sb + row * P.k.sr + kh * P.k.sh;
    float s = 0.f;
#pragma unroll
    for (int jj = 0; jj < kPer; ++jj) {
      const int64_t d = lane + 32 * jj;
      if (d < P.D) s += qf[jj] * to_float(kr[d]);
    }
    s = warp_sum(s) * P.scale;
    if (P.softcap > 0.f) s = P.softcap * tanhf(s / P.softcap);
    const float m_new = fmaxf(m, s);
    const float corr = expf(m - m_new), e = expf(s - m_new);
    l = l * corr + e;
    const C* vr = static_cast<const C*>(P.v.base) + blk * P.v.sb + row * P.v.sr + kh * P.v.sh;
#pragma unroll
    for (int jj = 0; jj < kPer; ++jj) {
      const int64_t d = lane + 32 * jj;
      if (d < P.Dv) acc[jj] = acc[jj] * corr + e * to_float(vr[d]);
    }
    m = m_new;
  }
  Q* o = static_cast<Q*>(P.out) + (t * P.Hq + h) * P.Dv;
  const bool any = l > 0.f || l != l;
#pragma unroll
  for (int jj = 0; jj < kPer; ++jj) {
    const int64_t d = lane + 32 * jj;
    if (d < P.Dv) o[d] = from_float<Q>(any ? acc[jj] * P.vscale / l : 0.f);
  }
}

Tensor as_i32(const Tensor& t) { return t.dtype() == DType::I32 ? t : cast(t, DType::I32); }

}  // namespace

void reshape_and_cache(const Tensor& k_in, const Tensor& v_in, const Tensor& k_cache, const Tensor& v_cache,
                       const Tensor& slot_mapping, float k_scale, float v_scale) {
  const char* op = "reshape_and_cache";
  OpContext ctx(k_in);
  const int64_t T = k_in.size(0), Hk = k_in.size(1), D = k_in.size(2), Dv = v_in.size(2);
  const int64_t bs = k_cache.size(1), nslots = k_cache.size(0) * bs;
  const IndexArg slots = index_arg(slot_mapping);
  if (T > 0 && index_checks() && !is_capturing(ctx.stream)) {
    DeviceFlag flag(k_in, ctx.stream);
    check_slots_kernel<<<grid_for(T, 256), 256, 0, ctx.stream>>>(slots, T, nslots, flag.ptr());
    TALLOW_CUDA_CHECK_LAUNCH(op);
    TALLOW_CHECK(flag.read() == 0, op, ": a slot in slot_mapping is out of range for k_cache", shape_str(k_cache.shape()),
                 " (", nslots, " slots; negative slots are skipped)");
  }
  if (T == 0 || Hk == 0) return;
  const Tensor k = last_dim_contiguous(k_in), v = last_dim_contiguous(v_in);
  if (k.dtype() == v.dtype() && k_cache.dtype() == v_cache.dtype()) {  // the usual case: one launch
    dispatch2(op, k.dtype(), k_cache.dtype(), [&](auto stag, auto ctag) {
      using S = decltype(stag);
      using C = decltype(ctag);
      KVWrite<S, C> a{};
      const Tensor* srcs[2] = {&k, &v};
      const Tensor* caches[2] = {&k_cache, &v_cache};
      const float scales[2] = {k_scale, v_scale};
      bool vec = true;
      for (int w = 0; w < 2; ++w) {
        a.src[w] = static_cast<const S*>(srcs[w]->data_ptr());
        a.st[w] = srcs[w]->stride(0), a.sh[w] = srcs[w]->stride(1);
        a.cache[w] = static_cast<C*>(caches[w]->data_ptr());
        a.ca[w] = cache_arg(*caches[w]);
        a.d[w] = w ? Dv : D;
        a.scale[w] = scales[w];
        vec = vec && pack8_ok<S>(*srcs[w], a.d[w]) && pack8_ok<C>(*caches[w], a.d[w]);
      }
      if (vec)
        write_kv_kernel<S, C, 8><<<grid_for(T * Hk * (D + Dv) / 8, 256), 256, 0, ctx.stream>>>(a, slots, T, Hk, bs,
                                                                                               nslots);
      else
        write_kv_kernel<S, C, 1><<<grid_for(T * Hk * (D + Dv), 256), 256, 0, ctx.stream>>>(a, slots, T, Hk, bs, nslots);
    });
    TALLOW_CUDA_CHECK_LAUNCH(op);
    return;
  }
  auto write = [&](const Tensor& src, const Tensor& cache, int64_t d, float scale) {
    if (d == 0) return;
    dispatch2(op, src.dtype(), cache.dtype(), [&](auto stag, auto ctag) {
      using S = decltype(stag);
      using C = decltype(ctag);
      if (pack8_ok<S>(src, d) && pack8_ok<C>(cache, d))
        write_one<S, C, 8>(src, cache, d, scale, slots, T, Hk, bs, nslots, ctx.stream);
      else
        write_one<S, C, 1>(src, cache, d, scale, slots, T, Hk, bs, nslots, ctx.stream);
    });
    TALLOW_CUDA_CHECK_LAUNCH(op);
  };
  write(k, k_cache, D, k_scale);
  write(v, v_cache, Dv, v_scale);
}

Tensor paged_attention(const Tensor& q_in, const Tensor& k_cache, const Tensor& v_cache, const Tensor& block_tables,
                       const Tensor& seq_lens, const Tensor& query_start_loc, float scale, int64_t sliding_window,
                       float softcap, const std::optional<Tensor>& out, float k_scale, float v_scale,
                       bool settled_cache) {
  const char* op = "paged_attention";
  const Tensor q = last_dim_contiguous(q_in);
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t NB = k_cache.size(0), BS = k_cache.size(1), Hk = k_cache.size(2), Dv = v_cache.size(3);
  const int64_t B = seq_lens.size(0), max_blocks = block_tables.size(1);
  Tensor o = make_out(op, out, {T, Hq, Dv}, q.dtype(), q.device());
  if (o.numel() == 0) return o;
  OpContext ctx(q);
  if (B > 0 && index_checks() && !is_capturing(ctx.stream)) {
    DeviceFlag flag(q, ctx.stream);
    check_indices_kernel<<<(unsigned)B, 128, 0, ctx.stream>>>(index_arg(block_tables), index_arg(seq_lens),
                                                              index_arg(query_start_loc), B, T, BS, NB, max_blocks,
                                                              sliding_window, flag.ptr());
    TALLOW_CUDA_CHECK_LAUNCH(op);
    const int bad = flag.read();
    TALLOW_CHECK(bad != 3, op, ": query_start_loc must be non-decreasing from 0 to the number of query tokens (", T,
                 ", q", shape_str(q.shape()), ")");
    TALLOW_CHECK(bad != 2, op, ": a sequence's seq_lens is less than its new tokens or exceeds its block table (",
                 max_blocks, " blocks of ", BS, " tokens, block_tables", shape_str(block_tables.shape()), ")");
    TALLOW_CHECK(bad == 0, op, ": block_tables holds a block id out of range for k_cache", shape_str(k_cache.shape()),
                 " (", NB, " blocks)");
  }
  const Tensor bt = as_i32(block_tables), sl = as_i32(seq_lens), qsl = as_i32(query_start_loc);
  const bool f8 = k_cache.dtype() == DType::F8E4M3;
  if (paged_decode_attention(o, q, k_cache, v_cache, bt, sl, qsl, scale, sliding_window, softcap, k_scale, v_scale,
                             settled_cache))
    return o;
  if (paged_prefill_attention(o, q, k_cache, v_cache, bt, sl, qsl, scale, sliding_window, softcap, k_scale, v_scale))
    return o;

  TALLOW_CHECK(D <= kAttnMaxHeadDim && Dv <= kAttnMaxHeadDim, op, ": head dims up to ", kAttnMaxHeadDim,
               " are supported on CUDA, got q", shape_str(q.shape()), " v_cache", shape_str(v_cache.shape()));
  const PagedProblem P{T, Hq, Hk, D, Dv, B, BS, NB, max_blocks, f8 ? scale * k_scale : scale, softcap,
                       f8 ? v_scale : 1.0f, sliding_window, q.data_ptr(), q.stride(0), q.stride(1),
                       cache_arg(k_cache), cache_arg(v_cache), index_arg(bt), index_arg(sl), index_arg(qsl),
                       o.data_ptr()};
  const unsigned blocks = (unsigned)ceil_div(T * Hq * 32, 128);
  dispatch2(op, q.dtype(), k_cache.dtype(), [&](auto qtag, auto ctag) {
    using Q = decltype(qtag);
    using C = decltype(ctag);
    paged_attention_kernel<Q, C><<<blocks, 128, 0, ctx.stream>>>(P);
  });
  TALLOW_CUDA_CHECK_LAUNCH(op);
  return o;
}

}  // namespace tallow::cuda
