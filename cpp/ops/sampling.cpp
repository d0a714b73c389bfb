// Family status: CPU reference complete and tested (tests/python/test_sampling_ops.py).
// Penalties, token sampling and log-probabilities on CPU, one row per task, rows in parallel (see
// sampling.h for the contracts). The sampler works on the row's candidates only: after top-k (an
// nth_element) and min-p, top-p sorts just the tokens that can reach the nucleus: any token with
// e < L = (1 - top_p) * S / (2 V) lies below the threshold, because all such tokens together carry
// less than (1 - top_p) S of the mass S.
#include "ops/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "ops/common.h"
#include "ops/rows.h"

namespace tallow::ops {

namespace {

using namespace tallow::sampling;

// A [B] parameter vector: exact dtype, 1-D, contiguous, on the logits' device.
void check_param(const char* op, const Tensor& t, const char* name, DType dt, int64_t B, const Tensor& logits) {
  check_defined(op, t, name);
  TALLOW_CHECK_TYPE(t.dtype() == dt, op, ": ", name, " must be ", dtype_name(dt), " [B] with B = ", B, ", got ",
                    dtype_name(t.dtype()), " tensor of shape ", shape_str(t.shape()));
  TALLOW_CHECK(t.dim() == 1 && t.size(0) == B, op, ": ", name, " must have shape [", B, "] (one per row of logits ",
               shape_str(logits.shape()), "), got ", shape_str(t.shape()));
  check_contiguous(op, t, name);
  check_same_device(op, logits, t);
}

void check_logits(const char* op, const Tensor& x) {
  check_defined(op, x, "logits");
  check_float(op, x, "logits");
  TALLOW_CHECK(x.dim() == 2, op, ": logits must be 2-D [B, V], got shape ", shape_str(x.shape()));
  TALLOW_CHECK(x.size(1) > 0 || x.size(0) == 0, op, ": logits ", shape_str(x.shape()), " has an empty vocabulary");
  TALLOW_CHECK(x.size(1) < (int64_t(1) << 31) - 1, op, ": vocabulary of ", x.size(1), " tokens is too large");
  TALLOW_CHECK(x.size(1) <= 1 || x.stride(1) == 1, op, ": logits ", shape_str(x.shape()), " with strides ",
               shape_str(x.strides()), " must be contiguous in the last dimension");
}

// First index of the largest value; NaN counts as largest (numpy's argmax).
template <class T>
int32_t argmax_raw(const T* l, int64_t V) {
  int64_t best = 0;
  float bv = to_f32(l[0]);
  if (bv != bv) return 0;
  for (int64_t i = 1; i < V; ++i) {
    const float v = to_f32(l[i]);
    if (v != v) return (int32_t)i;
    if (v > bv) bv = v, best = i;
  }
  return (int32_t)best;
}

struct Scratch {
  std::vector<float> x;
  std::vector<int32_t> cand;
  std::vector<std::pair<float, int32_t>> by_e;
};

template <class T>
int32_t sample_row(const T* l, int64_t V, float temp, int32_t k, float top_p, float min_p, int64_t seed,
                   int64_t offset, Scratch& sc) {
  if (!(temp >= 1e-5f)) return argmax_raw(l, V);  // NaN too
  std::vector<float>& x = sc.x;
  x.resize((size_t)V);
  float m = -INFINITY;
  for (int64_t i = 0; i < V; ++i) {
    x[i] = scaled_logit(to_f32(l[i]), temp);
    m = std::max(m, x[i]);
  }
  if (m == -INFINITY) return argmax_raw(l, V);
  if (m == INFINITY) return (int32_t)(std::find(x.begin(), x.end(), INFINITY) - x.begin());

  std::vector<int32_t>& cand = sc.cand;
  cand.clear();
  for (int64_t i = 0; i < V; ++i)
    if (x[i] > -INFINITY) cand.push_back((int32_t)i);
  auto keep_if = [&](auto pred) {
    cand.erase(std::remove_if(cand.begin(), cand.end(), [&](int32_t i) { return !pred(i); }), cand.end());
  };

  if (k > 0 && k < V && (int64_t)cand.size() > k) {  // top-k: the k-th largest x, ties kept
    std::nth_element(cand.begin(), cand.begin() + (k - 1), cand.end(),
                     [&](int32_t a, int32_t b) { return x[a] > x[b]; });
    const float tau = x[cand[k - 1]];
    keep_if([&](int32_t i) { return x[i] >= tau; });
  }
  auto e_of = [&](int32_t i) { return std::exp(x[i] - m); };
  if (min_p > 0.0f) keep_if([&](int32_t i) { return e_of(i) >= min_p; });
  if (top_p < 1.0f) {
    uint64_t total = 0;
    for (int32_t i : cand) total += mass(e_of(i));
    const uint64_t target = top_p_target(top_p, total);
    const float bound = (float)(0.5 * (1.0 - (double)top_p) * ((double)total / (double)kMassScale) / (double)V);
    for (int pass = 0; pass < 2; ++pass) {  // pass 1 (without the bound) only if rounding defeated it
      sc.by_e.clear();
      for (int32_t i : cand) {
        const float e = e_of(i);
        if (pass == 1 || e >= bound) sc.by_e.push_back({e, i});
      }
      std::sort(sc.by_e.begin(), sc.by_e.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
      uint64_t cum = 0;
      float t = -1.0f;
      for (const auto& p : sc.by_e) {
        cum += mass(p.first);
        if (cum >= target) {
          t = p.first;
          break;
        }
      }
      if (t >= 0.0f) {
        keep_if([&](int32_t i) { return e_of(i) >= t; });
        break;
      }
    }
  }
  if (cand.empty()) return argmax_raw(l, V);  // min_p > 1 (else the maximum is always kept)
  const RowKey key = row_key(seed, offset);
  int32_t best = -1;
  float bv = -INFINITY;
  for (int32_t i : cand) {
    const uint32_t h = token_bits(key, i);
    // x + g rounds below bv, so the token can neither win nor tie: skip the logs (the bound's 1e-3
    // of slack covers the roundings while |bv| < 2^13, the 2^-22 |bv| beyond)
    if (best >= 0 && x[i] + gumbel_bound(h) < bv - std::fabs(bv) * 0x1p-22f) continue;
    const float v = x[i] + gumbel_bits(h);
    if (best < 0 || v > bv || (v == bv && i < best)) bv = v, best = i;
  }
  return best;
}

// NaN above every number, then larger value, then lower index (topk's total order).
inline bool ranks_before(float a, int32_t ia, float b, int32_t ib) {
  const bool an = a != a, bn = b != b;
  if (an || bn) return an && (!bn || ia < ib);
  return a > b || (a == b && ia < ib);
}

}  // namespace

void apply_penalties(const Tensor& logits, const Tensor& token_ids, const Tensor& token_counts,
                     const Tensor& repetition_penalty, const Tensor& frequency_penalty,
                     const Tensor& presence_penalty) {
  const char* op = "apply_penalties";
  check_defined(op, logits, "logits");
  TALLOW_CHECK_TYPE(logits.dtype() == DType::F32, op, ": logits must be float32 [B, V], got ",
                    dtype_name(logits.dtype()), " tensor of shape ", shape_str(logits.shape()));
  TALLOW_CHECK(logits.dim() == 2, op, ": logits must be 2-D [B, V], got shape ", shape_str(logits.shape()));
  check_contiguous(op, logits, "logits");
  const int64_t B = logits.size(0), V = logits.size(1);
  for (auto [t, name] : {std::pair{&token_ids, "token_ids"}, std::pair{&token_counts, "token_counts"}}) {
    check_defined(op, *t, name);
    TALLOW_CHECK_TYPE(t->dtype() == DType::I32, op, ": ", name, " must be int32 [B, L], got ", dtype_name(t->dtype()),
                      " tensor of shape ", shape_str(t->shape()));
    TALLOW_CHECK(t->dim() == 2 && t->size(0) == B, op, ": ", name, " must be [B, L] with B = ", B, " (logits ",
                 shape_str(logits.shape()), "), got shape ", shape_str(t->shape()));
    check_contiguous(op, *t, name);
    check_same_device(op, logits, *t);
  }
  TALLOW_CHECK(token_ids.shape() == token_counts.shape(), op, ": token_ids ", shape_str(token_ids.shape()),
               " and token_counts ", shape_str(token_counts.shape()), " must have the same shape");
  check_param(op, repetition_penalty, "repetition_penalty", DType::F32, B, logits);
  check_param(op, frequency_penalty, "frequency_penalty", DType::F32, B, logits);
  check_param(op, presence_penalty, "presence_penalty", DType::F32, B, logits);
  const int64_t L = token_ids.size(1);
  if (B == 0 || L == 0) return;
  if (!logits.device().is_cpu())
    return device_op(&BackendOps::apply_penalties, op, logits, {&logits, &token_ids, &token_counts})(
        logits, token_ids, token_counts, repetition_penalty, frequency_penalty, presence_penalty);
  const int32_t* ids = token_ids.data<int32_t>();
  const int32_t* counts = token_counts.data<int32_t>();
  for (int64_t i = 0; i < B * L; ++i)  // check first, so a bad id leaves logits untouched
    TALLOW_CHECK_INDEX(ids[i] < V, op, ": token id ", ids[i], " in row ", i / L, " is out of range for V = ", V,
                       " (logits ", shape_str(logits.shape()), ")");
  float* lg = logits.data<float>();
  const float* rep = repetition_penalty.data<float>();
  const float* freq = frequency_penalty.data<float>();
  const float* pres = presence_penalty.data<float>();
  parallel_rows(B, L, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* row = lg + r * V;
      for (int64_t j = 0; j < L; ++j) {
        const int32_t id = ids[r * L + j], c = counts[r * L + j];
        if (id < 0) continue;
        float v = row[id];
        if (c < 0) {
          v = -INFINITY;
        } else {
          if (rep[r] != 1.0f) v = v > 0.0f ? v / rep[r] : v * rep[r];
          const float f = freq[r] * (float)c;
          v -= f + (c > 0 ? pres[r] : 0.0f);
        }
        row[id] = v;
      }
    }
  });
}

void apply_token_bitmask_(const Tensor& logits, const Tensor& bitmask) {
  const char* op = "apply_token_bitmask_";
  check_logits(op, logits);
  check_defined(op, bitmask, "bitmask");
  const int64_t B = logits.size(0), V = logits.size(1);
  TALLOW_CHECK_TYPE(bitmask.dtype() == DType::I32, op, ": bitmask must be int32 [B, W], got ",
                    dtype_name(bitmask.dtype()), " tensor of shape ", shape_str(bitmask.shape()));
  TALLOW_CHECK(bitmask.dim() == 2 && bitmask.size(0) == B && bitmask.size(1) * 32 >= V, op,
               ": bitmask must be [B, W] with B = ", B, " and W >= ", (V + 31) / 32, " (logits ",
               shape_str(logits.shape()), "), got shape ", shape_str(bitmask.shape()));
  check_contiguous(op, bitmask, "bitmask");
  check_same_device(op, logits, bitmask);
  if (B == 0) return;
  if (!logits.device().is_cpu())
    return device_op(&BackendOps::apply_token_bitmask_, op, logits, {&logits, &bitmask})(logits, bitmask);
  const int64_t W = bitmask.size(1), rs = logits.stride(0), es = dtype_type_size(logits.dtype());
  // -inf as raw bits, so one loop serves every float type
  const uint32_t ninf = logits.dtype() == DType::F32 ? 0xFF800000u : logits.dtype() == DType::BF16 ? 0xFF80u : 0xFC00u;
  const int32_t* mask = bitmask.data<int32_t>();
  uint8_t* base = static_cast<uint8_t*>(logits.data_ptr());
  parallel_rows(B, V, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      uint8_t* row = base + r * rs * es;
      for (int64_t w = 0; w < W && 32 * w < V; ++w) {
        const uint32_t bits = (uint32_t)mask[r * W + w];
        if (bits == 0xFFFFFFFFu) continue;
        const int64_t end = std::min<int64_t>(32, V - 32 * w);
        for (int64_t k = 0; k < end; ++k) {
          if (bits >> k & 1u) continue;
          uint8_t* e = row + (32 * w + k) * es;
          if (es == 4) std::memcpy(e, &ninf, 4);
          else { const uint16_t h = (uint16_t)ninf; std::memcpy(e, &h, 2); }
        }
      }
    }
  });
}

Tensor sample_tokens(const Tensor& logits, const Tensor& temperature, const Tensor& top_k, const Tensor& top_p,
                     const Tensor& min_p, const Tensor& seeds, const Tensor& offsets) {
  const char* op = "sample_tokens";
  check_logits(op, logits);
  const int64_t B = logits.size(0), V = logits.size(1);
  check_param(op, temperature, "temperature", DType::F32, B, logits);
  check_param(op, top_k, "top_k", DType::I32, B, logits);
  check_param(op, top_p, "top_p", DType::F32, B, logits);
  check_param(op, min_p, "min_p", DType::F32, B, logits);
  check_param(op, seeds, "seeds", DType::I64, B, logits);
  check_param(op, offsets, "offsets", DType::I64, B, logits);
  // integer masses (sampling.h) sum exactly up to 2^20 tokens of mass <= 2^44
  TALLOW_CHECK(V <= (int64_t(1) << 20), op, ": vocabularies above 2^20 tokens are not supported, got logits ",
               shape_str(logits.shape()));
  if (!logits.device().is_cpu())
    return device_op(&BackendOps::sample_tokens, op, logits)(logits, temperature, top_k, top_p, min_p, seeds, offsets);
  Tensor out = Tensor::empty({B}, DType::I32, logits.device());
  if (B == 0) return out;
  int32_t* o = out.data<int32_t>();
  const float* T = temperature.data<float>();
  const int32_t* K = top_k.data<int32_t>();
  const float* P = top_p.data<float>();
  const float* MP = min_p.data<float>();
  const int64_t* S = seeds.data<int64_t>();
  const int64_t* OF = offsets.data<int64_t>();
  TALLOW_DISPATCH_FLOAT(op, logits.dtype(), [&] {
    parallel_rows(B, 8 * V, [&](int64_t r0, int64_t r1) {
      Scratch sc;
      for (int64_t r = r0; r < r1; ++r)
        o[r] = sample_row<scalar_t>(row_ptr<const scalar_t>(logits, r), V, T[r], K[r], P[r], MP[r], S[r], OF[r], sc);
    });
  });
  return out;
}

std::tuple<Tensor, Tensor, Tensor> logprobs(const Tensor& logits, const Tensor& token_ids, int64_t num_top) {
  const char* op = "logprobs";
  check_logits(op, logits);
  const int64_t B = logits.size(0), V = logits.size(1);
  check_param(op, token_ids, "token_ids", DType::I32, B, logits);
  TALLOW_CHECK(num_top >= 0 && num_top <= 20, op, ": num_top = ", num_top, " must be in [0, 20]");
  TALLOW_CHECK(num_top <= V || B == 0, op, ": num_top = ", num_top, " exceeds the vocabulary of logits ",
               shape_str(logits.shape()));
  if (!logits.device().is_cpu())
    return device_op(&BackendOps::logprobs, op, logits, {&logits, &token_ids})(logits, token_ids, num_top);
  const int64_t C = 1 + num_top;
  Tensor vals = Tensor::empty({B, C}, DType::F32, logits.device());
  Tensor ids = Tensor::empty({B, C}, DType::I32, logits.device());
  Tensor ranks = Tensor::empty({B}, DType::I32, logits.device());
  if (B == 0) return {vals, ids, ranks};
  const int32_t* tok = token_ids.data<int32_t>();
  for (int64_t r = 0; r < B; ++r)
    TALLOW_CHECK_INDEX(tok[r] >= 0 && tok[r] < V, op, ": token id ", tok[r], " in row ", r,
                       " is out of range for logits ", shape_str(logits.shape()));
  float* vo = vals.data<float>();
  int32_t* io = ids.data<int32_t>();
  int32_t* ro = ranks.data<int32_t>();
  TALLOW_DISPATCH_FLOAT(op, logits.dtype(), [&] {
    parallel_rows(B, 4 * V, [&](int64_t r0, int64_t r1) {
      std::vector<float> x;
      std::vector<int32_t> order;
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* l = row_ptr<const scalar_t>(logits, r);
        x.resize((size_t)V);
        float m = -INFINITY;
        for (int64_t i = 0; i < V; ++i) {
          x[i] = to_f32(l[i]);
          m = x[i] > m ? x[i] : m;
        }
        double sum = 0.0;
        for (int64_t i = 0; i < V; ++i) sum += (double)std::exp(x[i] - m);
        const double lse = (double)m + std::log(sum);
        const int32_t t = tok[r];
        int64_t above = 0;
        for (int64_t i = 0; i < V; ++i) above += x[i] > x[t];
        vo[r * C] = (float)((double)x[t] - lse);
        io[r * C] = t;
        ro[r] = (int32_t)(1 + above);
        if (num_top == 0) continue;
        order.resize((size_t)V);
        for (int64_t i = 0; i < V; ++i) order[i] = (int32_t)i;
        auto cmp = [&](int32_t a, int32_t b) { return ranks_before(x[a], a, x[b], b); };
        std::partial_sort(order.begin(), order.begin() + num_top, order.end(), cmp);
        for (int64_t j = 0; j < num_top; ++j) {
          vo[r * C + 1 + j] = (float)((double)x[order[j]] - lse);
          io[r * C + 1 + j] = order[j];
        }
      }
    });
  });
  return {vals, ids, ranks};
}

}  // namespace tallow::ops
