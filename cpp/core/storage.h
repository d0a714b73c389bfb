// A refcounted span of bytes on one device: either owned (freed through its allocator) or
// borrowed from outside (a numpy array, a DLPack producer, an mmap), released by a callback.
#pragma once
#include <cstddef>
#include <functional>
#include <memory>

#include "core/device.h"

namespace tallow {

class Storage {
 public:
  // Owned storage from the device's allocator.
  Storage(size_t nbytes, Device device);
  // Borrowed storage; `release` runs when the last tensor using it goes away.
  Storage(void* data, size_t nbytes, Device device, std::function<void()> release);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }
  bool is_borrowed() const { return (bool)release_; }

 private:
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  Device device_;
  std::function<void()> release_;
};

using StoragePtr = std::shared_ptr<Storage>;

}  // namespace tallow
