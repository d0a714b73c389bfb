// Family status: CPU implementation complete and tested (tests/python/backend_ops/cases_embedding.py).
// Embedding lookup: out[..., :] = table[ids[...], :].
//
// Float tables (f32/f16/bf16) are copied row by row, converted through f32 when the output dtype
// differs (exact when widening; one rounding when narrowing). GGUF block tables are dequantized
// a row at a time with dequantize_row_f32 (bit-exact with ggml), then rounded to the output dtype
// if it is not f32. Every id is checked before any row is written; negative ids are out of range
// (no Python-style wrap-around). Rows are gathered in parallel.
#include "ops/embedding.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "core/simd.h"
#include "ops/common.h"
#include "ops/dequant_row.h"
#include "ops/rows.h"

namespace tallow::ops {

namespace {

template <class S, class D>
TALLOW_SIMD_CLONES void convert_row(const S* TALLOW_RESTRICT s, int64_t ss, D* TALLOW_RESTRICT d, int64_t n) {
  if (ss == 1) {
    TALLOW_PRAGMA_SIMD
    for (int64_t i = 0; i < n; ++i) d[i] = from_f32<D>(to_f32(s[i]));
  } else {
    for (int64_t i = 0; i < n; ++i) d[i] = from_f32<D>(to_f32(s[i * ss]));
  }
}

// Calls f(tag) with a value of the storage type of float dtype dt.
template <class F>
void dispatch_float(const char* op, DType dt, F&& f) {
  switch (dt) {
    case DType::F32: return f(float{});
    case DType::F16: return f(f16_t{});
    case DType::BF16: return f(bf16_t{});
    default: throw TypeError(str_cat(op, ": unsupported dtype ", dtype_name(dt)));
  }
}

template <class I>
void check_ids(const I* ids, int64_t n, int64_t V) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = (int64_t)ids[i];
    TALLOW_CHECK_INDEX(id >= 0 && id < V, "embedding: id ", id, " (at flat position ", i,
                       ") is out of range for a table of V = ", V, " rows");
  }
}

}  // namespace

Tensor embedding(const Tensor& ids_in, const Tensor& table, std::optional<DType> out_dtype,
                 std::optional<int64_t> vocab_start) {
  const char* op = "embedding";
  check_defined(op, ids_in, "ids");
  check_defined(op, table, "table");
  check_dtype(op, ids_in, "ids", {DType::I32, DType::I64});
  const DType tdt = table.dtype();
  const bool block = is_block_dtype(tdt);
  TALLOW_CHECK_TYPE(block || tdt == DType::F32 || tdt == DType::F16 || tdt == DType::BF16, op,
                    ": table must be float32, float16, bfloat16 or a GGUF block dtype, got ", dtype_name(tdt),
                    " tensor of shape ", shape_str(table.shape()));
  check_dim(op, table, "table", 2);
  check_same_device(op, ids_in, table);
  const DType odt = out_dtype ? *out_dtype : (block ? DType::F32 : tdt);
  TALLOW_CHECK_TYPE(odt == DType::F32 || odt == DType::F16 || odt == DType::BF16, op,
                    ": output dtype must be float32, float16 or bfloat16, got ", dtype_name(odt));
  if (block) check_contiguous(op, table, "table (block dtype)");
  if (!ids_in.device().is_cpu())
    return device_op(&BackendOps::embedding, op, ids_in, {&ids_in, &table})(ids_in, table, out_dtype, vocab_start);

  const int64_t V = table.size(0), D = table.size(1);
  const Tensor ids = ids_in.contiguous();
  const int64_t n = ids.numel();
  if (!vocab_start) {
    if (ids.dtype() == DType::I32) check_ids(ids.data<int32_t>(), n, V);
    else check_ids(ids.data<int64_t>(), n, V);
  }
  const int64_t start = vocab_start.value_or(0);

  Shape oshape = ids.shape();
  oshape.push_back(D);
  Tensor out = Tensor::empty(oshape, odt, table.device());
  if (out.numel() == 0) return out;

  // the table row of flat position i, or -1 outside this slice (vocab_start mode: a zero row)
  auto id_at = [&](int64_t i) -> int64_t {
    const int64_t row = (ids.dtype() == DType::I32 ? (int64_t)ids.data<int32_t>()[i] : ids.data<int64_t>()[i]) - start;
    return row >= 0 && row < V ? row : -1;
  };

  if (block) {
    const char* tbase = static_cast<const char*>(table.data_ptr());
    const int64_t row_bytes = dtype_nbytes(tdt, D);
    dispatch_float(op, odt, [&](auto otag) {
      using O = decltype(otag);
      O* o = out.data<O>();
      parallel_rows(n, 4 * D, [&](int64_t r0, int64_t r1) {
        std::vector<float> tmp(std::is_same_v<O, float> ? 0 : (size_t)D);
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t row = id_at(r);
          if (row < 0) {
            std::fill(o + r * D, o + (r + 1) * D, from_f32<O>(0.f));
            continue;
          }
          const void* src = tbase + row * row_bytes;
          if constexpr (std::is_same_v<O, float>) {
            dequantize_row_f32(tdt, src, o + r * D, D);
          } else {
            dequantize_row_f32(tdt, src, tmp.data(), D);
            convert_row<float, O>(tmp.data(), 1, o + r * D, D);
          }
        }
      });
    });
    return out;
  }

  const int64_t s0 = table.stride(0), s1 = table.stride(1);
  dispatch_float(op, tdt, [&](auto ttag) {
    using S = decltype(ttag);
    dispatch_float(op, odt, [&](auto otag) {
      using O = decltype(otag);
      const S* t = static_cast<const S*>(table.storage()->data()) + table.offset();
      O* o = out.data<O>();
      parallel_rows(n, D, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t row = id_at(r);
          if (row < 0) {
            std::fill(o + r * D, o + (r + 1) * D, from_f32<O>(0.f));
            continue;
          }
          const S* src = t + row * s0;
          if constexpr (std::is_same_v<S, O>) {
            if (s1 == 1) {
              std::memcpy(o + r * D, src, (size_t)D * sizeof(S));
              continue;
            }
          }
          convert_row<S, O>(src, s1, o + r * D, D);
        }
      });
    });
  });
  return out;
}

}  // namespace tallow::ops
