// Benchmark: ops::rms_norm over rows x 4096 (a Llama-style hidden size) in f32 and bf16, as memory
// bandwidth: GB/s = (bytes of x read + bytes of out written) / time (the 4096-element weight stays in
// cache and is not counted).
//   ctest --test-dir <build> -L bench -V      or run the binary; TALLOW_BENCH_QUICK=1 for a short run.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "core/tensor.h"
#include "ops/norm.h"

using namespace tallow;

static Tensor random_tensor(const Shape& shape, DType dt, std::mt19937& gen) {
  Tensor t = Tensor::empty(shape, DType::F32);
  std::normal_distribution<float> nd(0.f, 1.f);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = nd(gen);
  return dt == DType::F32 ? t : t.to(dt);
}

// Median seconds per call over repetitions lasting at least min_s in total (after one warm-up call).
template <class F>
static double time_it(F&& f, double min_s) {
  f();
  std::vector<double> ts;
  double total = 0;
  while (total < min_s || ts.size() < 5) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ts.push_back(dt);
    total += dt;
    if (ts.size() >= 20000) break;
  }
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

int main() {
  const bool quick = std::getenv("TALLOW_BENCH_QUICK") != nullptr;
  const double min_s = quick ? 0.05 : 0.25;
  const int64_t H = 4096;
  std::mt19937 gen(99);
  double load[1] = {0};
  if (getloadavg(load, 1) < 1) load[0] = -1;
  std::printf("rms_norm benchmark: hidden %lld, %d threads, load average %.2f (median of >= %.2f s per row)\n\n",
              (long long)H, get_num_threads(), load[0], min_s);
  std::printf("%-9s %6s %12s %9s\n", "dtype", "rows", "us/call", "GB/s");
  for (DType dt : {DType::F32, DType::BF16}) {
    const Tensor w = random_tensor({H}, dt, gen);
    for (int64_t rows : {int64_t(1), int64_t(16), int64_t(256), int64_t(2048)}) {
      const Tensor x = random_tensor({rows, H}, dt, gen);
      Tensor out = Tensor::empty({rows, H}, dt);
      try {
        const double s = time_it([&] { ops::rms_norm(x, w, 1e-6f, false, out); }, min_s);
        const double bytes = 2.0 * (double)x.nbytes();
        std::printf("%-9s %6lld %12.2f %9.1f\n", dtype_name(dt), (long long)rows, s * 1e6, bytes / s / 1e9);
      } catch (const NotImplementedError& e) {
        std::printf("%-9s %6lld  not implemented (%s)\n", dtype_name(dt), (long long)rows, e.what());
      }
    }
  }
  return 0;
}
