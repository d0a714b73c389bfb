// Backend registration: the caching allocator for DeviceType::CUDA, the cross-device copies and the op
// table (core/backend.h). Nothing in cpp/ calls into cuda/ otherwise.
#include <mutex>

#include "allocator.h"
#include "runtime.h"

namespace tallow::cuda {

void register_copies();  // copy.cpp
void register_ops();     // backend.cpp

void init() {
  static std::once_flag once;
  std::call_once(once, [] {
    register_caching_allocator();
    register_copies();
    register_ops();
  });
}

}  // namespace tallow::cuda
