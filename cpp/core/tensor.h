// Tensor: a view (shape, strides, offset in elements) of refcounted Storage, with a dtype and a device.
// Views share storage; contiguous() and clone() copy. For block dtypes (GGUF quants) strides and
// offsets still count logical elements; the last dimension must be contiguous and whole blocks.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"
#include "core/half.h"
#include "core/storage.h"

namespace tallow {

using Shape = std::vector<int64_t>;

std::string shape_str(const Shape& s);  // "[2, 3]"
int64_t shape_numel(const Shape& s);
Shape contiguous_strides(const Shape& s);

class Tensor {
 public:
  Tensor() = default;  // an undefined tensor (defined() == false)
  Tensor(StoragePtr storage, Shape shape, Shape strides, int64_t offset, DType dtype);

  static Tensor empty(const Shape& shape, DType dtype, Device device = {});
  // Zero-copy view of external memory; `release` runs when the last view is gone.
  static Tensor from_blob(void* data, const Shape& shape, const Shape& strides, DType dtype, Device device,
                          std::function<void()> release, size_t nbytes = 0);

  bool defined() const { return (bool)storage_; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int64_t offset() const { return offset_; }
  DType dtype() const { return dtype_; }
  Device device() const { return storage_ ? storage_->device() : Device{}; }
  int64_t dim() const { return (int64_t)shape_.size(); }
  int64_t size(int64_t d) const { return shape_[wrap_dim(d)]; }
  int64_t stride(int64_t d) const { return strides_[wrap_dim(d)]; }
  int64_t numel() const { return shape_numel(shape_); }
  int64_t nbytes() const { return dtype_nbytes(dtype_, numel()); }
  int64_t element_size() const { return dtype_type_size(dtype_); }  // bytes per element (per block for block types)
  bool is_contiguous() const;
  const StoragePtr& storage() const { return storage_; }

  // Address of the first element.
  void* data_ptr() const;
  template <class T> T* data() const { return static_cast<T*>(data_ptr()); }

  // Views (no copy).
  Tensor view(Shape shape) const;        // contiguous tensors only; one dim may be -1
  Tensor reshape(Shape shape) const;     // view when possible, else a contiguous copy
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const;
  Tensor slice(int64_t dim, int64_t start, int64_t stop, int64_t step = 1) const;
  Tensor select(int64_t dim, int64_t index) const;
  Tensor transpose(int64_t d0, int64_t d1) const;
  Tensor permute(const Shape& dims) const;
  Tensor unsqueeze(int64_t dim) const;
  Tensor squeeze(int64_t dim) const;
  Tensor expand(const Shape& shape) const;  // broadcast view (stride 0)
  // Any view of the same storage (bounds-checked): shape, strides and offset in elements.
  Tensor as_strided(const Shape& shape, const Shape& strides, int64_t offset) const;
  // Same bytes read as another dtype of the same byte count per row (e.g. u8 <-> q4_0 rows).
  Tensor view_as_dtype(DType dtype, Shape shape) const;

  // Copies.
  Tensor contiguous() const;
  Tensor clone() const;
  Tensor to(DType dtype) const;      // cast (float dtypes) or dequantize (block dtypes -> float)
  Tensor to(Device device) const;    // copy to another device (same dtype)
  void copy_(const Tensor& src);     // same shape and dtype; any strides; across devices where built

  std::string repr() const;
  int64_t wrap_dim(int64_t d, int64_t ndim = -1) const;

 private:
  StoragePtr storage_;
  Shape shape_, strides_;
  int64_t offset_ = 0;
  DType dtype_ = DType::F32;
};

// Device-transfer hook: a backend registers the copy between its memory and the host.
using CopyFn = void (*)(const Tensor& dst, const Tensor& src);
void register_copy(DeviceType a, DeviceType b, CopyFn fn);

}  // namespace tallow
