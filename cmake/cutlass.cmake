# CUTLASS/CuTe headers: the third_party/cutlass submodule, else the nvidia-cutlass wheel's
# copy (cutlass_library/source/include), else none (kernels that need CUTLASS are left out).
set(TALLOW_CUTLASS_INCLUDE_DIR "")
if(EXISTS ${PROJECT_SOURCE_DIR}/third_party/cutlass/include/cutlass/cutlass.h)
  set(TALLOW_CUTLASS_INCLUDE_DIR ${PROJECT_SOURCE_DIR}/third_party/cutlass/include)
else()
  find_package(Python 3.11 COMPONENTS Interpreter QUIET)
  if(Python_Interpreter_FOUND)
    execute_process(
      COMMAND ${Python_EXECUTABLE} -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))"
      OUTPUT_VARIABLE _wheel_inc OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE _rc)
    if(_rc EQUAL 0 AND EXISTS "${_wheel_inc}/cutlass/cutlass.h")
      set(TALLOW_CUTLASS_INCLUDE_DIR ${_wheel_inc})
    endif()
  endif()
endif()
if(TALLOW_CUTLASS_INCLUDE_DIR)
  list(APPEND TALLOW_CORE_DEFINITIONS TALLOW_WITH_CUTLASS=1)
else()
  message(STATUS "tallow: CUTLASS headers not found (third_party/cutlass is empty and the nvidia-cutlass "
                 "wheel is not installed); building without the kernels that need CUTLASS")
endif()
