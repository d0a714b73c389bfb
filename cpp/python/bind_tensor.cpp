// Tensor, DType and Device for Python: zero-copy numpy interop both ways, DLPack, views, casts.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "ops/cast.h"
#include "ops/elementwise.h"
#include "python/convert.h"
#include "python/dlpack.h"

namespace py = pybind11;
using namespace tallow;

namespace tallow::py_convert {

DType to_dtype(const py::handle& obj) {
  if (py::isinstance<DType>(obj)) return obj.cast<DType>();
  if (py::isinstance<py::str>(obj)) return dtype_from_name(obj.cast<std::string>());
  py::module_ np = py::module_::import("numpy");
  py::object npdt;
  try {
    npdt = np.attr("dtype")(obj);
  } catch (py::error_already_set&) {
    throw TypeError(str_cat("not a dtype: ", py::repr(obj).cast<std::string>()));
  }
  const std::string name = py::str(npdt.attr("name")).cast<std::string>();
  static const std::pair<const char*, DType> map[] = {
      {"float32", DType::F32}, {"float16", DType::F16}, {"bfloat16", DType::BF16}, {"int8", DType::I8},
      {"uint8", DType::U8},    {"int32", DType::I32},   {"int64", DType::I64},     {"bool", DType::Bool},
      {"float8_e4m3fn", DType::F8E4M3}};
  for (auto& [n, d] : map)
    if (name == n) return d;
  throw TypeError(str_cat("numpy dtype ", name, " has no tallow equivalent"));
}

Device to_device(const py::handle& obj) {
  if (py::isinstance<Device>(obj)) return obj.cast<Device>();
  return parse_device(py::str(obj).cast<std::string>());
}

py::object numpy_dtype(DType dt) {
  const char* name = nullptr;
  switch (dt) {
    case DType::F32: name = "float32"; break;
    case DType::F16: name = "float16"; break;
    case DType::I8: name = "int8"; break;
    case DType::U8: name = "uint8"; break;
    case DType::I32: name = "int32"; break;
    case DType::I64: name = "int64"; break;
    case DType::Bool: name = "bool"; break;
    default: return py::none();
  }
  return py::module_::import("numpy").attr("dtype")(name);
}

}  // namespace tallow::py_convert

using namespace tallow::py_convert;

namespace {

// Zero-copy ndarray over a CPU tensor. Raw mode shows block/bf16/f8 tensors as their bytes.
py::array to_numpy(const Tensor& t, bool raw) {
  TALLOW_CHECK(t.device().is_cpu(), "numpy(): tensor is on ", t.device().str(), "; call .to('cpu') first");
  py::object npdt = numpy_dtype(t.dtype());
  std::vector<py::ssize_t> shape(t.shape().begin(), t.shape().end()), strides;
  const int64_t es = t.element_size();
  if (npdt.is_none()) {
    TALLOW_CHECK_TYPE(raw, "numpy(): numpy has no ", dtype_name(t.dtype()),
                      " dtype; use .to('float32') or numpy(raw=True) for the bytes");
    if (is_block_dtype(t.dtype())) {
      // [..., K] elements -> [..., K / block * type_size] bytes
      TALLOW_CHECK(t.is_contiguous(), "numpy(raw=True): block tensor must be contiguous");
      shape.back() = (py::ssize_t)dtype_nbytes(t.dtype(), t.shape().back());
      npdt = numpy_dtype(DType::U8);
      for (auto s : contiguous_strides(Shape(shape.begin(), shape.end()))) strides.push_back((py::ssize_t)s);
    } else {
      npdt = py::module_::import("numpy").attr("dtype")(es == 2 ? "uint16" : "uint8");
      for (auto s : t.strides()) strides.push_back((py::ssize_t)(s * es));
    }
  } else {
    for (auto s : t.strides()) strides.push_back((py::ssize_t)(s * es));
  }
  // The capsule owns a Tensor handle, keeping the storage alive as long as the array.
  auto* keep = new Tensor(t);
  py::capsule base(keep, [](void* p) { delete static_cast<Tensor*>(p); });
  return py::array(py::dtype::from_args(npdt), shape, strides, t.data_ptr(), base);
}

Tensor from_numpy(py::array arr) {
  const DType dt = to_dtype(arr.dtype());
  const int64_t es = (int64_t)arr.itemsize();
  Shape shape, strides;
  bool ok = true;
  for (py::ssize_t i = 0; i < arr.ndim(); ++i) {
    shape.push_back(arr.shape(i));
    const int64_t sb = arr.strides(i);
    if (sb < 0 || sb % es != 0) ok = false;
    strides.push_back(sb / es);
  }
  if (!ok) arr = py::array::ensure(arr, py::array::c_style | py::array::forcecast);
  if (!ok) {
    strides = contiguous_strides(shape);
  }
  // Keep the array alive while the storage lives. The GIL is needed to drop the reference.
  auto* ref = new py::object(arr);
  auto release = [ref] {
    py::gil_scoped_acquire gil;
    delete ref;
  };
  int64_t span = 1;  // bytes from the first element to one past the last
  for (size_t i = 0; i < shape.size(); ++i) span += (shape[i] - 1) * strides[i];
  const size_t nbytes = shape_numel(shape) == 0 ? 0 : (size_t)(span * es);
  return Tensor::from_blob(const_cast<void*>(arr.data()), shape, strides, dt, Device{}, release, nbytes);
}

// Bytes (any contiguous buffer: u8 ndarray, mmap slice through numpy) read as a tensor of `dtype`.
Tensor from_buffer(py::array arr, const py::handle& dtype, const Shape& shape) {
  const DType dt = to_dtype(dtype);
  TALLOW_CHECK(arr.flags() & py::array::c_style, "from_buffer: buffer must be C-contiguous");
  const int64_t need = dtype_nbytes(dt, shape_numel(shape));
  TALLOW_CHECK((int64_t)arr.nbytes() == need, "from_buffer: ", arr.nbytes(), " bytes given, ", dtype_name(dt),
               shape_str(shape), " needs ", need);
  auto* ref = new py::object(arr);
  auto release = [ref] {
    py::gil_scoped_acquire gil;
    delete ref;
  };
  return Tensor::from_blob(const_cast<void*>(arr.data()), shape, contiguous_strides(shape), dt, Device{}, release,
                           (size_t)need);
}

// ---- DLPack --------------------------------------------------------------------------------
DLDataType dl_dtype(DType dt) {
  switch (dt) {
    case DType::F32: return {kDLFloat, 32, 1};
    case DType::F16: return {kDLFloat, 16, 1};
    case DType::BF16: return {kDLBfloat, 16, 1};
    case DType::F8E4M3: return {kDLFloat8_e4m3fn, 8, 1};
    case DType::I8: return {kDLInt, 8, 1};
    case DType::U8: return {kDLUInt, 8, 1};
    case DType::I32: return {kDLInt, 32, 1};
    case DType::I64: return {kDLInt, 64, 1};
    case DType::Bool: return {kDLBool, 8, 1};
    default: throw TypeError(str_cat("__dlpack__: ", dtype_name(dt), " has no DLPack type"));
  }
}

DType from_dl_dtype(DLDataType t) {
  TALLOW_CHECK_TYPE(t.lanes == 1, "from_dlpack: vector dtypes are not supported");
  if (t.code == kDLFloat && t.bits == 32) return DType::F32;
  if (t.code == kDLFloat && t.bits == 16) return DType::F16;
  if (t.code == kDLBfloat && t.bits == 16) return DType::BF16;
  if (t.code == kDLFloat8_e4m3fn && t.bits == 8) return DType::F8E4M3;
  if (t.code == kDLInt && t.bits == 8) return DType::I8;
  if (t.code == kDLUInt && t.bits == 8) return DType::U8;
  if (t.code == kDLInt && t.bits == 32) return DType::I32;
  if (t.code == kDLInt && t.bits == 64) return DType::I64;
  if (t.code == kDLBool && t.bits == 8) return DType::Bool;
  throw TypeError(str_cat("from_dlpack: unsupported DLPack dtype code ", (int)t.code, " bits ", (int)t.bits));
}

struct DLPackHolder {
  Tensor tensor;
  std::vector<int64_t> shape, strides;
  DLManagedTensor managed;
};

py::capsule to_dlpack(const Tensor& t) {
  auto* h = new DLPackHolder{t, t.shape(), t.strides(), {}};
  DLTensor& d = h->managed.dl_tensor;
  d.data = t.data_ptr();
  d.device = t.device().type == DeviceType::CUDA ? DLDevice{kDLCUDA, t.device().index} : DLDevice{kDLCPU, 0};
  d.ndim = (int32_t)t.dim();
  d.dtype = dl_dtype(t.dtype());
  d.shape = h->shape.data();
  d.strides = h->strides.data();
  d.byte_offset = 0;
  h->managed.manager_ctx = h;
  h->managed.deleter = [](DLManagedTensor* self) { delete static_cast<DLPackHolder*>(self->manager_ctx); };
  // A consumer renames the capsule to "used_dltensor" and calls the deleter itself.
  return py::capsule(&h->managed, "dltensor", [](PyObject* cap) {
    if (PyCapsule_IsValid(cap, "dltensor")) {
      auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, "dltensor"));
      if (m && m->deleter) m->deleter(m);
    }
  });
}

Tensor from_dlpack(py::object obj) {
  py::object cap_obj = py::hasattr(obj, "__dlpack__") ? obj.attr("__dlpack__")() : obj;
  PyObject* cap = cap_obj.ptr();
  TALLOW_CHECK_TYPE(PyCapsule_IsValid(cap, "dltensor"), "from_dlpack: expected an object with __dlpack__ or a "
                                                        "'dltensor' capsule");
  auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, "dltensor"));
  const DLTensor& d = m->dl_tensor;
  Device dev;
  if (d.device.device_type == kDLCPU || d.device.device_type == kDLCUDAHost) dev = {DeviceType::CPU, 0};
  else if (d.device.device_type == kDLCUDA) dev = {DeviceType::CUDA, d.device.device_id};
  else throw ValueError(str_cat("from_dlpack: unsupported device type ", (int)d.device.device_type));
  const DType dt = from_dl_dtype(d.dtype);
  Shape shape(d.shape, d.shape + d.ndim);
  Shape strides = d.strides ? Shape(d.strides, d.strides + d.ndim) : contiguous_strides(shape);
  PyCapsule_SetName(cap, "used_dltensor");
  auto release = [m] { if (m->deleter) m->deleter(m); };
  const int64_t es = dtype_type_size(dt);
  int64_t span = 1;
  for (size_t i = 0; i < shape.size(); ++i) span += (shape[i] - 1) * std::max<int64_t>(strides[i], 0);
  const size_t nbytes = shape_numel(shape) == 0 ? 0 : (size_t)(span * es);
  return Tensor::from_blob(static_cast<char*>(d.data) + d.byte_offset, shape, strides, dt, dev, release, nbytes);
}

// ---- indexing ----------------------------------------------------------------------------
Tensor index_tensor(const Tensor& t, const py::object& key) {
  py::tuple keys = py::isinstance<py::tuple>(key) ? key.cast<py::tuple>() : py::make_tuple(key);
  Tensor r = t;
  int64_t d = 0;
  for (auto k : keys) {
    if (k.is_none()) {
      r = r.unsqueeze(d++);
    } else if (py::isinstance<py::int_>(k)) {
      r = r.select(d, k.cast<int64_t>());
    } else if (py::isinstance<py::slice>(k)) {
      TALLOW_CHECK_INDEX(d < r.dim(), "too many indices for tensor of shape ", shape_str(t.shape()));
      py::ssize_t start, stop, step, len;
      if (!k.cast<py::slice>().compute((py::ssize_t)r.size(d), &start, &stop, &step, &len)) throw py::error_already_set();
      TALLOW_CHECK_INDEX(step > 0, "negative slice steps are not supported");
      r = r.slice(d, start, start + len * step, step);
      ++d;
    } else if (k.ptr() == Py_Ellipsis) {
      const int64_t rest = (int64_t)std::count_if(keys.begin(), keys.end(), [](py::handle h) {
        return !h.is_none() && h.ptr() != Py_Ellipsis;
      });
      d = r.dim() - (rest - d);
    } else {
      throw TypeError(str_cat("unsupported index ", py::repr(k).cast<std::string>()));
    }
  }
  return r;
}

}  // namespace

void bind_tensor(py::module_& m) {
  py::enum_<DType> dt(m, "DType", "Element type of a Tensor");
  for (size_t i = 0; i < (size_t)DType::kCount; ++i) {
    dt.value(dtype_info((DType)i).name, (DType)i);
    m.attr(dtype_info((DType)i).name) = (DType)i;
  }
  dt.def_property_readonly("block_size", [](DType d) { return dtype_block_size(d); })
      .def_property_readonly("type_size", [](DType d) { return dtype_type_size(d); })
      .def_property_readonly("is_block", [](DType d) { return is_block_dtype(d); })
      .def_property_readonly("is_float", [](DType d) { return is_float_dtype(d); })
      .def_property_readonly("ggml_type", [](DType d) { return dtype_info(d).ggml_type; })
      .def("nbytes", [](DType d, int64_t n) { return dtype_nbytes(d, n); }, py::arg("numel"));
  m.def("dtype", &to_dtype, py::arg("obj"), "DType from a name, a DType or a numpy dtype");
  m.def("dtype_from_ggml_type", &dtype_from_ggml_type, py::arg("ggml_type"));

  py::class_<Device>(m, "Device")
      .def(py::init([](const std::string& s) { return parse_device(s); }), py::arg("spec"))
      .def_property_readonly("type", [](const Device& d) {
        return std::string(d.type == DeviceType::CPU ? "cpu" : d.type == DeviceType::CUDA ? "cuda" : "metal");
      })
      .def_readonly("index", &Device::index)
      .def("__eq__", [](const Device& a, const py::object& b) {
        try { return a == to_device(b); } catch (const std::exception&) { return false; }
      })
      .def("__hash__", [](const Device& d) { return py::hash(py::str(d.str())); })
      .def("__str__", &Device::str)
      .def("__repr__", [](const Device& d) { return "device('" + d.str() + "')"; });

  py::class_<Tensor>(m, "Tensor", "A strided view of device memory with a dtype (see tallow._core.tensor)")
      .def(py::init([](py::array arr) { return from_numpy(arr); }), py::arg("array"),
           "Zero-copy view of a numpy array")
      .def_property_readonly("shape", [](const Tensor& t) { return py::tuple(py::cast(t.shape())); })
      .def_property_readonly("strides", [](const Tensor& t) { return py::tuple(py::cast(t.strides())); })
      .def_property_readonly("offset", &Tensor::offset)
      .def_property_readonly("dtype", &Tensor::dtype)
      .def_property_readonly("device", &Tensor::device)
      .def_property_readonly("ndim", &Tensor::dim)
      .def_property_readonly("nbytes", &Tensor::nbytes)
      .def_property_readonly("data_ptr", [](const Tensor& t) { return (uintptr_t)t.data_ptr(); })
      .def("numel", &Tensor::numel)
      .def("size", [](const Tensor& t, int64_t d) { return t.size(d); }, py::arg("dim"))
      .def("stride", [](const Tensor& t, int64_t d) { return t.stride(d); }, py::arg("dim"))
      .def("dim", &Tensor::dim)
      .def("is_contiguous", &Tensor::is_contiguous)
      .def("__len__", [](const Tensor& t) {
        TALLOW_CHECK_TYPE(t.dim() > 0, "len() of a 0-d tensor");
        return t.size(0);
      })
      .def("view", [](const Tensor& t, py::args shape) { return t.view(py::len(shape) == 1 && !py::isinstance<py::int_>(shape[0]) ? shape[0].cast<Shape>() : shape.cast<Shape>()); })
      .def("reshape", [](const Tensor& t, py::args shape) { return t.reshape(py::len(shape) == 1 && !py::isinstance<py::int_>(shape[0]) ? shape[0].cast<Shape>() : shape.cast<Shape>()); })
      .def("narrow", &Tensor::narrow, py::arg("dim"), py::arg("start"), py::arg("length"))
      .def("slice", &Tensor::slice, py::arg("dim"), py::arg("start"), py::arg("stop"), py::arg("step") = 1)
      .def("select", &Tensor::select, py::arg("dim"), py::arg("index"))
      .def("transpose", &Tensor::transpose, py::arg("dim0"), py::arg("dim1"))
      .def("permute", [](const Tensor& t, py::args dims) { return t.permute(py::len(dims) == 1 && !py::isinstance<py::int_>(dims[0]) ? dims[0].cast<Shape>() : dims.cast<Shape>()); })
      .def_property_readonly("T", [](const Tensor& t) {
        TALLOW_CHECK(t.dim() == 2, ".T needs a 2-D tensor, got shape ", shape_str(t.shape()));
        return t.transpose(0, 1);
      })
      .def("unsqueeze", &Tensor::unsqueeze, py::arg("dim"))
      .def("squeeze", &Tensor::squeeze, py::arg("dim"))
      .def("expand", [](const Tensor& t, py::args shape) { return t.expand(py::len(shape) == 1 && !py::isinstance<py::int_>(shape[0]) ? shape[0].cast<Shape>() : shape.cast<Shape>()); })
      .def("view_as_dtype", [](const Tensor& t, const py::object& d, const Shape& s) { return t.view_as_dtype(to_dtype(d), s); },
           py::arg("dtype"), py::arg("shape"))
      .def("as_strided", &Tensor::as_strided, py::arg("shape"), py::arg("strides"), py::arg("offset"),
           "View of the same storage with explicit shape, strides and offset (in elements)")
      .def("contiguous", &Tensor::contiguous)
      .def("clone", &Tensor::clone)
      .def("copy_", [](Tensor& t, const Tensor& src) { t.copy_(src); return t; }, py::arg("src"))
      .def("to", [](const Tensor& t, const py::object& target) {
        // A dtype or a device.
        if (py::isinstance<Device>(target)) return t.to(target.cast<Device>());
        if (py::isinstance<py::str>(target)) {
          const auto s = target.cast<std::string>();
          if (s == "cpu" || s.rfind("cuda", 0) == 0 || s.rfind("metal", 0) == 0) return t.to(parse_device(s));
        }
        return t.to(to_dtype(target));
      }, py::arg("target"), "Cast to a dtype (block dtypes dequantize) or copy to a device")
      .def("numpy", &to_numpy, py::arg("raw") = false,
           "Zero-copy numpy view; raw=True shows bf16/f8/block tensors as their bytes")
      .def("__array__", [](const Tensor& t, py::object dtype, py::object copy) {
        py::object arr;
        if (numpy_dtype(t.dtype()).is_none() && t.device().is_cpu()) {
          TALLOW_CHECK(copy.is_none() || copy.cast<bool>(), "__array__: ", dtype_name(t.dtype()),
                       " needs a copy to become a numpy array");
          arr = to_numpy(t.to(DType::F32), false);
        } else {
          arr = to_numpy(t.device().is_cpu() ? t : t.to(Device{}), false);
        }
        if (!dtype.is_none()) arr = arr.attr("astype")(dtype);
        return arr;
      }, py::arg("dtype") = py::none(), py::arg("copy") = py::none())
      .def("__dlpack__", [](const Tensor& t, py::kwargs) { return to_dlpack(t); })
      .def("__dlpack_device__", [](const Tensor& t) {
        return py::make_tuple(t.device().type == DeviceType::CUDA ? (int)kDLCUDA : (int)kDLCPU, t.device().index);
      })
      .def("__getitem__", &index_tensor)
      .def("__add__", [](const Tensor& a, const Tensor& b) { return ops::add(a, b); })
      .def("__mul__", [](const Tensor& a, const Tensor& b) { return ops::mul(a, b); })
      .def("__mul__", [](const Tensor& a, float s) { return ops::scale(a, s); })
      .def("__rmul__", [](const Tensor& a, float s) { return ops::scale(a, s); })
      .def("__repr__", [](const Tensor& t) {
        std::string r = t.repr();
        if (t.defined() && t.device().is_cpu() && t.numel() > 0 && !is_block_dtype(t.dtype())) {
          py::object arr = to_numpy(numpy_dtype(t.dtype()).is_none() ? t.to(DType::F32) : t, false);
          py::object np = py::module_::import("numpy");
          std::string body = np.attr("array2string")(arr, py::arg("threshold") = 16, py::arg("edgeitems") = 3,
                                                     py::arg("precision") = 4,
                                                     py::arg("prefix") = "       ").cast<std::string>();
          r.pop_back();
          r += ",\n       " + body + ")";
        }
        return r;
      });

  m.def("from_numpy", &from_numpy, py::arg("array"), "Zero-copy Tensor over a numpy array (copies only for "
                                                        "negative or unaligned strides)");
  m.def("from_buffer", &from_buffer, py::arg("buffer"), py::arg("dtype"), py::arg("shape"),
        "Zero-copy Tensor of `dtype` (block types included) over the bytes of a contiguous array");
  m.def("from_dlpack", &from_dlpack, py::arg("obj"));
  m.def("empty", [](const Shape& shape, const py::object& dtype, const py::object& device) {
    return Tensor::empty(shape, to_dtype(dtype), to_device(device));
  }, py::arg("shape"), py::arg("dtype") = "float32", py::arg("device") = "cpu");
  m.def("tensor", [](const py::object& data, const py::object& dtype, const py::object& device) {
    // Copying constructor from anything numpy understands, converted to `dtype`.
    py::object np = py::module_::import("numpy");
    py::array arr = np.attr("asarray")(data);
    const std::string kind = py::str(arr.dtype().attr("kind")).cast<std::string>();
    if (kind == "f" && (arr.dtype().attr("itemsize").cast<int>() == 8)) arr = arr.attr("astype")("float32");
    Tensor src = from_numpy(np.attr("require")(arr, py::arg("requirements") = "C"));
    Tensor out = dtype.is_none() ? src.clone() : src.to(to_dtype(dtype));
    if (out.storage() == src.storage()) out = out.clone();
    return out.to(to_device(device));
  }, py::arg("data"), py::arg("dtype") = py::none(), py::arg("device") = "cpu",
     "New tensor (a copy) from a nested list or array; float64 becomes float32 unless dtype says otherwise");
}
