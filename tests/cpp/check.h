// A minimal check macro for the C++ unit tests: counts failures, prints where, main returns non-zero.
#pragma once
#include <cstdio>

inline int& check_failures() {
  static int n = 0;
  return n;
}

#define CHECK(cond)                                                         \
  do {                                                                      \
    if (!(cond)) {                                                          \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++check_failures();                                                   \
    }                                                                       \
  } while (0)

#define CHECK_THROWS(expr, type)                                            \
  do {                                                                      \
    bool thrown = false;                                                    \
    try { (void)(expr); } catch (const type&) { thrown = true; }            \
    if (!thrown) {                                                          \
      std::fprintf(stderr, "%s:%d: expected %s from %s\n", __FILE__, __LINE__, #type, #expr); \
      ++check_failures();                                                   \
    }                                                                       \
  } while (0)

inline int check_report(const char* name) {
  if (check_failures()) std::fprintf(stderr, "%s: %d check(s) failed\n", name, check_failures());
  else std::printf("%s: all checks passed\n", name);
  return check_failures() ? 1 : 0;
}
