// The kernel tuning struct (tuning.h): the only file of cpp/ and cuda/ that reads the environment.
#include "core/tuning.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>

#include "core/error.h"

namespace tallow {

namespace {

const char* env(const char* name) {
  const char* s = std::getenv(name);
  return s && *s ? s : nullptr;
}

// Lenient as the readers it replaces: a variable that does not parse keeps the default.
int64_t env_int(const char* name, int64_t fallback) {
  const char* s = env(name);
  if (!s) return fallback;
  char* end = nullptr;
  const long long v = std::strtoll(s, &end, 10);
  return end == s ? fallback : (int64_t)v;
}
bool env_off(const char* name) {  // "0" turns a default-on knob off
  const char* s = env(name);
  return s && std::string(s) == "0";
}

// One row per field: its variable, what it means, how to read and write it, its range.
struct Field {
  TuningFieldInfo info;
  std::function<TuningValue(const KernelTuning&)> get;
  std::function<void(KernelTuning&, const TuningValue&)> set;
};

template <class M>
Field int_field(const char* name, const char* var, const char* doc, M KernelTuning::*m, int64_t lo, int64_t hi,
                std::function<bool(int64_t)> ok = nullptr) {
  return {{name, var, doc},
          [m](const KernelTuning& t) -> TuningValue { return (int64_t)(t.*m); },
          [=](KernelTuning& t, const TuningValue& v) {
            if (!std::holds_alternative<int64_t>(v))
              throw TypeError(str_cat("set_kernel_tuning: ", name, " takes an int"));
            const int64_t x = std::get<int64_t>(v);
            TALLOW_CHECK(x >= lo && x <= hi && (!ok || ok(x)), "set_kernel_tuning: ", name, "=", x,
                         " is out of range (", doc, ")");
            t.*m = (M)x;
          }};
}
Field bool_field(const char* name, const char* var, const char* doc, bool KernelTuning::*m) {
  return {{name, var, doc},
          [m](const KernelTuning& t) -> TuningValue { return t.*m; },
          [=](KernelTuning& t, const TuningValue& v) {
            if (!std::holds_alternative<bool>(v))
              throw TypeError(str_cat("set_kernel_tuning: ", name, " takes a bool"));
            t.*m = std::get<bool>(v);
          }};
}
Field string_field(const char* name, const char* var, const char* doc, std::string KernelTuning::*m) {
  return {{name, var, doc},
          [m](const KernelTuning& t) -> TuningValue { return t.*m; },
          [=](KernelTuning& t, const TuningValue& v) {
            if (!std::holds_alternative<std::string>(v))
              throw TypeError(str_cat("set_kernel_tuning: ", name, " takes a str"));
            t.*m = std::get<std::string>(v);
          }};
}

const std::vector<Field>& fields() {
  static const std::vector<Field> f = {
      string_field("gemm_isa", "TALLOW_GEMM_ISA", "CPU GEMM kernels: avx512, avx2, portable; '' the best (first GEMM)",
                   &KernelTuning::gemm_isa),
      int_field("cpu_cache_mb", "TALLOW_CPU_CACHE_MB", "MiB of freed host blocks kept, >= 0 (CPU allocator start)",
                &KernelTuning::cpu_cache_mb, 0, INT64_MAX >> 20),
      int_field("num_threads", "TALLOW_NUM_THREADS", "CPU kernel threads, 0: all (pool start, set_num_threads(0))",
                &KernelTuning::num_threads, 0, 1 << 16),
      int_field("skinny_max_m", "TALLOW_SKINNY_MAX_M", "rows up to which products use the gemv kernel, 0..16",
                &KernelTuning::skinny_max_m, 0, 16),
      string_field("gemv_config", "TALLOW_GEMV_CONFIG", "pinned gemv launch fields, e.g. 'warps=8,split=2'",
                   &KernelTuning::gemv_config),
      bool_field("gemv_autotune", "TALLOW_GEMV_AUTOTUNE", "time gemv launches per shape at first use",
                 &KernelTuning::gemv_autotune),
      bool_field("rope_warp", "TALLOW_ROPE_WARP", "rope_and_cache's warp kernel where its layout holds",
                 &KernelTuning::rope_warp),
      int_field("rope_rows", "TALLOW_ROPE_ROWS", "rows a lane of rope_and_cache's warp kernel: 1, 2, 4; 0 planned",
                &KernelTuning::rope_rows, 0, 4, [](int64_t x) { return x != 3; }),
      int_field("decode_splits", "TALLOW_DECODE_SPLITS", "decode attention's grid splits, >= 0; 0 planned",
                &KernelTuning::decode_splits, 0, 1 << 20),
      int_field("decode_min_split", "TALLOW_DECODE_MIN_SPLIT", "decode attention's minimum split in keys; 0 planned",
                &KernelTuning::decode_min_split, 0, 1 << 30),
      int_field("decode_min_split_rows_lo", "TALLOW_DECODE_MIN_SPLIT_ROWS",
                "decode_min_split applies from this many (token, kv head) rows (variable: lo,hi)",
                &KernelTuning::decode_min_split_rows_lo, 0, INT64_MAX),
      int_field("decode_min_split_rows_hi", "", "... up to below this many rows",
                &KernelTuning::decode_min_split_rows_hi, 0, INT64_MAX),
      int_field("decode_stages", "TALLOW_DECODE_STAGES", "decode attention's cp.async slots a warp, 1..4; 0 planned",
                &KernelTuning::decode_stages, 0, 4),
      bool_field("decode_pdl", "TALLOW_DECODE_PDL", "decode attention's programmatic dependent launch (sm_90)",
                 &KernelTuning::decode_pdl),
      int_field("decode_fill", "TALLOW_DECODE_FILL", "decode prologue fills every slot: 1, 0; -1 with few rows",
                &KernelTuning::decode_fill, -1, 1),
  };
  return f;
}

const Field& field(const std::string& name) {
  for (const Field& f : fields())
    if (f.info.name == name) return f;
  std::string names;
  for (const Field& f : fields()) names += (names.empty() ? "" : ", ") + f.info.name;
  throw ValueError(str_cat("kernel tuning has no field '", name, "' (fields: ", names, ")"));
}

KernelTuning& state() {
  static KernelTuning t = kernel_tuning_from_env();
  return t;
}

}  // namespace

KernelTuning kernel_tuning_from_env() {
  KernelTuning t;
  if (const char* s = env("TALLOW_GEMM_ISA")) t.gemm_isa = s;
  t.cpu_cache_mb = std::max<int64_t>(0, env_int("TALLOW_CPU_CACHE_MB", t.cpu_cache_mb));
  t.num_threads = std::max<int64_t>(0, env_int("TALLOW_NUM_THREADS", 0));
  t.skinny_max_m = std::clamp<int64_t>(env_int("TALLOW_SKINNY_MAX_M", t.skinny_max_m), 0, 16);
  if (const char* s = env("TALLOW_GEMV_CONFIG")) t.gemv_config = s;
  t.gemv_autotune = !env_off("TALLOW_GEMV_AUTOTUNE");
  t.rope_warp = !env_off("TALLOW_ROPE_WARP");
  const int64_t rows = env_int("TALLOW_ROPE_ROWS", 0);
  t.rope_rows = rows == 1 || rows == 2 || rows == 4 ? rows : 0;
  t.decode_splits = std::max<int64_t>(0, env_int("TALLOW_DECODE_SPLITS", 0));
  t.decode_min_split = std::max<int64_t>(0, env_int("TALLOW_DECODE_MIN_SPLIT", 0));
  if (const char* s = env("TALLOW_DECODE_MIN_SPLIT_ROWS")) {
    long long lo = 0, hi = 0;
    if (std::sscanf(s, "%lld,%lld", &lo, &hi) == 2 && lo >= 0 && hi >= 0)
      t.decode_min_split_rows_lo = lo, t.decode_min_split_rows_hi = hi;
  }
  t.decode_stages = std::clamp<int64_t>(env_int("TALLOW_DECODE_STAGES", 0), 0, 4);
  t.decode_pdl = !env_off("TALLOW_DECODE_PDL");
  if (env("TALLOW_DECODE_FILL")) t.decode_fill = env_off("TALLOW_DECODE_FILL") ? 0 : 1;
  return t;
}

const KernelTuning& kernel_tuning() { return state(); }
KernelTuning& mutable_kernel_tuning() { return state(); }

const std::vector<TuningFieldInfo>& kernel_tuning_fields() {
  static const std::vector<TuningFieldInfo> infos = [] {
    std::vector<TuningFieldInfo> v;
    for (const Field& f : fields()) v.push_back(f.info);
    return v;
  }();
  return infos;
}

TuningValue get_kernel_tuning(const std::string& name) { return field(name).get(state()); }

void set_kernel_tuning(const std::string& name, const TuningValue& value) { field(name).set(state(), value); }

}  // namespace tallow
