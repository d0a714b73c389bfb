# CPU code generation. The wheel stays portable: hot kernels are compiled several times
# (x86-64-v4 / v3 / baseline, through target_clones) and the loader picks one at run time,
# so an older CPU never meets an illegal instruction. TALLOW_NATIVE=ON trades that for -march=native.
set(TALLOW_CPU_FLAGS "")
set(TALLOW_WARNING_FLAGS "")
set(TALLOW_CORE_DEFINITIONS "")
if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
  list(APPEND TALLOW_WARNING_FLAGS -Wall -Wextra -Wno-unused-parameter)
  list(APPEND TALLOW_CPU_FLAGS ${TALLOW_WARNING_FLAGS} -O3 -fno-math-errno -fopenmp-simd)
  if(TALLOW_NATIVE)
    list(APPEND TALLOW_CPU_FLAGS -march=native)
    list(APPEND TALLOW_CORE_DEFINITIONS TALLOW_NO_CLONES=1)
  endif()
elseif(MSVC)
  list(APPEND TALLOW_CPU_FLAGS /O2 /openmp:experimental)
endif()
