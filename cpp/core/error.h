// Errors raised by the core. The bindings turn them into Python exceptions of the same name,
// so bad input reaches the user as a ValueError/TypeError naming the op and the shapes.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace tallow {

struct ValueError : std::runtime_error { using std::runtime_error::runtime_error; };
struct TypeError : std::runtime_error { using std::runtime_error::runtime_error; };
struct NotImplementedError : std::runtime_error { using std::runtime_error::runtime_error; };
struct IndexError : std::runtime_error { using std::runtime_error::runtime_error; };

template <class... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

}  // namespace tallow

#define TALLOW_CHECK(cond, ...) \
  do { if (!(cond)) throw ::tallow::ValueError(::tallow::str_cat(__VA_ARGS__)); } while (0)
#define TALLOW_CHECK_TYPE(cond, ...) \
  do { if (!(cond)) throw ::tallow::TypeError(::tallow::str_cat(__VA_ARGS__)); } while (0)
#define TALLOW_CHECK_INDEX(cond, ...) \
  do { if (!(cond)) throw ::tallow::IndexError(::tallow::str_cat(__VA_ARGS__)); } while (0)
