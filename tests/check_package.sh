#!/usr/bin/env bash
# Installs the built prefire into a temporary prefix, then configures, builds
# and runs the example consumer (examples/cpp-consumer: find_package(prefire),
# prefire::prefire) against it, with nothing but prefire's package config
# and CMAKE_PREFIX_PATH, torch found each way prefireTorch.cmake knows:
#   1. the `python3` on PATH (a venv's bin/ first), nothing else set;
#   2. Python3_EXECUTABLE;
#   3. prefire_TORCH_ROOT, at another location than the one prefire was built
#      against (a link to the same site-packages);
#   4./5. a LibTorch distribution's layout (include/, lib/, share/cmake/Torch,
#      a build-version file, no version.py), through Torch_DIR and through
#      CMAKE_PREFIX_PATH, with no Python (Python3_EXECUTABLE=/bin/false).
# None passes CUDA settings or has CUDA on PATH: a consumer of a CUDA build
# needs no toolkit.
#   check_package.sh BUILD_DIR PYTHON
set -euo pipefail
build_dir=$1
python=$2
example=$(cd "$(dirname "$0")/../examples/cpp-consumer" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build_dir" --prefix "$tmp/prefix" >/dev/null
if grep -rq "site-packages" "$tmp/prefix/lib/cmake/prefire/prefireTargets.cmake"; then
  echo "prefireTargets.cmake names a torch location:"; grep -n "site-packages" "$tmp/prefix/lib/cmake/prefire/prefireTargets.cmake"
  exit 1
fi
site=$("$python" -W ignore -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))' 2>/dev/null)
ln -s "$site" "$tmp/site-packages-elsewhere"

consumer() {  # NAME PATH_FIRST CMAKE_ARGS...
  local name=$1 path_first=$2; shift 2
  local path
  path="$(echo "$PATH" | tr ':' '\n' | grep -v cuda | grep -vxF "$(dirname "$python")" | paste -sd:)"
  [ -z "$path_first" ] || path="$path_first:$path"
  env -u CUDA_HOME -u CUDA_PATH PATH="$path" \
    cmake -G Ninja -S "$example" -B "$tmp/$name" -Wno-dev -DCMAKE_PREFIX_PATH="$tmp/prefix" "$@" \
    >"$tmp/$name.configure.log" 2>&1 || { cat "$tmp/$name.configure.log"; exit 1; }
  cmake --build "$tmp/$name" >"$tmp/$name.build.log" 2>&1 || { cat "$tmp/$name.build.log"; exit 1; }
  "$tmp/$name/consumer"
  echo "find_package(prefire) consumer, $name: OK"
}
consumer python3-on-path "$(dirname "$python")"
# With no torch to find, configuring fails and says what to set.
if PATH=/usr/bin:/bin cmake -G Ninja -S "$example" -B "$tmp/no-torch" -Wno-dev -DCMAKE_PREFIX_PATH="$tmp/prefix" \
    >"$tmp/no-torch.log" 2>&1; then
  echo "find_package(prefire) configured with no torch to find"; exit 1
fi
grep -q "prefire: no torch found" "$tmp/no-torch.log" || { cat "$tmp/no-torch.log"; exit 1; }
echo "find_package(prefire) consumer, no torch: a clear error"
consumer python3-executable "" -DPython3_EXECUTABLE="$python"
consumer torch-elsewhere "" -Dprefire_TORCH_ROOT="$tmp/site-packages-elsewhere/torch"
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
consumer libtorch-prefix-path "" -DCMAKE_PREFIX_PATH="$tmp/prefix;$tmp/libtorch" -DPython3_EXECUTABLE=/bin/false
consumer libtorch-torch-dir "" -DTorch_DIR="$tmp/libtorch/share/cmake/Torch" -DPython3_EXECUTABLE=/bin/false
