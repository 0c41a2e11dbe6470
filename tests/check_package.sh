#!/usr/bin/env bash
# Installs the built prefire into a temporary prefix, then configures, builds
# and runs tests/package (find_package(prefire), prefire::prefire) against it.
#   check_package.sh BUILD_DIR PYTHON
set -euo pipefail
build_dir=$1
python=$2
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build_dir" --prefix "$tmp/prefix" >/dev/null
torch_prefix=$("$python" -W ignore -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null)
# torch's own CMake config wants the CUDA toolkit and an arch list named (see
# cmake/FindTorchFromPython.cmake); a consumer passes them the same way.
cmake -G Ninja -S "$here/package" -B "$tmp/build" -Wno-dev -DCMAKE_PREFIX_PATH="$tmp/prefix;$torch_prefix" \
  -DCUDA_TOOLKIT_ROOT_DIR=/usr/local/cuda -DTORCH_CUDA_ARCH_LIST=9.0 >"$tmp/configure.log" 2>&1 ||
  { cat "$tmp/configure.log"; exit 1; }
cmake --build "$tmp/build" >"$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; exit 1; }
"$tmp/build/consumer"
echo "find_package(prefire) consumer: OK"
