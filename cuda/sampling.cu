// Sampling on CUDA (contracts and the RNG in cpp/ops/sampling.h): apply_penalties, sample_tokens,
// logprobs. sample_tokens and logprobs run one CTA of 512 threads per row; the row is read with
// 16-byte loads, the next step's loads in flight while the current one is processed.
//
// sample_tokens, per row:
//   greedy             one pass: argmax (NaN largest, first index).
//   no filters         one pass: argmax of x + g over the row. g < kGumbelMax, so a token whose
//                      x + kGumbelMax is below the thread's best so far cannot win and its hash and
//                      logs are skipped (exact, not an approximation).
//   top-k (k <= 1024)  one pass collects the candidates into shared memory: tokens at or above a
//                      threshold key, raised as the buffer fills to the k-th largest in the buffer
//                      (a radix select in shared memory, then compaction). The k-th largest of a
//                      subset is at most the row's, so every token of the top-k (ties included)
//                      is collected. The max, top-k, min-p, top-p and the draw then run on the
//                      buffer.
//   otherwise          a pass for the max (and, for top-p alone, the softmax sum S), then radix
//                      selects over the row: three levels (11, 11, 10 bits of the key), each a
//                      histogram pass whose elements of the chosen bin are also collected; once
//                      they fit in the buffer, the next levels (and, when the first level's
//                      collection fit, the draw) run there. Top-p histograms skip tokens with
//                      e < (1 - top_p) S / (2 V): together they weigh less than (1 - top_p) S, so
//                      the threshold is above them. The last pass draws over the kept tokens.
//   The thresholds are those of the CPU: integer masses, the same keys, the same ties.
// No host synchronisation, no allocation but the output: graph-capturable. A row whose candidates
// overflow the buffer (huge ties, top-p over a flat distribution) takes the multi-pass path.
// Known limit: one CTA per row, so B much smaller than the SM count leaves the GPU mostly idle.
#include <atomic>

#include "launch.cuh"
#include "ops_cuda.h"
#include "sampling.cuh"

namespace tallow::cuda {

namespace {

using namespace sampling_dev;

std::atomic<int> g_cap{kCap};

// ---- shared pieces ----------------------------------------------------------------------------

template <class T>
__device__ int32_t greedy_row(Smem& s, const RowRef<T>& rr) {
  u64 best = 0;
  visit_row(rr, [&](float v, int64_t i, bool valid) {
    if (valid) {
      const u64 k = rank_key(v, i);
      best = k > best ? k : best;
    }
  });
  best = block_max_u64(best, s.red64);
  return (int32_t)key_index(best);
}

// Which tokens the draw keeps (besides x > -inf).
struct Kept {
  bool inf_only = false;  // the max is +inf: the +inf tokens
  float m = 0.f;
  uint32_t tau_key = 0;
  float min_p = 0.f;
  bool top_p = false;
  uint32_t t_key = 0;
  __device__ __forceinline__ bool operator()(float x) const {
    if (inf_only) return x == INFINITY;
    if (order_key(x) < tau_key) return false;
    if (min_p <= 0.f && !top_p) return true;
    const float e = expf(x - m);
    return (min_p <= 0.f || e >= min_p) && (!top_p || float_bits(e) >= t_key);
  }
};

// argmax over kept tokens of x + g (ties: lower index); -1 when nothing is kept.
template <class T>
__device__ int32_t draw(Smem& s, const RowRef<T>& rr, bool in_buf, int cap, float temp, uint64_t key,
                        const Kept& kept) {
  float bv = -INFINITY;
  int64_t bi = -1;
  auto f = [&](float x, int64_t i, bool valid) {
    if (!valid || !(x > -INFINITY)) return;
    if (bi >= 0 && x + kGumbelMax < bv) return;  // cannot beat this thread's best
    if (!kept(x)) return;
    const float v = x + gumbel(key, i);
    if (bi < 0 || v > bv || (v == bv && i < bi)) bv = v, bi = i;
  };
  if (in_buf)
    visit_buf(s, cap, f);
  else
    visit_row(rr, [&](float raw, int64_t i, bool valid) { f(scaled_logit(raw, temp), i, valid); });
  const u64 packed = bi < 0 ? 0ull : ((u64)order_key(bv) << 32) | (u64)(0xffffffffu - (uint32_t)bi);
  const u64 best = block_max_u64(packed, s.red64);
  return best == 0 ? -1 : (int32_t)(0xffffffffu - (uint32_t)(best & 0xffffffffu));
}

// Keeps the buffer's elements with key >= the k-th largest key (all when fewer than k) and raises
// the append threshold to it. In place, one block of kThreads elements at a time: a block's
// survivors land below its end, and the block was read before anything is written.
template <class T>
__device__ void compact(Smem& s, const RowRef<T>& rr, int cap, int k, float temp) {
  bool in_buf = true, complete = true;
  SelectArgs a;
  a.k = k;
  a.temp = temp;
  const uint32_t tk = radix_select<false>(s, rr, cap, in_buf, complete, a);
  if (tk == 0) return;
  const int n = min(s.n, cap);
  __syncthreads();
  if (threadIdx.x == 0) s.n = 0;
  __syncthreads();
  for (int j0 = 0; j0 < n; j0 += kThreads) {
    const int j = j0 + (int)threadIdx.x;
    float x = 0.f;
    int32_t i = 0;
    bool take = false;
    if (j < n) {
      x = s.bx[j];
      i = s.bi[j];
      take = order_key(x) >= tk;
    }
    __syncthreads();
    append(s, take, x, i, cap);
    __syncthreads();
  }
  if (threadIdx.x == 0) s.thr = tk;
  __syncthreads();
}

// One pass over the row collecting every finite token that can be among the k largest x into the
// buffer (see the file comment); on(x, i, valid) sees every element. False when the buffer
// overflowed (the pass still runs to the end for on()).
template <class T, class On>
__device__ bool stream_topk(Smem& s, const RowRef<T>& rr, int cap, int k, float temp, On&& on) {
  if (threadIdx.x == 0) s.n = 0, s.thr = 0;
  __syncthreads();
  bool ok = true;
  float cur[kVec], nxt[kVec];
  int64_t i0 = (int64_t)threadIdx.x * kVec;
  load8(rr, i0, cur);
  for (int64_t b = 0; b < rr.n; b += kChunk) {
    const bool more = b + kChunk < rr.n;
    if (more) load8(rr, i0 + kChunk, nxt);
    const uint32_t thr = s.thr;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float x = to_x(cur[j], temp);
      const bool valid = i0 + j < rr.n;
      on(x, i0 + j, valid);
      append(s, ok && valid && x > -INFINITY && order_key(x) >= thr, x, i0 + j, cap);
    }
    __syncthreads();
    const int n = s.n;
    __syncthreads();  // every thread has read s.n before anyone changes it
    if (ok && (n >= kChunk / 2 || n > cap - kChunk)) {
      compact(s, rr, cap, k, temp);
      if (s.n > cap - kChunk) ok = false;  // the next step might not fit
      __syncthreads();
    }
    i0 += kChunk;
    if (more) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) cur[j] = nxt[j];
    }
  }
  return ok;
}

// ---- sample_tokens ----------------------------------------------------------------------------

template <class T>
__global__ void __launch_bounds__(kThreads, 2)
    sample_kernel(const T* __restrict__ logits, int64_t row_stride, int64_t V, const float* __restrict__ temperature,
                  const int32_t* __restrict__ top_k, const float* __restrict__ top_p, const float* __restrict__ min_p,
                  const int64_t* __restrict__ seeds, const int64_t* __restrict__ offsets, int cap,
                  int32_t* __restrict__ out) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem& s = *reinterpret_cast<Smem*>(smem_raw);
  const int64_t r = blockIdx.x;
  const RowRef<T> rr{logits + r * row_stride, V, ((uintptr_t)(logits + r * row_stride) & 15) == 0};
  const float temp = temperature[r];
  if (!(temp >= 1e-5f)) {  // greedy (NaN too: the CPU finds nothing finite and falls back to it)
    const int32_t t = greedy_row(s, rr);
    if (threadIdx.x == 0) out[r] = t;
    return;
  }
  const int k = top_k[r];
  const float p = top_p[r], mp = min_p[r];
  const bool use_k = k > 0 && k < V, use_p = p < 1.f, use_mp = mp > 0.f;
  const uint64_t key = row_key(seeds[r], offsets[r]);
  int32_t tok = -1;
  if (!use_k && !use_p && !use_mp) {
    tok = draw(s, rr, false, cap, temp, key, Kept{});
  } else {
    bool in_buf = false, complete = false;
    float m, S = 0.f;
    if (use_k && k <= kStreamMaxK && cap >= kStreamMinCap &&
        stream_topk(s, rr, cap, k, temp, [](float, int64_t, bool) {})) {
      in_buf = complete = true;
      float mt = -INFINITY;
      visit_buf(s, cap, [&](float x, int64_t, bool valid) {
        if (valid) mt = fmaxf(mt, x);
      });
      m = block_max(mt, s.redf);
    } else {
      const bool want_s = use_p && !use_k && !use_mp;
      float mt = -INFINITY, st = 0.f;
      visit_row(rr, [&](float raw, int64_t, bool valid) {
        const float x = scaled_logit(raw, temp);
        if (!valid || !(x > -INFINITY)) return;
        if (!want_s) {
          mt = fmaxf(mt, x);
        } else if (x > mt) {
          st = st * expf(mt - x) + 1.f;
          mt = x;
        } else {
          st += expf(x - mt);
        }
      });
      m = block_max(mt, s.redf);
      if (want_s) S = block_sum(mt == -INFINITY ? 0.f : st * expf(mt - m), s.redf);
    }
    Kept kept;
    kept.m = m;
    if (m == INFINITY) {
      kept.inf_only = true;
    } else if (m > -INFINITY) {
      if (use_k) {
        SelectArgs a;
        a.k = k;
        a.temp = temp;
        kept.tau_key = radix_select<false>(s, rr, cap, in_buf, complete, a);
      }
      kept.min_p = mp;
      if (use_p) {
        in_buf = complete;  // a buffer holding only one bin of the top-k select is of no use here
        SelectArgs a;
        a.temp = temp;
        a.m = m;
        a.tau_key = kept.tau_key;
        a.min_p = mp;
        a.top_p = p;
        // mass below the bound < V * bound * 2^44 <= (1 - p) * S' / 2 with S' >= 1 (the max), or
        // S' = S when S counts exactly the selection (top-p alone); S is f32, hence the 1/2 margin
        const float sl = (!use_k && !use_mp && S >= 1.f && S < INFINITY) ? S : 1.f;
        a.bound = (float)(0.5 * (1.0 - (double)p) * (double)sl / (double)V);
        kept.top_p = true;
        kept.t_key = radix_select<true>(s, rr, cap, in_buf, complete, a);
      }
    }
    if (m > -INFINITY) tok = draw(s, rr, complete, cap, temp, key, kept);
  }
  if (tok < 0) tok = greedy_row(s, rr);  // nothing finite to sample from
  if (threadIdx.x == 0) out[r] = tok;
}

// ---- logprobs ---------------------------------------------------------------------------------

template <class T>
__global__ void __launch_bounds__(kThreads, 2)
    logprobs_kernel(const T* __restrict__ logits, int64_t row_stride, int64_t V, const int32_t* __restrict__ token_ids,
                    int num_top, int cap, float* __restrict__ vals, int32_t* __restrict__ ids,
                    int32_t* __restrict__ ranks) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem& s = *reinterpret_cast<Smem*>(smem_raw);
  const int64_t r = blockIdx.x;
  const RowRef<T> rr{logits + r * row_stride, V, ((uintptr_t)(logits + r * row_stride) & 15) == 0};
  const int C = 1 + num_top;
  const int32_t t = token_ids[r];
  const bool t_ok = t >= 0 && t < V;
  const float xt = t_ok ? to_float(rr.row[t]) : NAN;
  float mt = -INFINITY, st = 0.f;
  u64 above = 0;
  bool nan = false;
  auto stats = [&](float x, int64_t, bool valid) {
    if (!valid) return;
    above += x > xt;
    if (x != x) {
      nan = true;
    } else if (x > mt) {
      st = (mt == -INFINITY ? 0.f : st * expf(mt - x)) + 1.f;
      mt = x;
    } else if (x > -INFINITY) {
      st += expf(x - mt);
    }
  };
  bool ok = false;
  if (num_top > 0 && cap >= kStreamMinCap)
    ok = stream_topk(s, rr, cap, num_top, 0.f, stats);
  else
    visit_row(rr, stats);
  const float m = block_max(mt, s.redf);
  const float S = block_sum(mt == -INFINITY ? 0.f : st * expf(mt - m), s.redf);
  const bool any_nan = block_sum(nan ? 1.f : 0.f, s.redf) > 0.f;
  const u64 n_above = block_sum_u64(above, s.red64);
  const float lse = (any_nan || !(m > -INFINITY) || m == INFINITY) ? NAN : m + logf(S);
  if (threadIdx.x == 0) {
    vals[r * C] = t_ok ? xt - lse : NAN;
    ids[r * C] = t;
    ranks[r] = t_ok ? (int32_t)(1 + n_above) : 0;
  }
  if (num_top == 0) return;
  // top num_top in topk's order (rank_key): from the buffer when it holds them, else from the row
  const bool from_buf = ok && !any_nan && min(s.n, cap) >= num_top;
  u64 prev = ~0ull;
  for (int j = 0; j < num_top; ++j) {
    u64 best = 0;
    auto f = [&](float x, int64_t i, bool valid) {
      if (!valid) return;
      const u64 key = rank_key(x, i);
      if (key < prev && key > best) best = key;
    };
    if (from_buf)
      visit_buf(s, cap, f);
    else
      visit_row(rr, f);
    best = block_max_u64(best, s.red64);
    prev = best;
    if (threadIdx.x == 0) {
      const int64_t i = key_index(best);
      vals[r * C + 1 + j] = to_float(rr.row[i]) - lse;
      ids[r * C + 1 + j] = (int32_t)i;
    }
  }
}

// ---- apply_penalties --------------------------------------------------------------------------

__global__ void penalties_kernel(float* __restrict__ logits, int64_t V, const int32_t* __restrict__ token_ids,
                                 const int32_t* __restrict__ counts, int64_t L, int64_t total,
                                 const float* __restrict__ rep, const float* __restrict__ freq,
                                 const float* __restrict__ pres) {
  for (int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; q < total; q += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = q / L;
    const int32_t id = token_ids[q];
    if (id < 0 || id >= V) continue;  // padding, or out of range (skipped: no read-back on the decode path)
    const int32_t c = counts[q];
    float* p = logits + r * V + id;
    float v = *p;
    if (c < 0) {
      v = -INFINITY;
    } else {
      const float rp = rep[r];
      if (rp != 1.f) v = v > 0.f ? __fdiv_rn(v, rp) : __fmul_rn(v, rp);
      // the CPU's two roundings, not an FMA
      v = __fsub_rn(v, __fadd_rn(__fmul_rn(freq[r], (float)c), c > 0 ? pres[r] : 0.f));
    }
    *p = v;
  }
}

template <class K>
void set_smem(const char* op, K kernel) {
  TALLOW_CUDA_CHECK(op, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sizeof(Smem)));
}

}  // namespace

void set_sampling_buffer_capacity(int n) { g_cap.store(n <= 0 || n > kCap ? kCap : n); }

void apply_penalties(const Tensor& logits, const Tensor& token_ids, const Tensor& token_counts,
                     const Tensor& repetition_penalty, const Tensor& frequency_penalty,
                     const Tensor& presence_penalty) {
  const char* op = "apply_penalties";
  const int64_t B = logits.size(0), V = logits.size(1), L = token_ids.size(1), total = B * L;
  if (total == 0) return;
  OpContext ctx(logits);
  penalties_kernel<<<grid_for(total, 256), 256, 0, ctx.stream>>>(
      logits.data<float>(), V, token_ids.data<int32_t>(), token_counts.data<int32_t>(), L, total,
      repetition_penalty.data<float>(), frequency_penalty.data<float>(), presence_penalty.data<float>());
  TALLOW_CUDA_CHECK_LAUNCH(op);
}

Tensor sample_tokens(const Tensor& logits, const Tensor& temperature, const Tensor& top_k, const Tensor& top_p,
                     const Tensor& min_p, const Tensor& seeds, const Tensor& offsets) {
  const char* op = "sample_tokens";
  const int64_t B = logits.size(0), V = logits.size(1);
  Tensor out = Tensor::empty({B}, DType::I32, logits.device());
  if (B == 0) return out;
  TALLOW_CHECK(B <= 0x7fffffffLL, op, ": too many rows (", B, ")");
  OpContext ctx(logits);
  TALLOW_CUDA_DISPATCH_FLOAT(op, logits.dtype(), [&] {
    using T = scalar_t;
    set_smem(op, sample_kernel<T>);
    sample_kernel<T><<<(unsigned)B, kThreads, sizeof(Smem), ctx.stream>>>(
        static_cast<const T*>(logits.data_ptr()), logits.stride(0), V, temperature.data<float>(),
        top_k.data<int32_t>(), top_p.data<float>(), min_p.data<float>(), seeds.data<int64_t>(),
        offsets.data<int64_t>(), g_cap.load(), out.data<int32_t>());
  });
  TALLOW_CUDA_CHECK_LAUNCH(op);
  return out;
}

std::tuple<Tensor, Tensor, Tensor> logprobs(const Tensor& logits, const Tensor& token_ids, int64_t num_top) {
  const char* op = "logprobs";
  const int64_t B = logits.size(0), V = logits.size(1), C = 1 + num_top;
  Tensor vals = Tensor::empty({B, C}, DType::F32, logits.device());
  Tensor ids = Tensor::empty({B, C}, DType::I32, logits.device());
  Tensor ranks = Tensor::empty({B}, DType::I32, logits.device());
  if (B == 0) return {vals, ids, ranks};
  TALLOW_CHECK(B <= 0x7fffffffLL, op, ": too many rows (", B, ")");
  OpContext ctx(logits);
  TALLOW_CUDA_DISPATCH_FLOAT(op, logits.dtype(), [&] {
    using T = scalar_t;
    set_smem(op, logprobs_kernel<T>);
    logprobs_kernel<T><<<(unsigned)B, kThreads, sizeof(Smem), ctx.stream>>>(
        static_cast<const T*>(logits.data_ptr()), logits.stride(0), V, token_ids.data<int32_t>(), (int)num_top,
        g_cap.load(), vals.data<float>(), ids.data<int32_t>(), ranks.data<int32_t>());
  });
  TALLOW_CUDA_CHECK_LAUNCH(op);
  return {vals, ids, ranks};
}

}  // namespace tallow::cuda
