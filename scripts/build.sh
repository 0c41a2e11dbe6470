#!/usr/bin/env bash
# Installs what is missing (scripts/setup.sh), then configures and builds
# prefire with CMake + Ninja into $PREFIRE_BUILD_DIR (default: build/).
# Extra arguments go to the build step (e.g. --target prefire-bench).
set -euo pipefail
cd "$(dirname "$0")/.."
python=$(scripts/setup.sh --print-python)
build_dir="${PREFIRE_BUILD_DIR:-build}"
cmake -G Ninja -S . -B "$build_dir" -Wno-dev \
  -DPREFIRE_PYTHON="$python" \
  -DCMAKE_BUILD_TYPE="${PREFIRE_BUILD_TYPE:-RelWithDebInfo}" \
  ${PREFIRE_CMAKE_ARGS:-} >/dev/null
cmake --build "$build_dir" "$@"
