#!/usr/bin/env bash
# The README's run command: installs what is missing, builds the prefire-bench
# program and runs it with the given arguments (see prefire-bench --help).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh --target prefire-bench >&2
build_dir="${PREFIRE_BUILD_DIR:-build}"
exec "$build_dir/apps/prefire-bench/prefire-bench" "$@"
