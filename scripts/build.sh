#!/usr/bin/env bash
# Installs what is missing (scripts/setup.sh), then configures and builds
# prefire with CMake + Ninja into $PREFIRE_BUILD_DIR (default: build/).
# Extra arguments go to the build step (e.g. --target prefire-bench).
set -euo pipefail
cd "$(dirname "$0")/.."
python=$(scripts/setup.sh --print-python)
# ccache: paths relative to the checkout, so clones in other folders (CI)
# hit the cache that earlier builds filled.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}" CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-true}"
build_dir="${PREFIRE_BUILD_DIR:-build}"
cmake -G Ninja -S . -B "$build_dir" -Wno-dev \
  -DPREFIRE_PYTHON="$python" \
  -DCMAKE_BUILD_TYPE="${PREFIRE_BUILD_TYPE:-RelWithDebInfo}" \
  ${PREFIRE_CMAKE_ARGS:-} >/dev/null
cmake --build "$build_dir" "$@"
