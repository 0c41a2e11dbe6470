#!/usr/bin/env bash
# The README's test command: installs what is missing, builds everything and
# runs the whole test suite (CPU tests always; CUDA tests skip without a GPU).
#
#   scripts/test.sh [ctest args]          build/, every test
#   scripts/test.sh --asan [ctest args]   build-asan/: ASan + UBSan + LSan, every test but the package
#                                         check (benchmarks are not built)
#   scripts/test.sh --tsan [ctest args]   build-tsan/: TSan with lock-order checking, the scheduling, offload,
#                                         concurrency and random-schedule tests
#   scripts/test.sh --torch X [ctest args]
#                                         build-torch-X/: against torch X (its venv, ~/.cache/prefire/venv-X,
#                                         made when missing), every test; the benchmarks are not built
#
# Why these sanitizer options, and what the sanitizers reported: tests/sanitizers/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=""
case "${1:-}" in
  --asan | --tsan) mode="${1#--}"; shift ;;
  --torch)
    [ $# -ge 2 ] || { echo "usage: $0 --torch RELEASE [ctest args]" >&2; exit 2; }
    mode=torch; export PREFIRE_TORCH_VERSION="$2"; shift 2 ;;
esac

filter=()
case "$mode" in
  "") build_dir="${PREFIRE_BUILD_DIR:-build}" ;;
  asan)
    build_dir="${PREFIRE_BUILD_DIR:-build-asan}"
    export PREFIRE_CMAKE_ARGS="${PREFIRE_CMAKE_ARGS:-} -DPREFIRE_SANITIZE=address -DPREFIRE_BUILD_BENCHMARKS=OFF"
    export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:protect_shadow_gap=0:strict_string_checks=1:detect_stack_use_after_return=1}"
    export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
    ;;
  tsan)
    build_dir="${PREFIRE_BUILD_DIR:-build-tsan}"
    export PREFIRE_CMAKE_ARGS="${PREFIRE_CMAKE_ARGS:-} -DPREFIRE_SANITIZE=thread -DPREFIRE_BUILD_BENCHMARKS=OFF -DPREFIRE_BUILD_APPS=OFF"
    export TSAN_OPTIONS="${TSAN_OPTIONS:-halt_on_error=1:detect_deadlocks=1:second_deadlock_stack=1:ignore_noninstrumented_modules=1}"
    export PREFIRE_STRESS_ITERATIONS="${PREFIRE_STRESS_ITERATIONS:-40}"
    # whole suite names: 'Offload' alone also matched plan arithmetic (Plan.*Offload*, one of which runs
    # past ctest's 120 s under TSan on 2 cores), threads in none of it
    filter=(-R '^([A-Za-z]+/)?(Concurrency|Schedule|ScheduleDeathTest|ScheduleEarlyStop|NestedSchedule|RandomSchedules|Offload|OffloadInputsOnly|CudaOffload)\.|^CheckpointGradients\.TwoThreads')
    ;;
  torch)
    build_dir="${PREFIRE_BUILD_DIR:-build-torch-$PREFIRE_TORCH_VERSION}"  # build.sh's for that release
    export PREFIRE_CMAKE_ARGS="${PREFIRE_CMAKE_ARGS:-} -DPREFIRE_BUILD_BENCHMARKS=OFF"
    ;;
esac

PREFIRE_BUILD_DIR="$build_dir" scripts/build.sh
ctest --test-dir "$build_dir" --output-on-failure -j "$(nproc)" "${filter[@]}" "$@"
