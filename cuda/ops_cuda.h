// The CUDA entry points of every core op, with the contracts of cpp/ops/*.h. backend.cpp registers
// them as DeviceType::CUDA's op table (core/backend.h); the op entry points in cpp/ops call them
// through that table after their argument checks when the tensors are on a CUDA device. Inputs may have any strides the CPU op accepts; outputs are contiguous. Work runs
// asynchronously on the current stream of the tensors' device; failures raise naming the op.
#pragma once
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "core/tensor.h"

namespace tallow::cuda {

// Index checks (launch.cu): rotary_embedding's positions, embedding's ids, paged attention's block
// ids and reshape_and_cache's slots are validated on the device and read back before the op returns,
// raising IndexError/ValueError as on the CPU. The read-back waits for the stream; an engine that
// builds these indices itself can turn the checks off (they are skipped anyway under graph capture).
bool index_checks();
void set_index_checks(bool on);

// activation.cu
Tensor silu_and_mul(const Tensor& x, const std::optional<Tensor>& out = std::nullopt);
Tensor gelu_and_mul(const Tensor& x, const std::string& approximate = "tanh",
                    const std::optional<Tensor>& out = std::nullopt);
// attention.cu
Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, float scale, bool causal = true,
                 int64_t sliding_window = 0, float softcap = 0.0f);
// cast.cu
Tensor cast(const Tensor& x, DType dtype);
// dequant.cu
Tensor dequantize(const Tensor& q, DType dtype = DType::F32);
// quantize.cu (ops/quantize.h): the same bytes as the CPU op
Tensor quantize(const Tensor& x, DType dtype);
// elementwise.cu
Tensor add(const Tensor& a, const Tensor& b, const std::optional<Tensor>& out = std::nullopt);
Tensor mul(const Tensor& a, const Tensor& b, const std::optional<Tensor>& out = std::nullopt);
Tensor scale(const Tensor& a, float s, const std::optional<Tensor>& out = std::nullopt);
// embedding.cu
Tensor embedding(const Tensor& ids, const Tensor& table, std::optional<DType> out_dtype = std::nullopt,
                 std::optional<int64_t> vocab_start = std::nullopt);
// gemm.cu
Tensor matmul(const Tensor& a, const Tensor& b, const std::optional<Tensor>& out = std::nullopt);
Tensor linear(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias = std::nullopt,
              const std::optional<Tensor>& out = std::nullopt);
// o2[M, N] (a row-major view with row stride >= N, e.g. a column slice of a wider out) = x2[M, K] * w[N, K]^T
// (+ bias[N], contiguous): linear's kernels writing in place (quant_linear's chunked prefill).
void linear_2d_into(const Tensor& x2, const Tensor& w, const Tensor* bias, Tensor& o2);
Tensor gated_linear(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias, const std::string& activation, const std::optional<Tensor>& out);
// quant_linear.cu (ops/quant_linear.h): w in a GGUF block dtype; q8 activations + __dp4a up to 8 rows
Tensor quant_linear(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias,
                    const std::optional<Tensor>& out);
// Rows up to which linear/matmul use tallow's skinny kernel instead of cuBLASLt (default 16;
// KernelTuning::skinny_max_m, TALLOW_SKINNY_MAX_M at start; 0 turns the skinny kernel off).
int skinny_max_m();
void set_skinny_max_m(int m);
// norm.cu
Tensor rms_norm(const Tensor& x, const Tensor& w, float eps, bool gemma_offset = false,
                const std::optional<Tensor>& out = std::nullopt);
Tensor fused_add_rms_norm(const Tensor& x, const Tensor& residual, const Tensor& w, float eps,
                          bool gemma_offset = false);
Tensor layer_norm(const Tensor& x, const std::optional<Tensor>& w, const std::optional<Tensor>& b, float eps,
                  const std::optional<Tensor>& out = std::nullopt);
// paged_attention.cu
void reshape_and_cache(const Tensor& k, const Tensor& v, const Tensor& k_cache, const Tensor& v_cache,
                       const Tensor& slot_mapping, float k_scale = 1.0f, float v_scale = 1.0f);
Tensor paged_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& block_tables,
                       const Tensor& seq_lens, const Tensor& query_start_loc, float scale, int64_t sliding_window = 0,
                       float softcap = 0.0f, const std::optional<Tensor>& out = {}, float k_scale = 1.0f,
                       float v_scale = 1.0f, bool settled_cache = false);
// random.cu: t (contiguous float) = low + span * U[0,1) per element, key = ops::random_detail::seed_key(seed)
void fill_uniform_(Tensor& t, float low, float span, uint64_t key);
// rope.cu
void rotary_embedding(const Tensor& positions, Tensor& q, std::optional<Tensor> k, const Tensor& cos_sin_cache,
                      bool neox);
bool rope_and_cache(const Tensor& positions, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cos_sin_cache, bool neox, const Tensor& k_cache, const Tensor& v_cache, const Tensor& slot_mapping, const std::optional<Tensor>& q_norm_weight, const std::optional<Tensor>& k_norm_weight, float norm_eps, bool gemma_norm, float k_scale, float v_scale);  // rope_cache.cu (ops/rope_cache.h); false: the caller runs the composition
// sampling.cu (ops/sampling.h); set_sampling_buffer_capacity shrinks the candidate buffer (tests
// use it to reach the multi-pass paths; n <= 0 restores the default)
void apply_penalties(const Tensor& logits, const Tensor& token_ids, const Tensor& token_counts,
                     const Tensor& repetition_penalty, const Tensor& frequency_penalty,
                     const Tensor& presence_penalty);
void apply_token_bitmask_(const Tensor& logits, const Tensor& bitmask);
Tensor sample_tokens(const Tensor& logits, const Tensor& temperature, const Tensor& top_k, const Tensor& top_p,
                     const Tensor& min_p, const Tensor& seeds, const Tensor& offsets);
std::tuple<Tensor, Tensor, Tensor> logprobs(const Tensor& logits, const Tensor& token_ids, int64_t num_top);
void set_sampling_buffer_capacity(int n);
// softmax.cu
Tensor softmax(const Tensor& x, float scale = 1.0f, float softcap = 0.0f,
               const std::optional<Tensor>& out = std::nullopt);
// token_ids.cu
void fill_from_previous_(const Tensor& ids, const Tensor& previous);
// topk.cu
Tensor argmax(const Tensor& x);
std::pair<Tensor, Tensor> topk(const Tensor& x, int64_t k);

}  // namespace tallow::cuda
