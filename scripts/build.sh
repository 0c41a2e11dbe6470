#!/usr/bin/env bash
# Installs what is missing (scripts/setup.sh), then configures and builds
# prefire with CMake + Ninja into $PREFIRE_BUILD_DIR (default: build/, or
# build-torch-X/ for PREFIRE_TORCH_VERSION=X other than the pinned release).
# Extra arguments go to the build step (e.g. --target prefire-bench); the
# Python package is built and copied into the venv either way.
set -euo pipefail
cd "$(dirname "$0")/.."
python=$(scripts/setup.sh --print-python)
# ccache: paths relative to the checkout, so clones in other folders (CI)
# hit the cache that earlier builds filled.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}" CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-true}"
# The pinned torch builds into build/, another (PREFIRE_TORCH_VERSION) into build-torch-X/.
if [ -n "${PREFIRE_TORCH_VERSION:-}" ] && [ "$PREFIRE_TORCH_VERSION" != "$(scripts/torch-releases.sh --pinned)" ]; then
  build_dir="${PREFIRE_BUILD_DIR:-build-torch-$PREFIRE_TORCH_VERSION}"
else
  build_dir="${PREFIRE_BUILD_DIR:-build}"
fi
cmake -G Ninja -S . -B "$build_dir" -Wno-dev \
  -DPREFIRE_PYTHON="$python" \
  -DCMAKE_BUILD_TYPE="${PREFIRE_BUILD_TYPE:-RelWithDebInfo}" \
  ${PREFIRE_CMAKE_ARGS:-} >/dev/null
# A build of chosen targets (scripts/run.sh) builds the Python package too.
extra=()
if [ $# -gt 0 ] && ninja -C "$build_dir" -t targets all 2>/dev/null | grep -q '^prefire_python:'; then
  extra=(--target prefire_python)
fi
cmake --build "$build_dir" "$@" "${extra[@]}"
# The Python package into the venv (a copy of <build>/python/prefire, no
# rebuild, in place of what an earlier build put there), so that `import
# prefire` works there; pip builds a wheel instead (README.md, "Python").
if [ -n "$(ls "$build_dir"/python/prefire/_C*.so 2>/dev/null)" ]; then
  site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
  rm -rf "$site/prefire"
  cmake --install "$build_dir" --component python --prefix "$site" >/dev/null
fi
