#include "core/storage.h"

#include "core/allocator.h"

namespace tallow {

Storage::Storage(size_t nbytes, Device device) : nbytes_(nbytes), device_(device) {
  data_ = get_allocator(device.type)->allocate(nbytes, device);
}

Storage::Storage(void* data, size_t nbytes, Device device, std::function<void()> release)
    : data_(data), nbytes_(nbytes), device_(device), release_(release ? std::move(release) : std::function<void()>([] {})) {}

Storage::~Storage() {
  if (release_) {
    release_();
  } else if (data_) {
    get_allocator(device_.type)->deallocate(data_, nbytes_, device_);
  }
}

}  // namespace tallow
