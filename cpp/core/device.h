// Where a tensor's bytes live.
#pragma once
#include <cstdint>
#include <string>

namespace tallow {

enum class DeviceType : uint8_t { CPU = 0, CUDA = 1, Metal = 2 };

struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
  bool is_cpu() const { return type == DeviceType::CPU; }
  std::string str() const;
};

Device parse_device(const std::string& s);  // "cpu", "cuda", "cuda:1"

}  // namespace tallow
