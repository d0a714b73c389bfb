# TALLOW_CUDA: AUTO builds the CUDA backend when nvcc and cuBLAS are found; ON requires them; OFF skips it.
# cuBLAS/cuBLASLt come from the CUDA toolkit or, when the toolkit has none, from the nvidia-cublas
# wheel (pip install nvidia-cublas; its headers and libraries sit in site-packages/nvidia/cu13).
# TALLOW_CUBLAS_ROOT=<dir with include/cublasLt.h and lib/libcublasLt.so*> picks a copy by hand.
set(TALLOW_WITH_CUDA OFF)
if(NOT TALLOW_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(TALLOW_WITH_CUDA ON)
  elseif(TALLOW_CUDA STREQUAL "ON")
    message(FATAL_ERROR "TALLOW_CUDA=ON but no CUDA compiler (nvcc) was found; set CMAKE_CUDA_COMPILER or TALLOW_CUDA=OFF")
  else()
    message(STATUS "tallow: nvcc not found, building the CPU-only package")
  endif()
endif()

# Finds cuBLAS in a wheel (or TALLOW_CUBLAS_ROOT) and defines tallow_cublas / tallow_cublasLt.
function(_tallow_cublas_from_wheel out_found)
  set(_roots "")
  if(TALLOW_CUBLAS_ROOT)
    list(APPEND _roots ${TALLOW_CUBLAS_ROOT})
  endif()
  find_package(Python 3.11 COMPONENTS Interpreter QUIET)
  if(Python_Interpreter_FOUND)
    execute_process(
      COMMAND ${Python_EXECUTABLE} -c
        "import importlib.util as u, os\ns = u.find_spec('nvidia')\nfor p in (s.submodule_search_locations if s else []):\n  for sub in ('cu13', 'cublas', 'cu12'):\n    d = os.path.join(p, sub)\n    if os.path.exists(os.path.join(d, 'include', 'cublasLt.h')): print(d)"
      OUTPUT_VARIABLE _wheel_roots OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    string(REPLACE "\n" ";" _wheel_roots "${_wheel_roots}")
    list(APPEND _roots ${_wheel_roots})
  endif()
  foreach(_r ${_roots})
    file(GLOB _blas "${_r}/lib/libcublas.so*")
    file(GLOB _blaslt "${_r}/lib/libcublasLt.so*")
    if(_blas AND _blaslt AND EXISTS "${_r}/include/cublasLt.h")
      list(SORT _blas)
      list(SORT _blaslt)
      list(GET _blas 0 _blas)
      list(GET _blaslt 0 _blaslt)
      foreach(_t cublas cublasLt)
        add_library(tallow_${_t} SHARED IMPORTED GLOBAL)
        set_target_properties(tallow_${_t} PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${_r}/include")
      endforeach()
      set_target_properties(tallow_cublas PROPERTIES IMPORTED_LOCATION "${_blas}")
      set_target_properties(tallow_cublasLt PROPERTIES IMPORTED_LOCATION "${_blaslt}")
      set(TALLOW_CUBLAS_LIBDIR "${_r}/lib" PARENT_SCOPE)
      message(STATUS "tallow: cuBLAS from ${_r}")
      set(${out_found} ON PARENT_SCOPE)
      return()
    endif()
  endforeach()
  set(${out_found} OFF PARENT_SCOPE)
endfunction()

if(TALLOW_WITH_CUDA)
  if(NOT DEFINED TALLOW_CUDA_ARCHS)
    set(TALLOW_CUDA_ARCHS "80;86;89;90")
  endif()
  set(CMAKE_CUDA_ARCHITECTURES ${TALLOW_CUDA_ARCHS})
  enable_language(CUDA)
  find_package(CUDAToolkit)
  set(_have_cublas OFF)
  if(TARGET CUDA::cublas AND TARGET CUDA::cublasLt AND NOT TALLOW_CUBLAS_ROOT)
    add_library(tallow_cublas INTERFACE)
    target_link_libraries(tallow_cublas INTERFACE CUDA::cublas)
    add_library(tallow_cublasLt INTERFACE)
    target_link_libraries(tallow_cublasLt INTERFACE CUDA::cublasLt)
    set(TALLOW_CUBLAS_LIBDIR "${CUDAToolkit_LIBRARY_DIR}")
    set(_have_cublas ON)
  else()
    _tallow_cublas_from_wheel(_have_cublas)
  endif()
  if(NOT _have_cublas)
    if(TALLOW_CUDA STREQUAL "ON")
      message(FATAL_ERROR "TALLOW_CUDA=ON but cuBLAS/cuBLASLt were found neither next to nvcc nor in an "
                          "nvidia-cublas wheel (pip install nvidia-cublas) nor in TALLOW_CUBLAS_ROOT")
    endif()
    message(STATUS "tallow: nvcc found but cuBLAS is missing (pip install nvidia-cublas to add it); "
                   "building the CPU-only package")
    set(TALLOW_WITH_CUDA OFF)
  else()
    list(APPEND TALLOW_CORE_DEFINITIONS TALLOW_WITH_CUDA=1)
    # Build-tree binaries find cuBLAS where it was linked from; the installed extension's RUNPATH is
    # relative (CMakeLists.txt, next to install(TARGETS _core)).
    list(APPEND CMAKE_BUILD_RPATH "${TALLOW_CUBLAS_LIBDIR}")
  endif()
endif()

# Adds cuda/ (*.cu kernels and *.cpp runtime) to a target. They are compiled as an object library
# with flags of their own (the CPU flags are not nvcc's) and linked into the target. cuda/ includes
# cpp/ (core/tensor.h, core/backend.h, ...), never the other way: the target does not get cuda/ on its
# include path, and the ops reach the kernels through the op table cuda::init() registers.
function(tallow_add_cuda_sources target)
  file(GLOB_RECURSE _cu CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/cuda/*.cu ${PROJECT_SOURCE_DIR}/cuda/*.cpp)
  list(FILTER _cu EXCLUDE REGEX "/cuda/python/")  # the Python bindings go into the extension (CMakeLists.txt)
  add_library(tallow_cuda OBJECT ${_cu})
  # The quantizers (cpp/ops/quantize_block.h) must not fuse a*b+c: bit-identical with the CPU op.
  set_source_files_properties(${PROJECT_SOURCE_DIR}/cuda/quantize.cu PROPERTIES COMPILE_OPTIONS -fmad=false)
  set_target_properties(tallow_cuda PROPERTIES CUDA_STANDARD 17 CUDA_STANDARD_REQUIRED ON
                                               POSITION_INDEPENDENT_CODE ON)
  target_include_directories(tallow_cuda PUBLIC ${PROJECT_SOURCE_DIR}/cpp ${PROJECT_SOURCE_DIR}/cuda)
  target_compile_definitions(tallow_cuda PUBLIC ${TALLOW_CORE_DEFINITIONS})
  # ${CMAKE_DL_LIBS}: dlopen of libnccl (cuda/nccl.cpp) on a glibc older than 2.34
  target_link_libraries(tallow_cuda PUBLIC CUDA::cudart_static tallow_cublas tallow_cublasLt ${CMAKE_DL_LIBS})
  target_compile_options(tallow_cuda PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:-O3 --expt-relaxed-constexpr -lineinfo -Xcompiler=-Wall>
    $<$<COMPILE_LANGUAGE:CXX>:-O2 -Wall -Wextra -Wno-unused-parameter>)
  target_sources(${target} PRIVATE $<TARGET_OBJECTS:tallow_cuda>)
  target_link_libraries(${target} PUBLIC CUDA::cudart_static tallow_cublas tallow_cublasLt)
endfunction()

# Benchmarks written in Python (benchmarks/bench_cuda.py: copy, GEMM vs torch, norm/rope/activation
# bandwidth) join `ctest -L bench`; registered at the end of the top-level directory, once the
# Python interpreter and the test switch are known.
function(_tallow_cuda_register_python_benches)
  if(TALLOW_WITH_CUDA AND TALLOW_BUILD_TESTS AND Python_EXECUTABLE)
    add_test(NAME bench_cuda_ops COMMAND ${Python_EXECUTABLE} ${PROJECT_SOURCE_DIR}/benchmarks/bench_cuda.py)
    set_tests_properties(bench_cuda_ops PROPERTIES LABELS bench RUN_SERIAL ON
      ENVIRONMENT "PYTHONPATH=${CMAKE_BINARY_DIR}/python:${PROJECT_SOURCE_DIR}/python")
  endif()
endfunction()
cmake_language(DEFER DIRECTORY ${CMAKE_SOURCE_DIR} CALL _tallow_cuda_register_python_benches)
