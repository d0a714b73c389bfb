// tallow._core.kernel_tuning / set_kernel_tuning: the kernel tuning struct (cpp/core/tuning.h) by field
// name, for tests and benchmarks (tallow.ops.kernel_tuning_override wraps them as a context manager).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "core/tuning.h"

namespace py = pybind11;
using namespace tallow;

void bind_tuning(py::module_& m) {
  kernel_tuning();  // read the environment now, at import
  m.def(
      "kernel_tuning",
      [] {
        py::dict d;
        for (const TuningFieldInfo& f : kernel_tuning_fields()) d[py::str(f.name)] = py::cast(get_kernel_tuning(f.name));
        return d;
      },
      "The kernel tuning fields and their values (cpp/core/tuning.h: read from TALLOW_* at import)");
  m.def(
      "kernel_tuning_fields",
      [] {
        py::dict d;
        for (const TuningFieldInfo& f : kernel_tuning_fields()) d[py::str(f.name)] = py::make_tuple(f.env, f.doc);
        return d;
      },
      "{field: (environment variable, what it does)}");
  m.def(
      "set_kernel_tuning",
      [](py::kwargs kw) {
        // Checked all first: a bad field leaves every field as it was.
        std::vector<std::pair<std::string, TuningValue>> items, before;
        for (auto item : kw) {
          const std::string name = item.first.cast<std::string>();
          before.emplace_back(name, get_kernel_tuning(name));  // ValueError for an unknown field
          const py::handle v = item.second;
          TuningValue value;
          if (py::isinstance<py::bool_>(v)) value = v.cast<bool>();
          else if (py::isinstance<py::int_>(v)) value = v.cast<int64_t>();
          else if (py::isinstance<py::str>(v)) value = v.cast<std::string>();
          else throw py::type_error("set_kernel_tuning: " + name + " takes a bool, int or str, got " +
                                    py::str(py::type::of(v)).cast<std::string>());
          items.emplace_back(name, value);
        }
        size_t done = 0;
        try {
          for (; done < items.size(); ++done) set_kernel_tuning(items[done].first, items[done].second);
        } catch (...) {
          while (done > 0) --done, set_kernel_tuning(before[done].first, before[done].second);
          throw;
        }
        py::dict previous;
        for (const auto& [name, value] : before) previous[py::str(name)] = py::cast(value);
        return previous;
      },
      "Set kernel tuning fields by name (see kernel_tuning()); returns their previous values. Not "
      "synchronised with ops running on other threads: for tests and benchmarks, between ops");
}
