#include "core/parallel.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "core/tuning.h"

namespace tallow {

namespace {

thread_local bool t_in_worker = false;

// Decode runs ~120 small parallel regions per token, ~10-40 us apart: a worker sleeping on the condition
// variable between them costs a futex wake-up and a reschedule. Measured on the 2-core build machine
// (2 threads, quant_linear M = 1, K = 576 q4_1): N = 192 rows 23.9 -> 16.2 us, 960 rows 53.5 -> 38.1 us,
// 3072 rows 123 -> 107 us with the polls below; SmolLM2-135M decode 54.7 -> 62.2 tok/s. So a worker polls
// for the next region this long before sleeping, and the caller polls for the last chunks before sleeping
// on done_cv_. (A pool knob, not a kernel's: the polls are bounded, so an oversubscribed machine loses at
// most kSpin of CPU per region and thread.)
constexpr auto kSpin = std::chrono::microseconds(200);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

// Polls done() for up to kSpin; true when it became true.
template <class F>
bool spin_until(F done) {
  const auto end = std::chrono::steady_clock::now() + kSpin;
  for (int i = 1;; ++i) {
    if (done()) return true;
    cpu_relax();
    if (i % 64 == 0 && std::chrono::steady_clock::now() > end) return false;
  }
}

int default_threads() {
  if (const int64_t n = kernel_tuning().num_threads; n > 0) return (int)n;
  return std::max(1u, std::thread::hardware_concurrency());
}

class ThreadPool {
 public:
  explicit ThreadPool(int n) { resize(n); }
  ~ThreadPool() { stop(); }

  int size() const { return (int)workers_.size() + 1; }  // the caller works too

  void resize(int n) {
    std::lock_guard<std::mutex> run_lock(run_mutex_);
    stop();
    stopping_ = false;
    for (int i = 0; i + 1 < n; ++i) workers_.emplace_back([this] { worker_loop(); });
  }

  void run(int64_t nchunks, const std::function<void(int64_t)>& chunk_fn) {
    std::lock_guard<std::mutex> run_lock(run_mutex_);  // one parallel region at a time
    {
      std::lock_guard<std::mutex> lk(mutex_);
      job_ = &chunk_fn;
      nchunks_ = nchunks;
      next_.store(0);
      pending_ = nchunks;
      error_ = nullptr;
      ++generation_;
    }
    cv_.notify_all();
    work();
    spin_until([this] { return pending_.load() == 0 && active_.load() == 0; });
    std::unique_lock<std::mutex> lk(mutex_);
    // Wait for the chunks and for every worker to leave work(), so none holds a stale job.
    done_cv_.wait(lk, [this] { return pending_ == 0 && active_ == 0; });
    job_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void stop() {
    {
      std::lock_guard<std::mutex> lk(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
  }

  void work() {
    const bool was = t_in_worker;
    t_in_worker = true;
    int64_t done_here = 0;
    for (;;) {
      const int64_t c = next_.fetch_add(1);
      if (c >= nchunks_) break;
      try {
        (*job_)(c);
      } catch (...) {
        std::lock_guard<std::mutex> lk(mutex_);
        if (!error_) error_ = std::current_exception();
      }
      ++done_here;
    }
    t_in_worker = was;
    if (done_here) {
      std::lock_guard<std::mutex> lk(mutex_);
      pending_ -= done_here;
      if (pending_ == 0) done_cv_.notify_all();
    }
  }

  void worker_loop() {
    uint64_t seen = 0;
    for (;;) {
      spin_until([&] { return generation_.load() != seen || stopping_.load(); });
      {
        std::unique_lock<std::mutex> lk(mutex_);
        cv_.wait(lk, [&] { return stopping_ || (generation_ != seen && job_ != nullptr); });
        if (stopping_) return;
        seen = generation_;
        ++active_;
      }
      work();
      std::lock_guard<std::mutex> lk(mutex_);
      if (--active_ == 0 && pending_ == 0) done_cv_.notify_all();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex run_mutex_, mutex_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int64_t)>* job_ = nullptr;
  // Written under mutex_; atomic so that the spins above may read them without it.
  int64_t nchunks_ = 0;
  std::atomic<int64_t> pending_{0};
  std::atomic<int> active_{0};  // workers inside work()
  std::atomic<int64_t> next_{0};
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> stopping_{false};
  std::exception_ptr error_;
};

ThreadPool& pool() {
  static ThreadPool p(default_threads());
  return p;
}

}  // namespace

int get_num_threads() { return pool().size(); }

void set_num_threads(int n) { pool().resize(n > 0 ? n : default_threads()); }

void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int threads = t_in_worker ? 1 : get_num_threads();
  if (threads <= 1 || n <= grain) {
    fn(begin, end);
    return;
  }
  // A few chunks per thread balance uneven work without much scheduling overhead.
  const int64_t nchunks = std::min<int64_t>((n + grain - 1) / grain, (int64_t)threads * 4);
  const int64_t chunk = (n + nchunks - 1) / nchunks;
  const int64_t real_chunks = (n + chunk - 1) / chunk;
  pool().run(real_chunks, [&](int64_t c) {
    const int64_t b = begin + c * chunk;
    fn(b, std::min(end, b + chunk));
  });
}

}  // namespace tallow
