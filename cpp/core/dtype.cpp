#include "core/dtype.h"

#include <algorithm>
#include <cctype>

#include "core/error.h"

namespace tallow {

namespace {
// Block sizes and byte sizes follow ggml's block_* structs.
const DTypeInfo kInfo[] = {
    {"float32", 1, 4, true, 0},  {"float16", 1, 2, true, 1}, {"bfloat16", 1, 2, true, 30},
    {"float8_e4m3", 1, 1, true, -1}, {"int8", 1, 1, false, 24}, {"uint8", 1, 1, false, -1},
    {"int32", 1, 4, false, 26}, {"int64", 1, 8, false, 27}, {"bool", 1, 1, false, -1},
    {"q4_0", 32, 18, false, 2},   {"q4_1", 32, 20, false, 3},  {"q5_0", 32, 22, false, 6},
    {"q5_1", 32, 24, false, 7},   {"q8_0", 32, 34, false, 8},  {"q8_1", 32, 36, false, 9},
    {"q2_k", 256, 84, false, 10}, {"q3_k", 256, 110, false, 11}, {"q4_k", 256, 144, false, 12},
    {"q5_k", 256, 176, false, 13}, {"q6_k", 256, 210, false, 14}, {"q8_k", 256, 292, false, 15},
    {"iq4_nl", 32, 18, false, 20}, {"iq4_xs", 256, 136, false, 23},
};
static_assert(sizeof(kInfo) / sizeof(kInfo[0]) == (size_t)DType::kCount, "dtype table out of date");
}  // namespace

const DTypeInfo& dtype_info(DType t) {
  const auto i = (size_t)t;
  if (i >= (size_t)DType::kCount) throw ValueError(str_cat("invalid dtype id ", i));
  return kInfo[i];
}

int64_t dtype_nbytes(DType t, int64_t n) {
  const auto& info = dtype_info(t);
  TALLOW_CHECK(n % info.block_size == 0, "dtype_nbytes: ", n, " elements is not a whole number of ", info.name,
               " blocks of ", info.block_size);
  return n / info.block_size * info.type_size;
}

DType dtype_from_name(const std::string& raw) {
  std::string s = raw;
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return (char)std::tolower(c); });
  struct Alias { const char* name; DType t; };
  static const Alias aliases[] = {
      {"f32", DType::F32}, {"float", DType::F32}, {"f16", DType::F16}, {"half", DType::F16},
      {"bf16", DType::BF16}, {"f8e4m3", DType::F8E4M3}, {"fp8", DType::F8E4M3}, {"float8_e4m3fn", DType::F8E4M3},
      {"i8", DType::I8}, {"u8", DType::U8}, {"i32", DType::I32}, {"i64", DType::I64}, {"long", DType::I64},
  };
  for (const auto& a : aliases)
    if (s == a.name) return a.t;
  for (size_t i = 0; i < (size_t)DType::kCount; ++i)
    if (s == kInfo[i].name) return (DType)i;
  throw ValueError(str_cat("unknown dtype '", raw, "'"));
}

DType dtype_from_ggml_type(int ggml_type) {
  for (size_t i = 0; i < (size_t)DType::kCount; ++i)
    if (kInfo[i].ggml_type == ggml_type) return (DType)i;
  throw TypeError(str_cat("GGUF tensor type ", ggml_type, " is not supported by tallow"));
}

}  // namespace tallow
