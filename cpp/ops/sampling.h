// Sampling on the device: logit penalties, token sampling (temperature, top-k, min-p, top-p, seeded
// Gumbel-max) and log-probabilities. Every input of one call sits on one device; B rows, V vocab.
// The row semantics are python/tallow/engine/sampler.py's (vLLM's); the CPU kernels are the
// reference and the CUDA kernels (cuda/sampling.cu) compute the same numbers.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#include "core/tensor.h"

namespace tallow::ops {

// In place on logits f32 [B, V] (contiguous). token_ids i32 [B, L] lists, per row, tokens to
// penalise (-1 = padding; an id at most once per row), token_counts i32 [B, L] their counts in the
// output so far (0 for prompt-only tokens). For each listed id:
//   count < 0             logit = -inf (a banned token: min_tokens masking of stop/EOS ids)
//   else                  if repetition != 1: logit = logit > 0 ? logit / rep : logit * rep
//                         logit -= frequency * count + presence * (count > 0)
// Penalties f32 [B]. An id outside [0, V) raises IndexError on the CPU and is skipped on CUDA
// (no device-to-host read on the decode path). Duplicate ids in a row are the caller's bug (on CUDA
// they race).
void apply_penalties(const Tensor& logits, const Tensor& token_ids, const Tensor& token_counts,
                     const Tensor& repetition_penalty, const Tensor& frequency_penalty,
                     const Tensor& presence_penalty);

// In place: logits f32/f16/bf16 [B, V] (rows contiguous) where bit (j % 32) of bitmask[b, j / 32] is 0
// becomes -inf: token j is not allowed in row b (a grammar's next-token mask, llguidance's layout).
// bitmask i32 [B, W] with W >= ceil(V / 32), contiguous; bits past V are ignored; a row of -1 allows
// every token.
void apply_token_bitmask_(const Tensor& logits, const Tensor& bitmask);

// One token per row, i32 [B]. logits f32/f16/bf16 [B, V] (last dim contiguous); temperature,
// top_p, min_p f32 [B]; top_k i32 [B] (<= 0 or >= V: off); seeds, offsets i64 [B].
//   temperature < 1e-5 (or NaN): greedy argmax of the raw logits (first index on ties, NaN counts as largest).
//   else x = logit / T (f32 division; NaN -> -inf, -0 -> +0), m = max x, e = expf(x - m), and the
//   kept set is
//     top-k   x >= the k-th largest x (ties kept)
//     min-p   e >= min_p                                   (min_p <= 0: off)
//     top-p   over what is left: e >= t, t the largest e-value whose tokens with e >= t carry at
//             least ceil(top_p * S) of the left mass S     (top_p >= 1: off)
//   Masses are fixed point, mass(e) = (uint64)(e * 2^44), summed exactly, so the threshold does not
//   depend on summation order (CPU and CUDA agree bit for bit given the same e values).
//   The token is argmax over kept of x_i + g_i (ties: lower index), Gumbel-max sampling from the
//   renormalised kept distribution, with g_i = gumbel(row_key(seed, offset), i) below. -inf tokens are
//   never kept; a +inf token wins (the first one); a row with nothing finite returns the greedy
//   argmax of its raw logits.
// CPU and CUDA pick the same token except where two candidates are within float rounding (expf /
// logf differ by an ulp between the two backends).
Tensor sample_tokens(const Tensor& logits, const Tensor& temperature, const Tensor& top_k, const Tensor& top_p,
                     const Tensor& min_p, const Tensor& seeds, const Tensor& offsets);

// log_softmax of the raw logits f32/f16/bf16 [B, V]: values f32 [B, 1 + num_top], ids i32
// [B, 1 + num_top], ranks i32 [B]. Column 0 is token_ids (i32 [B]) and its log-probability,
// columns 1.. the num_top (0..20) most probable tokens (ties: lower id first); rank = 1 + the
// number of tokens with a strictly larger logit. An id outside [0, V) raises IndexError on the CPU;
// on CUDA its value is NaN and its rank 0.
std::tuple<Tensor, Tensor, Tensor> logprobs(const Tensor& logits, const Tensor& token_ids, int64_t num_top);

}  // namespace tallow::ops

// ---- the sampling RNG and keys, shared bit for bit by the CPU and CUDA kernels ------------------
//
// gumbel(key, i): a counter-based hash, so a row's draw depends only on (seed, offset) and never on
// the batch or on the thread layout:
//   mix64(z) = splitmix64's finaliser: z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27;
//              z *= 0x94D049BB133111EB; z ^= z >> 31
//   k        = mix64(mix64(seed) + offset)                   (per row)
//   a, c     = (k >> 32) | 1, k mod 2^32                      (the row's odd multiplier and addend)
//   h        = hash32(a * i + c mod 2^32)                     (one 32-bit hash per token)
//   hash32(x): x ^= x >> 16; x *= 0x21F0AAAD; x ^= x >> 15; x *= 0xD35A2D97; x ^= x >> 15
//   24 random bits: b = h >> 31, j = (h >> 8) & (2^23 - 1), w = (2j + 1) * 2^-25 (exact in f32)
//   u        = b ? 1 - w : w                                  (uniform on {(2k+1)/2^25}: never 0 or 1)
//   E = -log(u) = b ? -log1pf(-w) : -logf(w)                  (accurate at both ends)
//   g        = -logf(E)                                        (Gumbel(0, 1); g < 17.34 always)
// hash32 is "lowbias32" from Wellons' hash-prospector, with TheIronBorn's constants (flipping any
// input bit flips each output bit with probability 1/2 +- 0.0015, measured over 2^20 inputs: the
// sampling noise); a bijection, and a * i + c is one for odd a, so a row's tokens get distinct
// hashes; two rows (other seed or offset) walk the input space with unrelated strides.
// Measured on the bits used (tests/python/test_sampling_ops.py::test_rng_statistics): uniform
// 24-bit values, no correlation between neighbouring tokens or consecutive offsets, mean and variance
// of g those of Gumbel(0, 1). Not cryptographic: do not use the draws as secrets.
//
// gumbel_bound(h) >= gumbel(h) from the leading zeros of 2j + 1 alone (-log(1 - w) >= w, so
// g <= -log w for b = 1; g <= -log(log 2) for b = 0), plus 1e-3 of slack for rounding: a draw skips
// the logs of any token whose x + gumbel_bound(h) is below the best score so far (exact: such a token
// can neither win nor tie).
#if defined(__CUDACC__)
#define TALLOW_SAMPLING_HD __host__ __device__ __forceinline__
#else
#define TALLOW_SAMPLING_HD inline
#endif

namespace tallow::sampling {

constexpr float kGumbelMax = 17.5f;  // bound on g (the largest is -logf(-log1pf(-2^-25)) ~ 17.33)
constexpr float kMassScale = 17592186044416.0f;  // 2^44

TALLOW_SAMPLING_HD uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

struct RowKey {
  uint32_t a, c;  // h = hash32(a * i + c); a odd
};

TALLOW_SAMPLING_HD RowKey row_key(int64_t seed, int64_t offset) {
  const uint64_t k = mix64(mix64((uint64_t)seed) + (uint64_t)offset);
  return RowKey{(uint32_t)(k >> 32) | 1u, (uint32_t)k};
}

TALLOW_SAMPLING_HD uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x21F0AAADu;
  x ^= x >> 15;
  x *= 0xD35A2D97u;
  x ^= x >> 15;
  return x;
}

// The token's 32 hash bits (i < 2^31).
TALLOW_SAMPLING_HD uint32_t token_bits(RowKey key, int64_t i) { return hash32(key.a * (uint32_t)i + key.c); }

TALLOW_SAMPLING_HD float gumbel_bits(uint32_t h) {
  const float w = (float)(((h >> 7) & 0xFFFFFEu) | 1u) * 2.98023223876953125e-08f;  // (2j + 1) * 2^-25
  const float E = (h >> 31) ? -::log1pf(-w) : -::logf(w);
  return -::logf(E);
}

TALLOW_SAMPLING_HD float gumbel(RowKey key, int64_t i) { return gumbel_bits(token_bits(key, i)); }

// >= gumbel_bits(h) (see above): b = 0: 0.3675 > -log(log 2); b = 1: (25 - floor(log2(2j + 1))) log 2
// + 1e-3, with floor(log2(2j + 1)) >= floor(log2(2h + 1 mod 2^32)) - 8 (equal for j > 0: below j,
// 2h + 1 holds only the 8 unused bits and a 1). Branch-free, no conversion instruction on CUDA.
TALLOW_SAMPLING_HD float gumbel_bound(uint32_t h) {
  const uint32_t v = 2u * h + 1u;  // b shifted out, j in bits 31..9
#if defined(__CUDA_ARCH__)
  uint32_t lg;  // floor(log2 v) in [0, 31]
  asm("bfind.u32 %0, %1;" : "=r"(lg) : "r"(v));
  const float lgf = __uint_as_float(0x4B000000u | lg) - 8388608.0f;  // (float)lg: 2^23 + lg - 2^23
#elif defined(__GNUC__) || defined(__clang__)
  const float lgf = (float)(31 - __builtin_clz(v));
#else
  int lg = 0;
  for (uint32_t t = v; t > 1; t >>= 1) ++lg;
  const float lgf = (float)lg;
#endif
  const float b1 = lgf * -0.693147181f + (33.0f * 0.693147181f + 1e-3f);  // (25 - (lg - 8)) log 2 + 1e-3
  return (h >> 31) ? b1 : 0.3675f;
}

TALLOW_SAMPLING_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

TALLOW_SAMPLING_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// Order-preserving key of a non-NaN float (-0 must be normalised to +0 first).
TALLOW_SAMPLING_HD uint32_t order_key(float x) {
  const uint32_t b = float_bits(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
TALLOW_SAMPLING_HD float key_value(uint32_t k) {
  return bits_float((k & 0x80000000u) ? (k ^ 0x80000000u) : ~k);
}

// Fixed-point mass of an unnormalised probability e in [0, 1] (exact: e * 2^44 is a power-of-two
// scaling, the conversion truncates).
TALLOW_SAMPLING_HD uint64_t mass(float e) { return (uint64_t)(e * kMassScale); }

// The top-p target: ceil(top_p * total) in [1, total].
TALLOW_SAMPLING_HD uint64_t top_p_target(float top_p, uint64_t total) {
  const double t = ::ceil((double)top_p * (double)total);
  if (t >= (double)total) return total;
  return t < 1.0 ? 1 : (uint64_t)t;
}

// The per-element transform of sampling: x = logit / T, NaN -> -inf, -0 -> +0.
TALLOW_SAMPLING_HD float scaled_logit(float logit, float temperature) {
  const float x = logit / temperature;
  if (x != x) return -INFINITY;
  return x == 0.0f ? 0.0f : x;
}

}  // namespace tallow::sampling
