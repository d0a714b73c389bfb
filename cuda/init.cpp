// Backend registration: the caching allocator for DeviceType::CUDA and the cross-device copies.
#include <mutex>

#include "allocator.h"
#include "runtime.h"

namespace tallow::cuda {

void register_copies();  // copy.cpp

void init() {
  static std::once_flag once;
  std::call_once(once, [] {
    register_caching_allocator();
    register_copies();
  });
}

}  // namespace tallow::cuda
