// quantize (ops/quantize.h): argument checks, then the CPU kernel or the device's BackendOps::quantize.
// Compiled with -ffp-contract=off (CMakeLists.txt): quantize_block.h's float operations must round one by
// one, as they do in gguf-py, llama.cpp and the CUDA kernel.
#include "ops/quantize.h"

#include <algorithm>

#include "core/simd.h"
#include "ops/common.h"
#include "ops/quantize_block.h"
#include "ops/rows.h"

namespace tallow::ops {

namespace {

inline float widen(float v) { return v; }
inline float widen(f16_t v) { return f16_to_f32(v.bits); }
inline float widen(bf16_t v) { return bf16_to_f32(v.bits); }

constexpr int kMaxGroup = 4;  // >= quant_block::block_group(T) for every T

// `count` consecutive blocks (x: their floats back to back). Cloned per ISA (core/simd.h): the k-quants'
// lane loops vectorize on AVX2 / AVX-512; -ffp-contract=off keeps every clone free of FMAs, so all give
// the same bytes.
TALLOW_SIMD_CLONES void quantize_group(DType dtype, const float* x, uint8_t* y, int count) {
#define TALLOW_QUANTIZE_CASE(T)                                                                         \
  case DType::T: {                                                                                      \
    constexpr int bs = quant_block::block_elems(DType::T), ts = quant_block::block_bytes(DType::T);     \
    if (count == quant_block::block_group(DType::T)) {                                                  \
      quant_block::quantize_blocks_n<DType::T>(x, y);                                                   \
    } else {                                                                                            \
      for (int i = 0; i < count; ++i) quant_block::quantize_block<DType::T>(x + i * bs, y + i * ts);    \
    }                                                                                                   \
    break;                                                                                              \
  }
  switch (dtype) {
    TALLOW_FOR_EACH_QUANTIZE_DTYPE(TALLOW_QUANTIZE_CASE)
    default: break;
  }
#undef TALLOW_QUANTIZE_CASE
}

// Blocks [b0, b1) of the row-major block grid (rows x blocks_per_row) of x into `out` (contiguous), in
// groups of block_group(dtype) (a group may span rows: its blocks are independent).
template <class S>
void quantize_blocks(const Tensor& x, DType dtype, uint8_t* out, int64_t blocks_per_row, int64_t b0, int64_t b1) {
  const int bs = quant_block::block_elems(dtype), ts = quant_block::block_bytes(dtype);
  const int group = quant_block::block_group(dtype);
  float buf[kMaxGroup * quant_block::kQK];
  const S* base = static_cast<const S*>(x.storage()->data());
  for (int64_t b = b0; b < b1;) {
    const int count = (int)std::min<int64_t>(group, b1 - b);
    for (int g = 0; g < count; ++g) {
      const int64_t r = (b + g) / blocks_per_row, c = (b + g) % blocks_per_row;
      const S* src = base + row_offset(x, r) + c * bs;
      for (int j = 0; j < bs; ++j) buf[g * bs + j] = widen(src[j]);
    }
    quantize_group(dtype, buf, out + b * ts, count);
    b += count;
  }
}

}  // namespace

Tensor quantize(const Tensor& x, DType dtype) {
  check_defined("quantize", x, "x");
  TALLOW_CHECK_TYPE(x.dtype() == DType::F32 || x.dtype() == DType::F16 || x.dtype() == DType::BF16,
                    "quantize: x must be float32, float16 or bfloat16, got ", dtype_name(x.dtype()),
                    " tensor of shape ", shape_str(x.shape()));
  TALLOW_CHECK_TYPE(quant_block::has_quantizer(dtype), "quantize: no quantizer for dtype ", dtype_name(dtype),
                    " (x of shape ", shape_str(x.shape()),
                    "; supported: q4_0, q4_1, q5_0, q5_1, q8_0, q8_1, q2_k, q3_k, q4_k, q5_k, q6_k, q8_k, iq4_nl, iq4_xs)");
  const int64_t bs = dtype_block_size(dtype);
  TALLOW_CHECK(x.dim() >= 1 && x.size(-1) % bs == 0, "quantize: the last dimension of x (shape ",
               shape_str(x.shape()), ", ", dtype_name(x.dtype()), ") must be a multiple of ", dtype_name(dtype),
               "'s block size ", bs);
  if (!x.device().is_cpu()) return device_op(&BackendOps::quantize, "quantize", x)(x, dtype);

  const Tensor src = (x.size(-1) <= 1 || x.stride(-1) == 1) ? x : x.contiguous();
  Tensor o = Tensor::empty(src.shape(), dtype, src.device());
  const int64_t rows = num_rows(src), per_row = src.size(-1) / bs, blocks = rows * per_row;
  if (blocks == 0) return o;
  uint8_t* out = static_cast<uint8_t*>(o.data_ptr());
  // ~32 k-quant blocks (or 256 small ones) per task: tens of microseconds each, enough to balance the pool;
  // a task's last group may be short (the bytes never depend on the grouping).
  const int64_t grain = bs == quant_block::kQK ? 32 : 256;
  TALLOW_DISPATCH_FLOAT("quantize", src.dtype(), [&] {
    parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
      quantize_blocks<scalar_t>(src, dtype, out, per_row, b0, b1);
    });
  });
  return o;
}

}  // namespace tallow::ops
