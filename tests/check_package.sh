#!/usr/bin/env bash
# Installs the built prefire into a temporary prefix, then configures, builds
# and runs tests/package (find_package(prefire), prefire::prefire) against it,
# as a consumer with nothing but prefire's package config:
#   1. torch found through an interpreter (Python3_EXECUTABLE);
#   2. torch at another location than the one prefire was built against
#      (prefire_TORCH_ROOT through a link to the same site-packages);
#   3./4. a LibTorch distribution's layout (include/, lib/, share/cmake/Torch,
#      a build-version file, no version.py) found the way LibTorch is found,
#      through CMAKE_PREFIX_PATH and through Torch_DIR, with no Python.
# Neither passes CUDA settings: a consumer of a CUDA build needs no toolkit.
#   check_package.sh BUILD_DIR PYTHON
set -euo pipefail
build_dir=$1
python=$2
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build_dir" --prefix "$tmp/prefix" >/dev/null
if grep -rq "site-packages" "$tmp/prefix/lib/cmake/prefire/prefireTargets.cmake"; then
  echo "prefireTargets.cmake names a torch location:"; grep -n "site-packages" "$tmp/prefix/lib/cmake/prefire/prefireTargets.cmake"
  exit 1
fi
site=$("$python" -W ignore -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))' 2>/dev/null)
ln -s "$site" "$tmp/site-packages-elsewhere"

consumer() {  # NAME CMAKE_ARGS...
  local name=$1; shift
  env -u CUDA_HOME -u CUDA_PATH PATH="$(echo "$PATH" | tr ':' '\n' | grep -v cuda | paste -sd:)" \
    cmake -G Ninja -S "$here/package" -B "$tmp/$name" -Wno-dev -DCMAKE_PREFIX_PATH="$tmp/prefix" "$@" \
    >"$tmp/$name.configure.log" 2>&1 || { cat "$tmp/$name.configure.log"; exit 1; }
  cmake --build "$tmp/$name" >"$tmp/$name.build.log" 2>&1 || { cat "$tmp/$name.build.log"; exit 1; }
  "$tmp/$name/consumer"
  echo "find_package(prefire) consumer, $name: OK"
}
consumer via-python -DPython3_EXECUTABLE="$python"
consumer torch-elsewhere -Dprefire_TORCH_ROOT="$tmp/site-packages-elsewhere/torch"
# Made of the wheel's files: a LibTorch zip bundles the NVIDIA libraries in
# lib/, the wheel's libraries find theirs at $ORIGIN/../../nvidia, so that
# directory sits beside the tree; its CUDA runtime goes into lib/ as LibTorch's.
mkdir -p "$tmp/libtorch/lib"
for d in include share; do ln -s "$site/torch/$d" "$tmp/libtorch/$d"; done
for f in "$site"/torch/lib/*; do ln -s "$f" "$tmp/libtorch/lib/"; done
if [ -d "$site/nvidia" ]; then
  ln -s "$site/nvidia" "$tmp/nvidia"
  for f in "$site"/nvidia/cu*/lib/libcudart.so.*; do [ -e "$f" ] && ln -sf "$f" "$tmp/libtorch/lib/libcudart-bundled.so"; done
fi
"$python" -W ignore -c 'import torch; print(torch.__version__)' > "$tmp/libtorch/build-version" 2>/dev/null
consumer libtorch-prefix-path -DCMAKE_PREFIX_PATH="$tmp/prefix;$tmp/libtorch" -DPython3_EXECUTABLE=/bin/false
consumer libtorch-torch-dir -DTorch_DIR="$tmp/libtorch/share/cmake/Torch" -DPython3_EXECUTABLE=/bin/false
