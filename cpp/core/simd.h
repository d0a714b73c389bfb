// Run-time choice of vector ISA for hot CPU kernels. TALLOW_SIMD_CLONES on a function makes the
// compiler emit an AVX-512, an AVX2+FMA and a baseline copy of it and pick one at load time from
// the CPU's features (GCC/Clang target_clones on x86-64 ELF). Elsewhere (Arm: NEON is baseline;
// macOS; MSVC) or with TALLOW_NATIVE it expands to nothing. Inner loops use `#pragma omp simd`
// (compiled with -fopenmp-simd, no OpenMP runtime) so reductions vectorise without -ffast-math.
#pragma once

#if !defined(TALLOW_NO_CLONES) && defined(__x86_64__) && defined(__ELF__) && \
    (defined(__GNUC__) || defined(__clang__)) && !defined(__APPLE__)
#define TALLOW_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TALLOW_SIMD_CLONES
#endif

#if defined(_MSC_VER) && !defined(__clang__)
#define TALLOW_PRAGMA_SIMD __pragma(omp simd)
#define TALLOW_RESTRICT __restrict
#else
#define TALLOW_PRAGMA_SIMD _Pragma("omp simd")
#define TALLOW_RESTRICT __restrict__
#endif
