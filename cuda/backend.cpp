// The CUDA backend's op table (core/backend.h): every entry point of ops_cuda.h, registered for
// DeviceType::CUDA by init() (init.cpp) with the allocator and the copies.
#include "core/backend.h"
#include "ops_cuda.h"

namespace tallow::cuda {

void register_ops() {
  BackendOps t;
  t.name = "cuda";
  t.silu_and_mul = &silu_and_mul;
  t.gelu_and_mul = &gelu_and_mul;
  t.attention = &attention;
  t.cast = &cast;
  t.dequantize = &dequantize;
  t.quantize = &quantize;
  t.add = &add;
  t.mul = &mul;
  t.scale = &scale;
  t.embedding = &embedding;
  t.matmul = &matmul;
  t.linear = &linear;
  t.quant_linear = &quant_linear;
  t.gated_linear = &gated_linear;
  t.rms_norm = &rms_norm;
  t.fused_add_rms_norm = &fused_add_rms_norm;
  t.layer_norm = &layer_norm;
  t.reshape_and_cache = &reshape_and_cache;
  t.paged_attention = &paged_attention;
  t.fill_uniform_ = &fill_uniform_;
  t.rotary_embedding = &rotary_embedding;
  t.rope_and_cache = &rope_and_cache;
  t.apply_penalties = &apply_penalties;
  t.apply_token_bitmask_ = &apply_token_bitmask_;
  t.sample_tokens = &sample_tokens;
  t.logprobs = &logprobs;
  t.softmax = &softmax;
  t.fill_from_previous_ = &fill_from_previous_;
  t.argmax = &argmax;
  t.topk = &topk;
  t.set_sampling_buffer_capacity = &set_sampling_buffer_capacity;
  register_backend(DeviceType::CUDA, t);
}

}  // namespace tallow::cuda
