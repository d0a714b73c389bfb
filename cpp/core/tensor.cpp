#include "core/tensor.h"

#include <cstring>
#include <map>
#include <sstream>

#include "core/error.h"
#include "core/parallel.h"
#include "ops/cast.h"

namespace tallow {

std::string shape_str(const Shape& s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (auto d : s) n *= d;
  return n;
}

Shape contiguous_strides(const Shape& s) {
  Shape st(s.size());
  int64_t acc = 1;
  for (int64_t i = (int64_t)s.size() - 1; i >= 0; --i) {
    st[i] = acc;
    acc *= std::max<int64_t>(s[i], 1);
  }
  return st;
}

namespace {

void check_block_layout(const Shape& shape, const Shape& strides, int64_t offset, DType dtype, const char* what) {
  if (!is_block_dtype(dtype)) return;
  const int64_t bs = dtype_block_size(dtype);
  TALLOW_CHECK(!shape.empty(), what, ": a ", dtype_name(dtype), " tensor needs at least one dimension");
  TALLOW_CHECK(shape.back() % bs == 0, what, ": last dimension of ", dtype_name(dtype), " tensor ", shape_str(shape),
               " is not a multiple of its block size ", bs);
  TALLOW_CHECK(shape.back() <= 1 || strides.back() == 1, what, ": ", dtype_name(dtype),
               " tensors must be contiguous along the last dimension");
  TALLOW_CHECK(offset % bs == 0, what, ": offset ", offset, " splits a ", dtype_name(dtype), " block");
  for (size_t i = 0; i + 1 < strides.size(); ++i)
    TALLOW_CHECK(shape[i] <= 1 || strides[i] % bs == 0, what, ": stride ", strides[i], " of dim ", i,
                 " splits a ", dtype_name(dtype), " block");
}

std::map<std::pair<int, int>, CopyFn>& copy_registry() {
  static std::map<std::pair<int, int>, CopyFn> r;
  return r;
}

// Byte offset of a logical element offset (whole blocks for block dtypes).
int64_t byte_offset(DType dtype, int64_t elems) {
  return elems / dtype_block_size(dtype) * dtype_type_size(dtype);
}

// Host copy between two same-shape, same-dtype views with arbitrary strides.
void copy_host(const Tensor& dst, const Tensor& src) {
  const DType dt = dst.dtype();
  const int64_t nd = dst.dim();
  if (dst.numel() == 0) return;
  if (dst.is_contiguous() && src.is_contiguous()) {
    std::memcpy(dst.data_ptr(), src.data_ptr(), (size_t)dst.nbytes());
    return;
  }
  const Shape& shape = dst.shape();
  const int64_t inner = nd ? shape[nd - 1] : 1;
  const int64_t rows = nd ? dst.numel() / inner : 1;
  const int64_t es = dst.element_size();
  const bool block = is_block_dtype(dt);
  const bool inner_contig = block || nd == 0 || (dst.stride(-1) == 1 && src.stride(-1) == 1);
  char* dbase = static_cast<char*>(dst.storage()->data());
  const char* sbase = static_cast<const char*>(src.storage()->data());
  parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(inner, 1)), [&](int64_t r0, int64_t r1) {
    std::vector<int64_t> idx(nd > 0 ? nd - 1 : 0);
    for (int64_t r = r0; r < r1; ++r) {
      int64_t rem = r, doff = dst.offset(), soff = src.offset();
      for (int64_t d = nd - 2; d >= 0; --d) {
        const int64_t i = rem % shape[d];
        rem /= shape[d];
        doff += i * dst.stride(d);
        soff += i * src.stride(d);
      }
      char* dp = dbase + byte_offset(dt, doff);
      const char* sp = sbase + byte_offset(dt, soff);
      if (inner_contig) {
        std::memcpy(dp, sp, (size_t)dtype_nbytes(dt, inner));
      } else {
        const int64_t ds = dst.stride(-1) * es, ss = src.stride(-1) * es;
        for (int64_t i = 0; i < inner; ++i) std::memcpy(dp + i * ds, sp + i * ss, (size_t)es);
      }
    }
  });
}

}  // namespace

void register_copy(DeviceType a, DeviceType b, CopyFn fn) { copy_registry()[{(int)a, (int)b}] = fn; }

Tensor::Tensor(StoragePtr storage, Shape shape, Shape strides, int64_t offset, DType dtype)
    : storage_(std::move(storage)), shape_(std::move(shape)), strides_(std::move(strides)), offset_(offset),
      dtype_(dtype) {
  TALLOW_CHECK(shape_.size() == strides_.size(), "Tensor: shape ", shape_str(shape_), " and strides ",
               shape_str(strides_), " differ in rank");
  for (auto d : shape_) TALLOW_CHECK(d >= 0, "Tensor: negative dimension in shape ", shape_str(shape_));
  check_block_layout(shape_, strides_, offset_, dtype_, "Tensor");
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  for (auto d : shape) TALLOW_CHECK(d >= 0, "empty: negative dimension in shape ", shape_str(shape));
  const int64_t n = shape_numel(shape);
  check_block_layout(shape, contiguous_strides(shape), 0, dtype, "empty");
  auto storage = std::make_shared<Storage>((size_t)dtype_nbytes(dtype, n), device);
  return Tensor(std::move(storage), shape, contiguous_strides(shape), 0, dtype);
}

Tensor Tensor::from_blob(void* data, const Shape& shape, const Shape& strides, DType dtype, Device device,
                         std::function<void()> release, size_t nbytes) {
  if (nbytes == 0) nbytes = (size_t)dtype_nbytes(dtype, shape_numel(shape));
  auto storage = std::make_shared<Storage>(data, nbytes, device, std::move(release));
  return Tensor(std::move(storage), shape, strides, 0, dtype);
}

bool Tensor::is_contiguous() const {
  int64_t expected = 1;
  for (int64_t i = dim() - 1; i >= 0; --i) {
    if (shape_[i] == 1) continue;
    if (strides_[i] != expected) return false;
    expected *= shape_[i];
  }
  return true;
}

void* Tensor::data_ptr() const {
  TALLOW_CHECK(defined(), "data_ptr: undefined tensor");
  return static_cast<char*>(storage_->data()) + byte_offset(dtype_, offset_);
}

int64_t Tensor::wrap_dim(int64_t d, int64_t ndim) const {
  if (ndim < 0) ndim = dim();
  const int64_t w = d < 0 ? d + ndim : d;
  TALLOW_CHECK_INDEX(w >= 0 && w < std::max<int64_t>(ndim, 1), "dimension ", d, " out of range for a tensor of shape ",
                     shape_str(shape_));
  return w;
}

Tensor Tensor::view(Shape shape) const {
  int64_t infer = -1, known = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      TALLOW_CHECK(infer < 0, "view: only one dimension can be -1, got ", shape_str(shape));
      infer = (int64_t)i;
    } else {
      TALLOW_CHECK(shape[i] >= 0, "view: invalid shape ", shape_str(shape));
      known *= shape[i];
    }
  }
  if (infer >= 0) {
    TALLOW_CHECK(known > 0 && numel() % known == 0, "view: shape ", shape_str(shape), " is invalid for ", numel(),
                 " elements");
    shape[infer] = numel() / known;
  }
  TALLOW_CHECK(shape_numel(shape) == numel(), "view: shape ", shape_str(shape), " is invalid for a tensor of shape ",
               shape_str(shape_));
  TALLOW_CHECK(is_contiguous(), "view: tensor of shape ", shape_str(shape_), " and strides ", shape_str(strides_),
               " is not contiguous; use reshape()");
  return Tensor(storage_, shape, contiguous_strides(shape), offset_, dtype_);
}

Tensor Tensor::reshape(Shape shape) const { return is_contiguous() ? view(shape) : contiguous().view(shape); }

Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length) const {
  d = wrap_dim(d);
  if (start < 0) start += shape_[d];
  TALLOW_CHECK_INDEX(start >= 0 && length >= 0 && start + length <= shape_[d], "narrow: range [", start, ", ",
                     start + length, ") out of bounds for dim ", d, " of shape ", shape_str(shape_));
  Shape s = shape_;
  s[d] = length;
  return Tensor(storage_, s, strides_, offset_ + start * strides_[d], dtype_);
}

Tensor Tensor::slice(int64_t d, int64_t start, int64_t stop, int64_t step) const {
  d = wrap_dim(d);
  TALLOW_CHECK(step > 0, "slice: step must be positive, got ", step);
  const int64_t n = shape_[d];
  auto clampi = [n](int64_t v) { if (v < 0) v += n; return std::min(std::max<int64_t>(v, 0), n); };
  start = clampi(start);
  stop = std::max(clampi(stop), start);
  Shape s = shape_, st = strides_;
  s[d] = (stop - start + step - 1) / step;
  st[d] = strides_[d] * step;
  return Tensor(storage_, s, st, offset_ + start * strides_[d], dtype_);
}

Tensor Tensor::select(int64_t d, int64_t index) const {
  d = wrap_dim(d);
  if (index < 0) index += shape_[d];
  TALLOW_CHECK_INDEX(index >= 0 && index < shape_[d], "select: index ", index, " out of range for dim ", d,
                     " of shape ", shape_str(shape_));
  Shape s = shape_, st = strides_;
  s.erase(s.begin() + d);
  st.erase(st.begin() + d);
  return Tensor(storage_, s, st, offset_ + index * strides_[d], dtype_);
}

Tensor Tensor::transpose(int64_t d0, int64_t d1) const {
  d0 = wrap_dim(d0);
  d1 = wrap_dim(d1);
  Shape s = shape_, st = strides_;
  std::swap(s[d0], s[d1]);
  std::swap(st[d0], st[d1]);
  return Tensor(storage_, s, st, offset_, dtype_);
}

Tensor Tensor::permute(const Shape& dims) const {
  TALLOW_CHECK((int64_t)dims.size() == dim(), "permute: ", shape_str(dims), " does not match shape ", shape_str(shape_));
  Shape s(dims.size()), st(dims.size());
  std::vector<bool> seen(dims.size(), false);
  for (size_t i = 0; i < dims.size(); ++i) {
    const int64_t d = wrap_dim(dims[i]);
    TALLOW_CHECK(!seen[d], "permute: repeated dimension in ", shape_str(dims));
    seen[d] = true;
    s[i] = shape_[d];
    st[i] = strides_[d];
  }
  return Tensor(storage_, s, st, offset_, dtype_);
}

Tensor Tensor::unsqueeze(int64_t d) const {
  d = wrap_dim(d, dim() + 1);
  Shape s = shape_, st = strides_;
  const int64_t stride = d < dim() ? strides_[d] * shape_[d] : 1;
  s.insert(s.begin() + d, 1);
  st.insert(st.begin() + d, stride);
  return Tensor(storage_, s, st, offset_, dtype_);
}

Tensor Tensor::squeeze(int64_t d) const {
  d = wrap_dim(d);
  TALLOW_CHECK(shape_[d] == 1, "squeeze: dim ", d, " of shape ", shape_str(shape_), " is not 1");
  return select(d, 0);
}

Tensor Tensor::expand(const Shape& shape) const {
  TALLOW_CHECK((int64_t)shape.size() >= dim(), "expand: cannot expand shape ", shape_str(shape_), " to ",
               shape_str(shape));
  TALLOW_CHECK(!is_block_dtype(dtype_), "expand: not supported for ", dtype_name(dtype_), " tensors");
  const size_t lead = shape.size() - shape_.size();
  Shape st(shape.size(), 0);
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i < lead) continue;
    const int64_t have = shape_[i - lead];
    if (have == shape[i]) {
      st[i] = strides_[i - lead];
    } else {
      TALLOW_CHECK(have == 1, "expand: cannot expand shape ", shape_str(shape_), " to ", shape_str(shape));
      st[i] = 0;
    }
  }
  return Tensor(storage_, shape, st, offset_, dtype_);
}

Tensor Tensor::as_strided(const Shape& shape, const Shape& strides, int64_t offset) const {
  TALLOW_CHECK(shape.size() == strides.size(), "as_strided: shape ", shape_str(shape), " and strides ",
               shape_str(strides), " differ in rank");
  TALLOW_CHECK(offset >= 0, "as_strided: negative offset ", offset);
  int64_t last = offset;
  for (size_t i = 0; i < shape.size(); ++i) {
    TALLOW_CHECK(shape[i] >= 0 && strides[i] >= 0, "as_strided: negative size or stride in ", shape_str(shape), " / ",
                 shape_str(strides));
    if (shape[i] == 0) last = -1;
    if (last >= 0) last += (shape[i] - 1) * strides[i];
  }
  if (last >= 0) {
    const int64_t end_bytes = dtype_nbytes(dtype_, (last / dtype_block_size(dtype_) + 1) * dtype_block_size(dtype_));
    TALLOW_CHECK(end_bytes <= (int64_t)storage_->nbytes(), "as_strided: view ", shape_str(shape), " strides ",
                 shape_str(strides), " offset ", offset, " reaches past the storage (", storage_->nbytes(), " bytes)");
  }
  return Tensor(storage_, shape, strides, offset, dtype_);
}

Tensor Tensor::view_as_dtype(DType dtype, Shape shape) const {
  TALLOW_CHECK(is_contiguous(), "view_as_dtype: tensor of shape ", shape_str(shape_), " is not contiguous");
  TALLOW_CHECK(dtype_nbytes(dtype, shape_numel(shape)) == nbytes(), "view_as_dtype: ", nbytes(), " bytes of ",
               dtype_name(dtype_), shape_str(shape_), " cannot be read as ", dtype_name(dtype), shape_str(shape));
  const int64_t off_bytes = byte_offset(dtype_, offset_);
  TALLOW_CHECK(off_bytes % dtype_type_size(dtype) == 0, "view_as_dtype: misaligned offset");
  return Tensor(storage_, shape, contiguous_strides(shape), off_bytes / dtype_type_size(dtype) * dtype_block_size(dtype),
                dtype);
}

Tensor Tensor::contiguous() const { return is_contiguous() ? *this : clone(); }

Tensor Tensor::clone() const {
  Tensor out = Tensor::empty(shape_, dtype_, device());
  out.copy_(*this);
  return out;
}

Tensor Tensor::to(DType dtype) const {
  if (dtype == dtype_) return *this;
  return ops::cast(*this, dtype);
}

Tensor Tensor::to(Device device) const {
  if (device == this->device()) return *this;
  Tensor out = Tensor::empty(shape_, dtype_, device);
  out.copy_(*this);
  return out;
}

void Tensor::copy_(const Tensor& src) {
  TALLOW_CHECK(defined() && src.defined(), "copy_: undefined tensor");
  TALLOW_CHECK(shape_ == src.shape_, "copy_: shape ", shape_str(src.shape_), " does not match destination ",
               shape_str(shape_));
  TALLOW_CHECK_TYPE(dtype_ == src.dtype_, "copy_: dtype ", dtype_name(src.dtype_), " does not match destination ",
                    dtype_name(dtype_), " (use .to(dtype) to convert)");
  if (device().is_cpu() && src.device().is_cpu()) return copy_host(*this, src);
  auto& reg = copy_registry();
  auto it = reg.find({(int)device().type, (int)src.device().type});
  TALLOW_CHECK(it != reg.end(), "copy_: no copy from ", src.device().str(), " to ", device().str(), " in this build");
  it->second(*this, src);
}

std::string Tensor::repr() const {
  if (!defined()) return "Tensor(undefined)";
  std::ostringstream os;
  os << "Tensor(shape=" << shape_str(shape_) << ", dtype=" << dtype_name(dtype_) << ", device=" << device().str();
  if (!is_contiguous()) os << ", strides=" << shape_str(strides_);
  os << ")";
  return os.str();
}

}  // namespace tallow
