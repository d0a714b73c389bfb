// Kernel tuning: the one place the C++/CUDA core reads its environment. Every knob below is read once,
// from its TALLOW_* variable, the first time kernel_tuning() is called (tallow._core calls it when it
// is imported), into one struct; kernels read the struct, never the environment. Tests and
// benchmarks change fields at run time through set_kernel_tuning (tallow._core.set_kernel_tuning /
// tallow.ops.kernel_tuning_override); that is not synchronised with launches on other threads, so
// change fields only while no op is running.
//
// What is not here on purpose: the A/B switches for paths measured slower were deleted with those
// paths (cuda/README.md, "Removed switches"). Python-side knobs live in python/tallow/envs.py.
#pragma once
#include <cstdint>
#include <string>
#include <variant>
#include <vector>

namespace tallow {

struct KernelTuning {
  // ---- CPU (cpp/) ------------------------------------------------------------------------------
  // TALLOW_GEMM_ISA: the CPU GEMM kernel set, "avx512", "avx2" or "portable"; "" (default) is the
  // best this CPU runs. Read at the first GEMM (ops::gemm::set_isa changes it later).
  std::string gemm_isa;
  // TALLOW_CPU_CACHE_MB: MiB of freed >= 1 MiB host blocks the CPU allocator keeps for reuse (default
  // 1024). Read when the CPU allocator is made (the first CPU tensor).
  int64_t cpu_cache_mb = 1024;
  // TALLOW_NUM_THREADS: threads of the CPU kernels (0, default: every hardware thread). Read when the
  // thread pool starts and by set_num_threads(n <= 0).
  int64_t num_threads = 0;

  // ---- CUDA GEMM / decode GEMV (cuda/gemm.cu, cuda/gemv.cu) ------------------------------------
  // TALLOW_SKINNY_MAX_M: rows up to which linear / matmul / gated_linear use the gemv kernel instead of
  // cuBLASLt (0..16, default 16: gemv is weight-bandwidth-bound up to there, cuBLASLt is not).
  int64_t skinny_max_m = 16;
  // TALLOW_GEMV_CONFIG: pins fields of the gemv launch for every shape, e.g. "warps=8,split=2,unroll=4"
  // ("" default: the heuristic / the autotuned launch). Parsed at the next gemv launch (a bad value
  // raises ValueError there); tallow._core.cuda.set_gemv_config checks it at once.
  std::string gemv_config;
  // TALLOW_GEMV_AUTOTUNE: time 16 launch candidates at the first call of a shape outside graph capture
  // and keep the fastest (default on; H100 Llama-3-8B batch 1: 163.4 -> 168.0 tok/s); off keeps the
  // heuristic's launch (reproducible launches across processes).
  bool gemv_autotune = true;

  // ---- CUDA rope_and_cache (cuda/rope_cache.cu) -------------------------------------------------
  // TALLOW_ROPE_WARP: the warp kernel where its layout holds (default on); off runs the block kernel
  // (which other layouts use anyway) everywhere. Results are bitwise the same: tests use it to check so.
  bool rope_warp = true;
  // TALLOW_ROPE_ROWS: rows a lane of the warp kernel takes, 1, 2 or 4 (0, default: the fewest that fit
  // the grid in one wave, else 2). Tests pin it to reach a token's last warp with empty row slots.
  int64_t rope_rows = 0;

  // ---- CUDA decode attention (cuda/attention/decode.cu) -----------------------------------------
  // TALLOW_DECODE_SPLITS: the grid's split count, clamped to what the context needs and allows (0,
  // default: planned from occupancy). Tests force many splits to exercise the merge.
  int64_t decode_splits = 0;
  // TALLOW_DECODE_MIN_SPLIT: a sequence's minimum split in keys (0, default: the planner's rule, 64
  // keys with fewer (token, kv head) rows than SMs, 2048 with more).
  int64_t decode_min_split = 0;
  // TALLOW_DECODE_MIN_SPLIT_ROWS=lo,hi: decode_min_split applies only to launches of lo <= rows < hi
  // (token, kv head) rows (default every launch).
  int64_t decode_min_split_rows_lo = 0;
  int64_t decode_min_split_rows_hi = INT64_MAX;
  // TALLOW_DECODE_STAGES: cp.async slots a warp, 1..4 (0, default: 3, or 4 for <= SMs / 8 rows over
  // 16k+ keys with 16-bit caches), lowered until the shared memory fits the device.
  int64_t decode_stages = 0;
  // TALLOW_DECODE_PDL: programmatic dependent launch on sm_90 (default on: metadata and, with
  // settled_cache, first K/V chunks read before the wait; the next launch triggered right after it).
  // Off gives the plain launch that pre-sm_90 devices and drivers refusing the attribute run; tests
  // use it to check both give bitwise the same results.
  bool decode_pdl = true;
  // TALLOW_DECODE_FILL: whether the prologue fills every pipeline slot (-1, default: with fewer
  // (token, kv head) rows than SMs; 0 never, 1 always). Tests force both sides for one shape.
  int64_t decode_fill = -1;
};

// The process's tuning: read from the environment at the first call, then what set_kernel_tuning set.
const KernelTuning& kernel_tuning();
// For the few setters that predate this struct (cuda::set_skinny_max_m, cuda::set_gemv_config).
KernelTuning& mutable_kernel_tuning();
// What the environment says now (the start-up values when it has not changed).
KernelTuning kernel_tuning_from_env();

// By name, for the bindings: the fields, their values and their variables.
using TuningValue = std::variant<bool, int64_t, std::string>;
struct TuningFieldInfo {
  std::string name;  // the KernelTuning member
  std::string env;   // its TALLOW_* variable ("" for the second half of a pair)
  std::string doc;
};
const std::vector<TuningFieldInfo>& kernel_tuning_fields();
TuningValue get_kernel_tuning(const std::string& name);  // ValueError for an unknown name
// TypeError for a value of the wrong type, ValueError for an unknown name or a value out of range.
void set_kernel_tuning(const std::string& name, const TuningValue& value);

}  // namespace tallow
