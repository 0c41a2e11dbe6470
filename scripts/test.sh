#!/usr/bin/env bash
# The README's test command: installs what is missing, builds everything and
# runs the whole test suite (CPU tests always; CUDA tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
build_dir="${PREFIRE_BUILD_DIR:-build}"
ctest --test-dir "$build_dir" --output-on-failure -j "$(nproc)" "$@"
