// matmul / linear against a naive double-precision reference on random inputs, for every kernel set
// this CPU runs (AVX-512, AVX2+FMA, portable), f32/f16/bf16, on shapes that reach each code path
// (GEMV dot and axpy, packed GEMM in both orientations, per-batch and tall batched GEMMs, strided
// views, bias); thread-count independence; and the errors bad input raises.
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "check.h"
#include "core/backend.h"
#include "core/error.h"
#include "core/parallel.h"
#include "core/tensor.h"
#include "ops/gemm_kernel.h"
#include "ops/matmul.h"

using namespace tallow;

static std::mt19937 gen(20240611);

static Tensor rnd(const Shape& shape, DType dt) {
  Tensor t = Tensor::empty(shape, DType::F32);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = nd(gen);
  return dt == DType::F32 ? t : t.to(dt);
}

// Values of t (any dtype, any strides) as doubles in row-major order.
static std::vector<double> values(const Tensor& t) {
  const Tensor c = t.to(DType::F32).contiguous();
  std::vector<double> v((size_t)c.numel());
  for (int64_t i = 0; i < c.numel(); ++i) v[i] = c.data<float>()[i];
  return v;
}

// Relative L2 error bound by output dtype: f32 sums of <= ~1000 products (~u*sqrt(K/6) ~ 1e-6 on random
// data), and one output rounding for f16 (2^-11) and bf16 (2^-8); see tests/python/backend_ops/cases_matmul.py.
static double tol(DType dt) { return dt == DType::F32 ? 1e-5 : dt == DType::F16 ? 1e-3 : 8e-3; }

static double rel_err(const std::vector<double>& out, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (std::isnan(out[i])) return INFINITY;
    num += (out[i] - ref[i]) * (out[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / (den > 0 ? den : 1));
}

// a [..., M, K] @ b [..., K, N] with numpy broadcasting, in double.
static std::vector<double> ref_matmul(const Tensor& a, const Tensor& b, Shape* out_shape) {
  const Shape ab(a.shape().begin(), a.shape().end() - 2), bb(b.shape().begin(), b.shape().end() - 2);
  const size_t nb = std::max(ab.size(), bb.size());
  Shape batch(nb);
  for (size_t i = 0; i < nb; ++i) {
    const int64_t da = i + ab.size() >= nb ? ab[i + ab.size() - nb] : 1;
    const int64_t db = i + bb.size() >= nb ? bb[i + bb.size() - nb] : 1;
    batch[i] = da == 1 ? db : da;
  }
  const int64_t M = a.size(-2), K = a.size(-1), N = b.size(-1);
  Shape sa = batch, sb = batch;
  sa.insert(sa.end(), {M, K});
  sb.insert(sb.end(), {K, N});
  const std::vector<double> va = values(a.expand(sa)), vb = values(b.expand(sb));
  const int64_t nbatch = shape_numel(batch);
  std::vector<double> out((size_t)(nbatch * M * N), 0.0);
  for (int64_t z = 0; z < nbatch; ++z)
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k) s += va[(z * M + i) * K + k] * vb[(z * K + k) * N + j];
        out[(z * M + i) * N + j] = s;
      }
  *out_shape = batch;
  out_shape->insert(out_shape->end(), {M, N});
  return out;
}

static std::vector<double> ref_linear(const Tensor& x, const Tensor& w, const Tensor* bias) {
  const int64_t K = w.size(1), N = w.size(0), M = x.numel() / K;
  const std::vector<double> vx = values(x), vw = values(w);
  std::vector<double> vb = bias ? values(*bias) : std::vector<double>((size_t)N, 0.0);
  std::vector<double> out((size_t)(M * N));
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = vb[j];
      for (int64_t k = 0; k < K; ++k) s += vx[i * K + k] * vw[j * K + k];
      out[i * N + j] = s;
    }
  return out;
}

static int checked = 0;

static void expect_close(const char* what, const std::string& isa, DType dt, const Tensor& out,
                         const std::vector<double>& ref, const Shape& ref_shape) {
  ++checked;
  CHECK(out.shape() == ref_shape);
  if (out.shape() != ref_shape) return;
  const double e = rel_err(values(out), ref);
  if (!(e <= tol(dt)))
    std::fprintf(stderr, "  %s [%s, %s]: rel err %.3g > %.3g\n", what, isa.c_str(), dtype_name(dt), e, tol(dt));
  CHECK(e <= tol(dt));
}

static void check_matmul(const char* what, const std::string& isa, DType dt, const Tensor& a, const Tensor& b) {
  Shape rs;
  const std::vector<double> ref = ref_matmul(a, b, &rs);
  expect_close(what, isa, dt, ops::matmul(a, b), ref, rs);
  // Into a caller's buffer pre-filled with NaN: every element must be written.
  Tensor out = Tensor::empty(rs, DType::F32);
  for (int64_t i = 0; i < out.numel(); ++i) out.data<float>()[i] = NAN;
  out = out.to(dt);
  ops::matmul(a, b, out);
  expect_close(what, isa, dt, out, ref, rs);
}

static void check_linear(const char* what, const std::string& isa, DType dt, const Tensor& x, const Tensor& w,
                         bool with_bias) {
  const Tensor bias = rnd({w.size(0)}, dt);
  const std::vector<double> ref = ref_linear(x, w, with_bias ? &bias : nullptr);
  Shape rs(x.shape().begin(), x.shape().end() - 1);
  rs.push_back(w.size(0));
  expect_close(what, isa, dt, ops::linear(x, w, with_bias ? std::optional<Tensor>(bias) : std::nullopt), ref, rs);
}

static void run_cases(const std::string& isa) {
  for (DType dt : {DType::F32, DType::F16, DType::BF16}) {
    // 2-D matmul: GEMV paths (few rows or columns), packed GEMM (both orientations), odd sizes.
    const int64_t mkn[][3] = {{1, 64, 33},    {3, 70, 40},     {16, 128, 100}, {17, 61, 29}, {37, 61, 29},
                              {128, 300, 257}, {200, 513, 70}, {5, 33, 3},     {40, 64, 1},  {1, 1, 1},
                              {13, 1, 17},    {64, 1000, 48}};
    for (auto& s : mkn) check_matmul("matmul", isa, dt, rnd({s[0], s[1]}, dt), rnd({s[1], s[2]}, dt));
    // Long K: B packed in several column blocks (at most ~16 MiB of packed B at a time).
    check_matmul("matmul long K", isa, dt, rnd({17, 4200}, dt), rnd({4200, 1000}, dt));
    // Transposed and strided operands.
    check_matmul("matmul a^T b^T", isa, dt, rnd({61, 37}, dt).transpose(0, 1), rnd({29, 61}, dt).transpose(0, 1));
    check_matmul("matmul a^T", isa, dt, rnd({150, 140}, dt).transpose(0, 1), rnd({150, 90}, dt));
    check_matmul("matmul b^T small M", isa, dt, rnd({4, 96}, dt), rnd({50, 96}, dt).transpose(0, 1));
    check_matmul("matmul strided", isa, dt, rnd({30, 80}, dt).slice(1, 0, 80, 2), rnd({40, 90}, dt).slice(1, 1, 90, 2));
    // Batched: per-batch GEMMs with broadcast, b shared (one tall GEMM), many small GEMMs, GEMV batches.
    check_matmul("matmul broadcast", isa, dt, rnd({2, 3, 17, 40}, dt), rnd({3, 40, 23}, dt));
    check_matmul("matmul shared b", isa, dt, rnd({4, 33, 50}, dt), rnd({50, 70}, dt));
    check_matmul("matmul shared a", isa, dt, rnd({33, 50}, dt), rnd({4, 50, 70}, dt));
    check_matmul("matmul many", isa, dt, rnd({16, 20, 24}, dt), rnd({16, 24, 36}, dt));
    check_matmul("matmul batched M=1", isa, dt, rnd({8, 1, 64}, dt), rnd({8, 64, 40}, dt));
    check_matmul("matmul batched transposed", isa, dt, rnd({3, 48, 20}, dt).transpose(1, 2),
                 rnd({3, 31, 48}, dt).transpose(1, 2));
    // linear: decode, prefill (M < N and M > N), 3-D x, strided x, transposed weight, bias or none.
    const int64_t lin[][3] = {{1, 512, 300}, {8, 200, 96}, {70, 256, 200}, {300, 128, 50},
                              {33, 64, 1},   {4, 1000, 37}, {16, 96, 16}, {17, 130, 33}};
    for (auto& s : lin) {
      check_linear("linear", isa, dt, rnd({s[0], s[1]}, dt), rnd({s[2], s[1]}, dt), true);
      check_linear("linear no bias", isa, dt, rnd({s[0], s[1]}, dt), rnd({s[2], s[1]}, dt), false);
    }
    check_linear("linear 3-D", isa, dt, rnd({3, 7, 130}, dt), rnd({65, 130}, dt), true);
    check_linear("linear strided x", isa, dt, rnd({20, 258}, dt).slice(1, 0, 258, 2), rnd({70, 129}, dt), true);
    check_linear("linear x^T", isa, dt, rnd({90, 45}, dt).transpose(0, 1), rnd({60, 90}, dt), true);
    check_linear("linear w^T", isa, dt, rnd({50, 96}, dt), rnd({96, 120}, dt).transpose(0, 1), true);
    check_linear("linear w^T M=2", isa, dt, rnd({2, 96}, dt), rnd({96, 120}, dt).transpose(0, 1), false);
  }
}

static void test_threads() {
  const int before = get_num_threads();
  for (DType dt : {DType::F32, DType::BF16}) {
    const Tensor x = rnd({77, 300}, dt), w = rnd({200, 300}, dt), x1 = rnd({3, 700}, dt), w1 = rnd({500, 700}, dt);
    std::vector<std::vector<double>> r;
    for (int th : {1, 2, 3, 5}) {
      set_num_threads(th);
      std::vector<double> v = values(ops::linear(x, w));
      const std::vector<double> v1 = values(ops::linear(x1, w1));
      v.insert(v.end(), v1.begin(), v1.end());
      r.push_back(v);
    }
    for (size_t i = 1; i < r.size(); ++i) CHECK(rel_err(r[i], r[0]) <= 1e-6);
  }
  set_num_threads(before);
}

static void test_errors() {
  const Tensor a = rnd({3, 4}, DType::F32), b = rnd({5, 6}, DType::F32);
  CHECK_THROWS(ops::matmul(a, b), ValueError);                                   // K mismatch
  CHECK_THROWS(ops::matmul(a, rnd({4, 2}, DType::BF16)), TypeError);             // dtype mismatch
  CHECK_THROWS(ops::matmul(rnd({4}, DType::F32), rnd({4, 2}, DType::F32)), ValueError);  // 1-D
  CHECK_THROWS(ops::matmul(rnd({2, 3, 4}, DType::F32), rnd({3, 4, 2}, DType::F32)), ValueError);  // batch
  CHECK_THROWS(ops::linear(a, rnd({5, 6}, DType::F32)), ValueError);            // K mismatch
  CHECK_THROWS(ops::linear(a, rnd({5, 4}, DType::F32), rnd({4}, DType::F32)), ValueError);  // bias shape
  CHECK_THROWS(ops::linear(a, rnd({5, 4}, DType::F16)), TypeError);
  // Quantized weights: TypeError that says so.
  Tensor raw = Tensor::empty({8, 34}, DType::U8);
  for (int64_t i = 0; i < raw.numel(); ++i) raw.data<uint8_t>()[i] = (uint8_t)i;
  const Tensor q = raw.view_as_dtype(DType::Q8_0, {8, 32});
  try {
    ops::linear(rnd({2, 32}, DType::F32), q);
    CHECK(false);
  } catch (const TypeError& e) {
    CHECK(std::string(e.what()).find("quantized GEMMs are not supported yet") != std::string::npos);
    CHECK(std::string(e.what()).rfind("linear: ", 0) == 0);
  }
  // A tensor on a device with no matmul kernel (Metal: none yet): ValueError naming the op, before any
  // memory is touched.
  float buf[4] = {1, 2, 3, 4};
  const Tensor dev = Tensor::from_blob(buf, {2, 2}, {2, 1}, DType::F32, Device{DeviceType::Metal, 0}, [] {});
  try {
    ops::matmul(dev, dev);
    CHECK(false);
  } catch (const ValueError& e) {
    // The op, the device, why (no backend registered an op table for Metal) and the shapes.
    const std::string msg = e.what();
    CHECK(msg.rfind("matmul: no kernel for device metal:0", 0) == 0);
    CHECK(msg.find(find_backend(DeviceType::Metal) ? "registered no matmul" : "no backend registered") !=
          std::string::npos);
    CHECK(msg.find("shapes [2, 2], [2, 2]") != std::string::npos);
  }
  // A backend that registered a table without this op: the message names the backend and the op.
  {
    BackendOps partial;
    partial.name = "metal";
    register_backend(DeviceType::Metal, partial);
    try {
      ops::matmul(dev, dev);
      CHECK(false);
    } catch (const ValueError& e) {
      CHECK(std::string(e.what()).find("the metal backend registered no matmul kernel") != std::string::npos);
    }
  }
  CHECK_THROWS(ops::linear(dev, dev), ValueError);
  // Messages name the op and the shapes.
  try {
    ops::matmul(a, b);
  } catch (const ValueError& e) {
    CHECK(std::string(e.what()) == "matmul: a [3, 4] and b [5, 6]: inner dimensions differ (a.shape[-1] = 4, "
                                   "b.shape[-2] = 5)");
  }
}

int main() {
  const std::string initial = ops::gemm::isa_name();
  for (const char* isa : {"avx512", "avx2", "portable"}) {
    if (!ops::gemm::set_isa(isa)) {
      std::printf("test_matmul: kernel set %s not available on this CPU/build, skipped\n", isa);
      continue;
    }
    const int before = checked;
    run_cases(isa);
    std::printf("test_matmul: %s kernels: %d comparisons\n", isa, checked - before);
  }
  ops::gemm::set_isa(initial.c_str());
  test_threads();
  test_errors();
  return check_report("test_matmul");
}
