# Finds LibTorch inside the `torch` Python wheel.
#
# Input:  PREFIRE_PYTHON (cache) - the interpreter whose torch to use; default
#         ~/.cache/prefire/venv/bin/python, the environment scripts/setup.sh makes.
# Output: PREFIRE_TORCH_LIBRARIES - what to link (TORCH_LIBRARIES less entries
#         torch's config could not resolve, e.g. nvrtc, which prefire never uses)
#         PREFIRE_TORCH_HAS_CUDA  - whether that torch is a CUDA build
#         PREFIRE_TORCH_RELEASE   - its version without the local part (+cu130)
#         PREFIRE_TORCH_CXX11_ABI - the _GLIBCXX_USE_CXX11_ABI it was built with
#         PREFIRE_TORCH_VERSION
if(DEFINED SKBUILD AND DEFINED Python3_EXECUTABLE)  # pip building the wheel: its interpreter's torch
  set(_prefire_default_python "${Python3_EXECUTABLE}")
else()
  set(_prefire_default_python "$ENV{HOME}/.cache/prefire/venv/bin/python")
endif()
set(PREFIRE_PYTHON "${_prefire_default_python}" CACHE FILEPATH "Python interpreter with torch installed")
if(NOT EXISTS "${PREFIRE_PYTHON}")
  message(FATAL_ERROR "PREFIRE_PYTHON=${PREFIRE_PYTHON} does not exist: run scripts/setup.sh first (or pass -DPREFIRE_PYTHON=...)")
endif()
execute_process(
  COMMAND "${PREFIRE_PYTHON}" -W ignore -c "import torch; print(torch.utils.cmake_prefix_path); print(torch.__version__); print(int(torch.version.cuda is not None)); print(int(torch._C._GLIBCXX_USE_CXX11_ABI))"
  OUTPUT_VARIABLE _prefire_torch_info
  RESULT_VARIABLE _prefire_torch_rc
  ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _prefire_torch_rc EQUAL 0)
  message(FATAL_ERROR "${PREFIRE_PYTHON} cannot import torch: run scripts/setup.sh")
endif()
string(REPLACE "\n" ";" _prefire_torch_info "${_prefire_torch_info}")
list(GET _prefire_torch_info 0 _prefire_torch_prefix)
list(GET _prefire_torch_info 1 PREFIRE_TORCH_VERSION)
list(GET _prefire_torch_info 2 PREFIRE_TORCH_HAS_CUDA)
list(GET _prefire_torch_info 3 PREFIRE_TORCH_CXX11_ABI)
string(REGEX REPLACE "\\+.*" "" PREFIRE_TORCH_RELEASE "${PREFIRE_TORCH_VERSION}")  # 2.14.1+cu130 -> 2.14.1
list(APPEND CMAKE_PREFIX_PATH "${_prefire_torch_prefix}")

# Caffe2's config looks for the toolkit through the old FindCUDA module.
if(PREFIRE_TORCH_HAS_CUDA AND NOT CUDA_TOOLKIT_ROOT_DIR AND EXISTS /usr/local/cuda)
  set(CUDA_TOOLKIT_ROOT_DIR /usr/local/cuda)
endif()
# Caffe2's config otherwise probes the GPUs with a try_run that fails under
# C++20; prefire's own kernels use CMAKE_CUDA_ARCHITECTURES, not this list.
if(PREFIRE_TORCH_HAS_CUDA AND NOT TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(TORCH_CUDA_ARCH_LIST "9.0")
endif()
# torch's config warns about optional libraries prefire does not use (kineto,
# nvrtc), enables CUDA with nvcc's default architecture and overwrites
# CMAKE_CUDA_ARCHITECTURES with OFF; keep all of that away. prefire's kernels
# build for the architectures the caller names (scripts/gpu-check.sh: 90), by
# default Ampere and Hopper machine code plus PTX for later GPUs.
set(_prefire_saved_log_level "${CMAKE_MESSAGE_LOG_LEVEL}")
set(CMAKE_MESSAGE_LOG_LEVEL ERROR)
if(DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(_prefire_cuda_archs "${CMAKE_CUDA_ARCHITECTURES}")
  unset(CMAKE_CUDA_ARCHITECTURES)
  unset(CMAKE_CUDA_ARCHITECTURES CACHE)
endif()
find_package(Torch REQUIRED)
unset(CMAKE_CUDA_ARCHITECTURES)
if(NOT DEFINED _prefire_cuda_archs)
  set(_prefire_cuda_archs "80-real;90-real;90-virtual")
endif()
set(CMAKE_CUDA_ARCHITECTURES "${_prefire_cuda_archs}" CACHE STRING "CUDA architectures for prefire's kernels" FORCE)
set(CMAKE_MESSAGE_LOG_LEVEL "${_prefire_saved_log_level}")

set(PREFIRE_TORCH_LIBRARIES ${TORCH_LIBRARIES})
list(FILTER PREFIRE_TORCH_LIBRARIES EXCLUDE REGEX "NOTFOUND$")
message(STATUS "prefire: torch ${PREFIRE_TORCH_VERSION} (CUDA build: ${PREFIRE_TORCH_HAS_CUDA}) from ${_prefire_torch_prefix}")
