// Element types, including GGUF's block-quantized types. A block type stores `block_size`
// logical elements in `type_size` bytes; its tensors are contiguous along the last dimension,
// which must be a multiple of the block size.
#pragma once
#include <cstdint>
#include <string>

namespace tallow {

enum class DType : uint8_t {
  F32, F16, BF16, F8E4M3, I8, U8, I32, I64, Bool,
  Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K, IQ4_NL, IQ4_XS,
  kCount
};

struct DTypeInfo {
  const char* name;
  int64_t block_size;  // logical elements per block (1 for scalar types)
  int64_t type_size;   // bytes per block
  bool is_float;       // scalar floating point (f32/f16/bf16/f8e4m3)
  int ggml_type;       // GGUF/ggml type id, -1 where GGUF has none
};

const DTypeInfo& dtype_info(DType t);
inline const char* dtype_name(DType t) { return dtype_info(t).name; }
inline bool is_block_dtype(DType t) { return dtype_info(t).block_size > 1; }
inline bool is_float_dtype(DType t) { return dtype_info(t).is_float; }
inline int64_t dtype_block_size(DType t) { return dtype_info(t).block_size; }
inline int64_t dtype_type_size(DType t) { return dtype_info(t).type_size; }
// Bytes taken by n logical elements (n must be a multiple of the block size for block types).
int64_t dtype_nbytes(DType t, int64_t n);
DType dtype_from_name(const std::string& name);   // "float32", "f32", "bf16", "q4_k", ... (ValueError if unknown)
DType dtype_from_ggml_type(int ggml_type);       // TypeError if tallow has no such type

// Elements and bytes of one block of a GGUF block type (ggml's block_* structs; the same numbers as
// dtype_info's table), as constants for kernels: template arguments, CUDA device code. 0 bytes for a
// scalar type.
constexpr int block_elems(DType t) {
  switch (t) {
    case DType::Q2_K: case DType::Q3_K: case DType::Q4_K: case DType::Q5_K: case DType::Q6_K: case DType::Q8_K:
    case DType::IQ4_XS: return 256;
    default: return 32;
  }
}
constexpr int block_bytes(DType t) {
  switch (t) {
    case DType::Q4_0: return 18;
    case DType::Q4_1: return 20;
    case DType::Q5_0: return 22;
    case DType::Q5_1: return 24;
    case DType::Q8_0: return 34;
    case DType::Q8_1: return 36;
    case DType::Q2_K: return 84;
    case DType::Q3_K: return 110;
    case DType::Q4_K: return 144;
    case DType::Q5_K: return 176;
    case DType::Q6_K: return 210;
    case DType::Q8_K: return 292;
    case DType::IQ4_NL: return 18;
    case DType::IQ4_XS: return 136;
    default: return 0;
  }
}

}  // namespace tallow
