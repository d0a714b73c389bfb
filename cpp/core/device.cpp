#include "core/device.h"

#include "core/error.h"

namespace tallow {

std::string Device::str() const {
  switch (type) {
    case DeviceType::CPU: return "cpu";
    case DeviceType::CUDA: return "cuda:" + std::to_string(index);
    case DeviceType::Metal: return "metal:" + std::to_string(index);
  }
  return "?";
}

Device parse_device(const std::string& s) {
  const auto colon = s.find(':');
  const std::string kind = s.substr(0, colon);
  int index = 0;
  if (colon != std::string::npos) {
    try {
      size_t used = 0;
      index = std::stoi(s.substr(colon + 1), &used);
      TALLOW_CHECK(used == s.size() - colon - 1 && index >= 0, "invalid device '", s, "'");
    } catch (const std::logic_error&) {
      throw ValueError(str_cat("invalid device '", s, "'"));
    }
  }
  if (kind == "cpu") return {DeviceType::CPU, 0};
  if (kind == "cuda") return {DeviceType::CUDA, index};
  if (kind == "metal" || kind == "mps") return {DeviceType::Metal, index};
  throw ValueError(str_cat("invalid device '", s, "' (expected cpu, cuda[:N] or metal)"));
}

}  // namespace tallow
