// The GEMM kernel set compiled once per x86-64 ISA level (see gemm_kernel.h) and the run-time choice.
#include "ops/gemm_kernel.h"

#include <atomic>
#include <string>

#include "core/half.h"
#include "core/parallel.h"
#include "core/simd.h"
#include "core/tuning.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define TALLOW_GEMM_X86 1
#if defined(TALLOW_NO_CLONES)
#define TALLOW_GEMM_MULTI 0  // -march=native: one kernel set, for the build machine
#else
#define TALLOW_GEMM_MULTI 1  // AVX-512, AVX2+FMA and baseline sets, chosen at run time
#endif
#else
#define TALLOW_GEMM_X86 0
#define TALLOW_GEMM_MULTI 0
#endif

#define TALLOW_GEMM_BODY 1

// GCC 12's AVX-512 intrinsic headers trip -W(maybe-)uninitialized (_mm512_undefined_* inside them).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#if TALLOW_GEMM_MULTI
#define TALLOW_GEMM_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define TALLOW_GEMM_TARGET_BEGIN(T) \
  TALLOW_GEMM_PRAGMA(clang attribute push(__attribute__((target(T))), apply_to = function))
#define TALLOW_GEMM_TARGET_END _Pragma("clang attribute pop")
#else
#define TALLOW_GEMM_TARGET_BEGIN(T) _Pragma("GCC push_options") TALLOW_GEMM_PRAGMA(GCC target(T))
#define TALLOW_GEMM_TARGET_END _Pragma("GCC pop_options")
#endif

TALLOW_GEMM_TARGET_BEGIN("avx512f,avx512bw,avx512dq,avx512vl,avx512cd,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt,movbe")
namespace tallow::ops::gemm::isa_avx512 {
#define TALLOW_GEMM_ISA 512
#include "ops/gemm_kernel.h"
#undef TALLOW_GEMM_ISA
}  // namespace tallow::ops::gemm::isa_avx512
TALLOW_GEMM_TARGET_END

TALLOW_GEMM_TARGET_BEGIN("avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt,movbe")
namespace tallow::ops::gemm::isa_avx2 {
#define TALLOW_GEMM_ISA 256
#include "ops/gemm_kernel.h"
#undef TALLOW_GEMM_ISA
}  // namespace tallow::ops::gemm::isa_avx2
TALLOW_GEMM_TARGET_END

namespace tallow::ops::gemm::isa_portable {
#define TALLOW_GEMM_ISA 0
#include "ops/gemm_kernel.h"
#undef TALLOW_GEMM_ISA
}  // namespace tallow::ops::gemm::isa_portable

#else  // one kernel set, for the compiler's target

namespace tallow::ops::gemm::isa_native {
#if TALLOW_GEMM_X86 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define TALLOW_GEMM_ISA 512
#define TALLOW_GEMM_NATIVE_NAME "avx512"
#elif TALLOW_GEMM_X86 && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TALLOW_GEMM_ISA 256
#define TALLOW_GEMM_NATIVE_NAME "avx2"
#else
#define TALLOW_GEMM_ISA 0
#define TALLOW_GEMM_NATIVE_NAME "portable"
#endif
#include "ops/gemm_kernel.h"
#undef TALLOW_GEMM_ISA
}  // namespace tallow::ops::gemm::isa_native

#endif

namespace tallow::ops::gemm {

#if TALLOW_GEMM_MULTI
namespace {
void run_avx512(Elt elt, const Problem& p) { isa_avx512::run(elt, p); }
void run_avx2(Elt elt, const Problem& p) { isa_avx2::run(elt, p); }
void run_portable(Elt elt, const Problem& p) { isa_portable::run(elt, p); }

using RunFn = void (*)(Elt, const Problem&);
struct Choice {
  RunFn fn;
  const char* name;
};
bool supported(const std::string& name) {
  __builtin_cpu_init();
  if (name == "avx512")
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (name == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return name == "portable";
}
Choice named(const std::string& name) {
  if (name == "avx512") return {run_avx512, "avx512"};
  if (name == "avx2") return {run_avx2, "avx2"};
  return {run_portable, "portable"};
}
Choice choose() {
  if (const std::string& isa = kernel_tuning().gemm_isa; !isa.empty() && supported(isa)) return named(isa);
  for (const char* n : {"avx512", "avx2"})
    if (supported(n)) return named(n);
  return named("portable");
}
std::atomic<const Choice*>& current() {
  static const Choice initial = choose();
  static std::atomic<const Choice*> c{&initial};
  return c;
}
}  // namespace

void run(Elt elt, const Problem& p) { current().load()->fn(elt, p); }
const char* isa_name() { return current().load()->name; }
bool set_isa(const char* name) {
  static const Choice all[3] = {named("avx512"), named("avx2"), named("portable")};
  if (!name || !supported(name)) return false;
  for (const Choice& c : all)
    if (std::string(c.name) == name) current().store(&c);
  return true;
}
#else
void run(Elt elt, const Problem& p) { isa_native::run(elt, p); }
const char* isa_name() { return TALLOW_GEMM_NATIVE_NAME; }
bool set_isa(const char* name) { return name && std::string(name) == TALLOW_GEMM_NATIVE_NAME; }
#endif

}  // namespace tallow::ops::gemm
