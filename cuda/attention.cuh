// Reference attention over contiguous K/V (see cpp/ops/attention.cpp for the definitions):
// the visible key range of a query and the problem description passed to the kernel.
#pragma once
#include "common.cuh"

namespace tallow::cuda {

constexpr int kAttnMaxHeadDim = 576;  // per-lane registers hold D/32 (and Dv/32) values; 576: DeepSeek MLA decode (512 + 64)

struct AttnOperand {
  const void* base;
  int64_t sb, st, sh;  // element strides of batch, token, head (last dim contiguous)
};

struct AttnProblem {
  int64_t B, Tq, Tk, Hq, Hk, D, Dv;
  float scale, softcap;
  bool causal;
  int64_t window;
  AttnOperand q, k, v;
  void* out;  // contiguous [B, Tq, Hq, Dv]
};

__device__ __forceinline__ void attn_visible_range(const AttnProblem& P, int64_t p, int64_t& lo, int64_t& hi) {
  lo = 0;
  hi = P.Tk;
  if (P.causal || P.window > 0) hi = hi < p + 1 ? hi : p + 1;
  if (P.window > 0) lo = lo > p - P.window + 1 ? lo : p - P.window + 1;
  if (hi < lo) hi = lo;
}

}  // namespace tallow::cuda
