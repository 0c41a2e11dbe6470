#!/usr/bin/env bash
# The README's run command: installs what is missing, builds the prefire-bench
# program and runs it with the given arguments (see prefire-bench --help).
#
# scripts/run.sh --pipeline [ARGS]: builds the Python package and runs the
# pipeline program instead (apps/pipeline_bench: python -m pipeline_bench ARGS,
# see --help): torch.distributed.pipelining on processes of this machine, every
# mode. scripts/run.sh --simulate ARGS: its simulator (apps/pipeline_sim:
# python -m pipeline_sim ARGS) on the JSON the program wrote.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir="${PREFIRE_BUILD_DIR:-build}"
case "${1:-}" in
  --pipeline | --simulate)
    program=$([ "$1" = --pipeline ] && echo pipeline_bench || echo pipeline_sim)
    shift
    scripts/build.sh --target prefire_python >&2
    python=$(scripts/setup.sh --print-python)
    PYTHONPATH="$PWD/$build_dir/python:$PWD/apps${PYTHONPATH:+:$PYTHONPATH}" \
      exec "$python" -W ignore::UserWarning -m "$program" "$@"
    ;;
esac
scripts/build.sh --target prefire-bench >&2
exec "$build_dir/apps/prefire-bench/prefire-bench" "$@"
