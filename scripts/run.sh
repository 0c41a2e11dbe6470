#!/usr/bin/env bash
# The README's run command: installs what is missing, builds the prefire-bench
# program and runs it with the given arguments (see prefire-bench --help).
#
# scripts/run.sh --pipeline [ARGS]: builds the Python package and runs the
# pipeline program instead, python -m prefire.pipeline_bench ARGS (see --help):
# torch.distributed.pipelining on processes of this machine, every mode.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir="${PREFIRE_BUILD_DIR:-build}"
if [ "${1:-}" = "--pipeline" ]; then
  shift
  scripts/build.sh --target prefire_python >&2
  python=$(scripts/setup.sh --print-python)
  PYTHONPATH="$PWD/$build_dir/python${PYTHONPATH:+:$PYTHONPATH}" exec "$python" -W ignore::UserWarning -m prefire.pipeline_bench "$@"
fi
scripts/build.sh --target prefire-bench >&2
exec "$build_dir/apps/prefire-bench/prefire-bench" "$@"
