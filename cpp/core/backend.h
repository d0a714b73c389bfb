// The op table per device type (in the manner of ggml-backend). cpp/ops/*.cpp hold the CPU kernels
// and every op's argument checks; for a tensor on another device they call that device type's entry
// from the table below. A backend (cuda/, later metal/) fills a BackendOps with its entry points and
// registers it once at start-up (cuda/backend.cpp: tallow::cuda::init(), called when tallow._core is
// imported and by C++ programs before they make CUDA tensors), the same way it registers its allocator
// (core/allocator.h) and copies (core/tensor.h). So cpp/ never includes a backend's headers.
//
// Contracts are those of cpp/ops/*.h. Each entry gets arguments already checked by the op (shapes,
// dtypes, one device); inputs may have any strides the CPU op accepts, outputs are contiguous; work may
// run asynchronously (on CUDA: the current stream of the tensors' device). An entry left null means
// the backend has no kernel for that op: the op raises ValueError naming the op, the device and the
// shapes (ops::device_op), or, for the fused ops that have a composition (gated_linear,
// rope_and_cache), runs the composition.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "core/device.h"
#include "core/tensor.h"

namespace tallow {

struct BackendOps {
  const char* name = "";  // "cuda", "metal"

  // activation
  Tensor (*silu_and_mul)(const Tensor& x, const std::optional<Tensor>& out) = nullptr;
  Tensor (*gelu_and_mul)(const Tensor& x, const std::string& approximate, const std::optional<Tensor>& out) = nullptr;
  // attention (non-paged)
  Tensor (*attention)(const Tensor& q, const Tensor& k, const Tensor& v, float scale, bool causal,
                      int64_t sliding_window, float softcap) = nullptr;
  // cast, dequantize
  Tensor (*cast)(const Tensor& x, DType dtype) = nullptr;
  Tensor (*dequantize)(const Tensor& q, DType dtype) = nullptr;
  // quantize: float x [..., K] -> GGUF block dtype (bit-identical to the CPU op, ops/quantize.h)
  Tensor (*quantize)(const Tensor& x, DType dtype) = nullptr;
  // elementwise
  Tensor (*add)(const Tensor& a, const Tensor& b, const std::optional<Tensor>& out) = nullptr;
  Tensor (*mul)(const Tensor& a, const Tensor& b, const std::optional<Tensor>& out) = nullptr;
  Tensor (*scale)(const Tensor& a, float s, const std::optional<Tensor>& out) = nullptr;
  // embedding
  Tensor (*embedding)(const Tensor& ids, const Tensor& table, std::optional<DType> out_dtype,
                      std::optional<int64_t> vocab_start) = nullptr;
  // products (out: a checked, contiguous output the op allocated or the caller passed)
  Tensor (*matmul)(const Tensor& a, const Tensor& b, const std::optional<Tensor>& out) = nullptr;
  Tensor (*linear)(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias,
                   const std::optional<Tensor>& out) = nullptr;
  // quant_linear: x @ w^T with w in a GGUF block dtype (ops/quant_linear.h)
  Tensor (*quant_linear)(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias,
                         const std::optional<Tensor>& out) = nullptr;
  Tensor (*gated_linear)(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias,
                         const std::string& activation, const std::optional<Tensor>& out) = nullptr;
  // norms
  Tensor (*rms_norm)(const Tensor& x, const Tensor& w, float eps, bool gemma_offset,
                     const std::optional<Tensor>& out) = nullptr;
  Tensor (*fused_add_rms_norm)(const Tensor& x, const Tensor& residual, const Tensor& w, float eps,
                               bool gemma_offset) = nullptr;
  Tensor (*layer_norm)(const Tensor& x, const std::optional<Tensor>& w, const std::optional<Tensor>& b, float eps,
                       const std::optional<Tensor>& out) = nullptr;
  // paged attention and the KV cache
  void (*reshape_and_cache)(const Tensor& k, const Tensor& v, const Tensor& k_cache, const Tensor& v_cache,
                            const Tensor& slot_mapping, float k_scale, float v_scale) = nullptr;
  Tensor (*paged_attention)(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& block_tables,
                            const Tensor& seq_lens, const Tensor& query_start_loc, float scale,
                            int64_t sliding_window, float softcap, const std::optional<Tensor>& out, float k_scale,
                            float v_scale, bool settled_cache) = nullptr;
  // random: t (contiguous float) = low + span * U[0,1) per element, key from ops::random_detail::seed_key
  void (*fill_uniform_)(Tensor& t, float low, float span, uint64_t key) = nullptr;
  // rotary embeddings; rope_and_cache returns false where the op should run its composition
  void (*rotary_embedding)(const Tensor& positions, Tensor& q, std::optional<Tensor> k, const Tensor& cos_sin_cache,
                           bool neox) = nullptr;
  bool (*rope_and_cache)(const Tensor& positions, const Tensor& q, const Tensor& k, const Tensor& v,
                         const Tensor& cos_sin_cache, bool neox, const Tensor& k_cache, const Tensor& v_cache,
                         const Tensor& slot_mapping, const std::optional<Tensor>& q_norm_weight,
                         const std::optional<Tensor>& k_norm_weight, float norm_eps, bool gemma_norm, float k_scale,
                         float v_scale) = nullptr;
  // sampling
  void (*apply_penalties)(const Tensor& logits, const Tensor& token_ids, const Tensor& token_counts,
                          const Tensor& repetition_penalty, const Tensor& frequency_penalty,
                          const Tensor& presence_penalty) = nullptr;
  void (*apply_token_bitmask_)(const Tensor& logits, const Tensor& bitmask) = nullptr;
  Tensor (*sample_tokens)(const Tensor& logits, const Tensor& temperature, const Tensor& top_k, const Tensor& top_p,
                          const Tensor& min_p, const Tensor& seeds, const Tensor& offsets) = nullptr;
  std::tuple<Tensor, Tensor, Tensor> (*logprobs)(const Tensor& logits, const Tensor& token_ids,
                                                 int64_t num_top) = nullptr;
  // softmax
  Tensor (*softmax)(const Tensor& x, float scale, float softcap, const std::optional<Tensor>& out) = nullptr;
  // token ids, top-k
  void (*fill_from_previous_)(const Tensor& ids, const Tensor& previous) = nullptr;
  Tensor (*argmax)(const Tensor& x) = nullptr;
  std::pair<Tensor, Tensor> (*topk)(const Tensor& x, int64_t k) = nullptr;

  // Testing hooks (not ops): the sampling kernels' candidate buffer (n <= 0: the default size).
  void (*set_sampling_buffer_capacity)(int n) = nullptr;
};

// Registers (or replaces) the table of a device type. Call once at start-up, before ops run there.
void register_backend(DeviceType type, const BackendOps& ops);
// The table registered for a device type, or nullptr when this build / process has none.
const BackendOps* find_backend(DeviceType type);
// The table for a device; ValueError naming the device when none is registered.
const BackendOps& backend_ops(const Device& device);

}  // namespace tallow
