// A small persistent thread pool for CPU kernels. parallel_for splits [begin, end) into chunks of
// at least `grain` iterations; a call from inside a worker runs inline (no nested parallelism).
#pragma once
#include <cstdint>
#include <functional>

namespace tallow {

int get_num_threads();
void set_num_threads(int n);  // n <= 0 resets to all hardware threads (or TALLOW_NUM_THREADS)
void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

}  // namespace tallow
