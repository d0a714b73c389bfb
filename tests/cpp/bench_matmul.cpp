// Benchmark: ops::linear (x [M, K] · w [N, K]^T, the layer shape of every LLM projection) and ops::matmul
// (a [M, K] @ b [K, N]) in GFLOP/s, for decode (M = 1, 8) and prefill (M = 128, 512) shapes, f32 and bf16.
// Decode rows also show the weight stream in GB/s (bytes of w read once per call / time). The last column
// divides the work by the process's CPU time instead of wall time (GFLOP per core-second): on a busy shared
// machine it still shows how fast the kernels run while they are scheduled (compare with the core's peak).
//   ctest --test-dir <build> -L bench -V      or run the binary; TALLOW_BENCH_QUICK=1 for a short run.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <random>
#include <vector>

#include "core/parallel.h"
#include "core/tensor.h"
#include "ops/gemm_kernel.h"
#include "ops/matmul.h"

using namespace tallow;

static Tensor random_tensor(const Shape& shape, DType dt, std::mt19937& gen) {
  Tensor t = Tensor::empty(shape, DType::F32);
  std::normal_distribution<float> nd(0.f, 1.f);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = nd(gen);
  return dt == DType::F32 ? t : t.to(dt);
}

struct Timing {
  double wall_s;  // median wall seconds per call
  double cpu_s;   // process CPU seconds per call (all threads), averaged over the same calls
};

static double cpu_now() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

// Median wall time per call over repetitions lasting at least min_s in total (after one warm-up call).
template <class F>
static Timing time_it(F&& f, double min_s) {
  f();
  std::vector<double> ts;
  double total = 0;
  const double c0 = cpu_now();
  while (total < min_s || ts.size() < 3) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ts.push_back(dt);
    total += dt;
    if (ts.size() >= 200) break;
  }
  const double cpu = (cpu_now() - c0) / ts.size();
  std::sort(ts.begin(), ts.end());
  return {ts[ts.size() / 2], cpu};
}

int main() {
  const bool quick = std::getenv("TALLOW_BENCH_QUICK") != nullptr;
  const double min_s = quick ? 0.05 : 0.3;
  std::mt19937 gen(1234);
  double load[1] = {0};
  if (getloadavg(load, 1) < 1) load[0] = -1;
  std::printf("matmul/linear benchmark: %d threads, kernels %s, load average %.2f (median of >= %.2f s per row)\n\n",
              get_num_threads(), ops::gemm::isa_name(), load[0], min_s);
  std::printf("%-7s %-8s %5s %6s %6s %10s %9s %9s %12s\n", "op", "dtype", "M", "K", "N", "ms/call", "GFLOP/s",
              "w GB/s", "GFLOP/cpu-s");
  const std::pair<int64_t, int64_t> kn[] = {{2048, 2048}, {2048, 8192}};
  const int64_t ms[] = {1, 8, 128, 512};
  for (DType dt : {DType::F32, DType::BF16}) {
    for (auto [K, N] : kn) {
      const Tensor w = random_tensor({N, K}, dt, gen);
      for (int64_t M : ms) {
        if (quick && M == 512) continue;
        const Tensor x = random_tensor({M, K}, dt, gen);
        Tensor out = Tensor::empty({M, N}, dt);
        const Timing tm = time_it([&] { ops::linear(x, w, std::nullopt, out); }, min_s);
        const double flop = 2.0 * M * N * K;
        std::printf("%-7s %-8s %5lld %6lld %6lld %10.3f %9.1f %9.1f %12.1f\n", "linear", dtype_name(dt), (long long)M,
                    (long long)K, (long long)N, tm.wall_s * 1e3, flop / tm.wall_s / 1e9,
                    (double)w.nbytes() / tm.wall_s / 1e9, flop / tm.cpu_s / 1e9);
      }
    }
  }
  std::printf("\n");
  for (DType dt : {DType::F32, DType::BF16}) {
    const int64_t K = 2048, N = 2048;
    const Tensor b = random_tensor({K, N}, dt, gen);
    for (int64_t M : {int64_t(1), int64_t(128), int64_t(512)}) {
      if (quick && M == 512) continue;
      const Tensor a = random_tensor({M, K}, dt, gen);
      Tensor out = Tensor::empty({M, N}, dt);
      const Timing tm = time_it([&] { ops::matmul(a, b, out); }, min_s);
      const double flop = 2.0 * M * N * K;
      std::printf("%-7s %-8s %5lld %6lld %6lld %10.3f %9.1f %9s %12.1f\n", "matmul", dtype_name(dt), (long long)M,
                  (long long)K, (long long)N, tm.wall_s * 1e3, flop / tm.wall_s / 1e9, "", flop / tm.cpu_s / 1e9);
    }
  }
  return 0;
}
