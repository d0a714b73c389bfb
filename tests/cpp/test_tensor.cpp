// Core unit tests: f16/bf16/f8 conversions, dtype table, tensor views and copies, thread pool.
#include <atomic>
#include <cmath>
#include <cstring>
#include <random>

#include "check.h"
#include "core/error.h"
#include "core/parallel.h"
#include "core/tensor.h"

using namespace tallow;

static void test_half_conversions() {
  // Every finite f16 survives f16 -> f32 -> f16.
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = f16_to_f32((uint16_t)b);
    if (std::isnan(f)) continue;
    CHECK(f32_to_f16(f) == (uint16_t)b);
  }
  CHECK(f16_to_f32(0x3c00) == 1.0f);
  CHECK(f16_to_f32(0x0001) == std::ldexp(1.0f, -24));
  CHECK(f32_to_f16(65520.0f) == 0x7c00);           // rounds to infinity
  CHECK(f32_to_f16(std::ldexp(1.0f, -25)) == 0);   // halfway to the smallest subnormal: even (0)
  CHECK(f32_to_bf16(1.0f + std::ldexp(1.0f, -8)) == 0x3f80);  // tie to even
  CHECK(f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)) == 0x3f82);
  CHECK(std::isnan(bf16_to_f32(f32_to_bf16(std::nanf("")))));
  for (uint32_t b = 0; b < 256; ++b) {
    const float f = f8e4m3_to_f32((uint8_t)b);
    if (std::isnan(f)) continue;
    CHECK(f32_to_f8e4m3(f) == (uint8_t)b || (f == 0.0f && (b & 0x7f) == 0));
  }
  CHECK(f8e4m3_to_f32(f32_to_f8e4m3(1e6f)) == 448.0f);  // saturates
}

static void test_dtypes() {
  CHECK(dtype_block_size(DType::Q4_K) == 256 && dtype_type_size(DType::Q4_K) == 144);
  CHECK(dtype_nbytes(DType::Q8_0, 64) == 68);
  CHECK_THROWS(dtype_nbytes(DType::Q8_0, 33), ValueError);
  CHECK(dtype_from_name("BF16") == DType::BF16);
  CHECK_THROWS(dtype_from_name("nope"), ValueError);
  CHECK(dtype_from_ggml_type(12) == DType::Q4_K);
  CHECK_THROWS(dtype_from_ggml_type(99), TypeError);
}

static void test_views() {
  Tensor t = Tensor::empty({2, 3, 4}, DType::F32);
  float* p = t.data<float>();
  for (int i = 0; i < 24; ++i) p[i] = (float)i;
  Tensor tr = t.transpose(0, 2);  // [4, 3, 2]
  CHECK(!tr.is_contiguous());
  Tensor c = tr.contiguous();
  CHECK(c.is_contiguous() && c.shape() == Shape({4, 3, 2}));
  // c[k][j][i] == t[i][j][k]
  CHECK(c.data<float>()[(3 * 3 + 1) * 2 + 1] == p[(1 * 3 + 1) * 4 + 3]);
  Tensor n = t.narrow(2, 1, 2);
  CHECK(n.shape() == Shape({2, 3, 2}) && n.data<float>()[0] == 1.0f);
  Tensor s = t.select(1, 2);
  CHECK(s.shape() == Shape({2, 4}) && s.data<float>()[0] == 8.0f);
  CHECK(t.view({6, -1}).shape() == Shape({6, 4}));
  CHECK_THROWS(tr.view({24}), ValueError);
  CHECK(tr.reshape({24}).data<float>()[1] == 12.0f);
  CHECK_THROWS(t.narrow(0, 1, 5), IndexError);
  Tensor e = t.narrow(1, 0, 1).expand({2, 5, 4});
  CHECK(e.stride(1) == 0);
  CHECK(e.contiguous().data<float>()[4 * 4 + 2] == 2.0f);
  // Storage is shared and refcounted.
  Tensor view;
  {
    Tensor owner = Tensor::empty({8}, DType::I32);
    view = owner.narrow(0, 4, 4);
  }
  view.data<int32_t>()[0] = 5;
  CHECK(view.storage().use_count() == 1);
  // Block dtypes: the last dim is whole blocks, narrow along it must not split a block.
  Tensor q = Tensor::empty({3, 64}, DType::Q4_0);
  CHECK(q.nbytes() == 3 * 2 * 18);
  CHECK(q.select(0, 1).data_ptr() == (char*)q.data_ptr() + 36);
  CHECK_THROWS(q.narrow(1, 16, 32), ValueError);
  CHECK_THROWS(Tensor::empty({3, 40}, DType::Q4_0), ValueError);
  CHECK(q.narrow(1, 32, 32).contiguous().nbytes() == 3 * 18);
}

static void test_parallel_for() {
  for (int threads : {1, 2, 3}) {
    set_num_threads(threads);
    std::atomic<int64_t> sum{0};
    parallel_for(0, 100000, 100, [&](int64_t b, int64_t e) {
      int64_t local = 0;
      for (int64_t i = b; i < e; ++i) local += i;
      sum += local;
    });
    CHECK(sum.load() == 100000LL * 99999 / 2);
    // Nested calls run inline; exceptions propagate to the caller.
    std::atomic<int> inner{0};
    parallel_for(0, 8, 1, [&](int64_t b, int64_t e) {
      parallel_for(0, 4, 1, [&](int64_t b2, int64_t e2) { inner += (int)(e2 - b2) * (int)(e - b); });
    });
    CHECK(inner.load() == 32);
    CHECK_THROWS(parallel_for(0, 1000, 1, [](int64_t, int64_t e) { if (e > 500) throw ValueError("x"); }),
                 ValueError);
  }
  set_num_threads(0);
  CHECK(get_num_threads() >= 1);
}

int main() {
  test_half_conversions();
  test_dtypes();
  test_views();
  test_parallel_for();
  return check_report("test_tensor");
}
