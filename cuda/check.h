// Return-code checks for CUDA runtime and cuBLAS calls. Every failure becomes a C++ exception
// (std::runtime_error, RuntimeError in Python) whose message names the op, the failing call, the
// CUDA error and the source line; out-of-memory says how much was asked for and what is held.
#pragma once
#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

namespace tallow::cuda {

struct CudaError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] void throw_cuda_error(const char* op, const char* expr, cudaError_t err, const char* file, int line);
[[noreturn]] void throw_cublas_error(const char* op, const char* expr, int status, const char* file, int line);

}  // namespace tallow::cuda

#define TALLOW_CUDA_CHECK(op, expr)                                                          \
  do {                                                                                       \
    const cudaError_t tallow_err_ = (expr);                                                  \
    if (tallow_err_ != cudaSuccess)                                                          \
      ::tallow::cuda::throw_cuda_error((op), #expr, tallow_err_, __FILE__, __LINE__);        \
  } while (0)

// After a kernel launch: launch-configuration errors (and sticky errors of earlier work).
#define TALLOW_CUDA_CHECK_LAUNCH(op) TALLOW_CUDA_CHECK((op), cudaGetLastError())

#define TALLOW_CUBLAS_CHECK(op, expr)                                                        \
  do {                                                                                       \
    const int tallow_st_ = (int)(expr);                                                      \
    if (tallow_st_ != 0) ::tallow::cuda::throw_cublas_error((op), #expr, tallow_st_, __FILE__, __LINE__); \
  } while (0)
