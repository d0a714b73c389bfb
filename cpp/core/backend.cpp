// The op table per device type (backend.h).
#include "core/backend.h"

#include <array>
#include <atomic>
#include <mutex>

#include "core/error.h"

namespace tallow {

namespace {

constexpr size_t kDeviceTypes = 3;  // CPU, CUDA, Metal

struct Registry {
  std::array<BackendOps, kDeviceTypes> ops{};
  std::array<std::atomic<bool>, kDeviceTypes> registered{};
  std::mutex mu;
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

void register_backend(DeviceType type, const BackendOps& ops) {
  const size_t i = (size_t)type;
  TALLOW_CHECK(i < kDeviceTypes && type != DeviceType::CPU, "register_backend: the CPU kernels are the ops themselves");
  Registry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  r.ops[i] = ops;
  r.registered[i].store(true, std::memory_order_release);
}

const BackendOps* find_backend(DeviceType type) {
  const size_t i = (size_t)type;
  if (i >= kDeviceTypes) return nullptr;
  Registry& r = registry();
  return r.registered[i].load(std::memory_order_acquire) ? &r.ops[i] : nullptr;
}

const BackendOps& backend_ops(const Device& device) {
  const BackendOps* b = find_backend(device.type);
  TALLOW_CHECK(b, "no backend registered for device ", device.str(), " in this build");
  return *b;
}

}  // namespace tallow
