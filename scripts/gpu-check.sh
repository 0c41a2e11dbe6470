#!/usr/bin/env bash
# GPU verification of prefire's CUDA runtime and of the Python package on a
# GPU machine (docs/cuda.md, "Verifying on a GPU").
#
#   scripts/gpu-check.sh --prepare
#       Here, on a CPU machine: copies what the GPU machine lacks into
#       .gpu-deps/ (git-ignored): GoogleTest's sources (Debian's googletest
#       package), Google Benchmark's headers, library and CMake config
#       (Debian's libbenchmark-dev, libbenchmark1debian), and the headers and
#       CMake configs of CLI11 (libcli11-dev) and nlohmann-json
#       (nlohmann-json3-dev).
#   scripts/gpu-check.sh
#       On the GPU machine (device tool, carry=[".gpu-deps"]): builds for
#       sm_90 against that machine's torch, then runs, in this order, each
#       stage under its own time limit and all of them within one budget
#       (PREFIRE_GPU_CHECK_SECONDS after the build, default 450; a stage
#       the budget no longer fits is reported as not run):
#         * the crash capture's own test (tests/native_frames);
#         * the C++ CUDA tests;
#         * the Python tests that touch CUDA or crashed on the GPU machine,
#           a file a stage, and the Python GPU benchmark (the offload one),
#           each under the crash capture: native_frames preloaded and
#           faulthandler on, so that a crash leaves faulthandler's Python
#           frames and the native frames in the stage's log, resolved to
#           functions and lines (tests/native_frames/resolve.py); a stage
#           that crashed runs once more with CUDA_VISIBLE_DEVICES= (no GPU
#           visible), to tell a GPU-only cause from the rest;
#         * the overlap and saved-tensor benchmarks, prefire-bench on CUDA
#           with and without the session pool;
#         * compute-sanitizer memcheck over the CUDA tests and racecheck over
#           the checksum kernel's, where installed;
#         * the whole suite (ctest).
#       What it prints goes to $OUT/gpu-check.log (default out/gpu-check); the
#       other outputs are packed into $OUT/outputs.tgz at the end (the device
#       tool brings back at most 8 files).
#       PREFIRE_GPU_CHECK_ALLOW_CPU=1 rehearses it on a CPU machine;
#       PREFIRE_GPU_CHECK_FAULT=1 adds a Python stage that faults on purpose
#       (a throwaway script), to see a crash's report and its rerun.
set -uo pipefail
cd "$(dirname "$0")/.."
deps=.gpu-deps
if [ "${1:-}" = "--prepare" ]; then
  set -e
  scripts/setup.sh >/dev/null
  [ -d /usr/src/googletest ] || { apt-get update -qq && apt-get install -y -qq googletest >/dev/null; }
  rm -rf "$deps" && mkdir -p "$deps/benchmark" "$deps/cli11" "$deps/json"
  cp -r /usr/src/googletest "$deps/googletest"
  (cd "$deps" && apt-get download -qq libbenchmark-dev libbenchmark1debian libcli11-dev nlohmann-json3-dev >/dev/null 2>&1)
  for deb in "$deps"/libbenchmark*.deb; do dpkg -x "$deb" "$deps/benchmark"; done
  dpkg -x "$deps"/libcli11-dev*.deb "$deps/cli11"
  dpkg -x "$deps"/nlohmann-json3-dev*.deb "$deps/json"
  rm -f "$deps"/*.deb
  du -sh "$deps"
  exit 0
fi

out="${OUT:-out/gpu-check}"
res="$out/outputs"
mkdir -p "$res"
log="$out/gpu-check.log"
exec > >(tee "$log") 2>&1
status=0
budget="${PREFIRE_GPU_CHECK_SECONDS:-450}"
deadline=""  # set once the build is done
# stage NAME SECONDS CMD...: runs CMD with a time limit (no more than the
# budget has left), its output into the file $STAGE_LOG where that is set,
# records a failure.
stage() {
  local name=$1 limit=$2; shift 2
  local t=$(date +%s)
  if [ -n "$deadline" ]; then
    local left=$(( deadline - t ))
    if [ "$left" -lt 15 ]; then echo "== $name: not run, the budget of ${budget} s is spent"; status=1; return 1; fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  echo "== $name (limit ${limit} s)"
  if [ -n "${STAGE_LOG:-}" ]; then timeout -k 5 "$limit" "$@" >"$STAGE_LOG" 2>&1; else timeout -k 5 "$limit" "$@"; fi
  local rc=$?
  echo "== $name: exit $rc in $(( $(date +%s) - t )) s"
  [ $rc -eq 0 ] || status=1
  return $rc
}
# crashed LOG: whether a process in LOG died of a fatal signal (faulthandler's or native_frames' report).
crashed() { grep -q -E "^Fatal Python error|^== native frames" "$1"; }
# python_stage NAME SECONDS ARGS...: the stage python ARGS under the crash
# capture (the header above), its output in $res/NAME.log (the last lines
# shown here); after a crash, the report resolved and the stage again
# without a visible GPU.
python_stage() {
  local name=$1 limit=$2; shift 2
  local stage_log="$res/${name// /_}.log"
  local captured=(env PYTHONPATH="$build/python:$PWD/apps" LD_PRELOAD="$native_frames" PYTHONUNBUFFERED=1
                  "$python" -X faulthandler "$@")
  STAGE_LOG="$stage_log" stage "$name" "$limit" "${captured[@]}"
  tail -3 "$stage_log"
  if crashed "$stage_log"; then
    echo "-- $name crashed: Python frames in $stage_log; native frames:"
    grep -m 3 -E "^Fatal Python error|^Current thread|^Thread 0x" "$stage_log"
    "$python" tests/native_frames/resolve.py "$stage_log" | tee "${stage_log%.log}.frames" | head -40
    local nogpu_log="${stage_log%.log}-nogpu.log"
    STAGE_LOG="$nogpu_log" stage "$name, no GPU visible" "$limit" env CUDA_VISIBLE_DEVICES= "${captured[@]}"
    tail -3 "$nogpu_log"
    if crashed "$nogpu_log"; then
      echo "-- $name crashed without a GPU too: not a GPU-only cause"
      "$python" tests/native_frames/resolve.py "$nogpu_log" >"${nogpu_log%.log}.frames"
    else
      echo "-- $name did not crash without a GPU: a GPU-only cause"
    fi
  fi
}
pack() { tar czf "$out/outputs.tgz" -C "$out" outputs && rm -rf "$res"; }
trap 'echo "== gpu-check exit $status"; pack' EXIT

echo "== gpu-check $(date -u +%FT%TZ)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python="${PREFIRE_PYTHON:-$(command -v python3)}"
"$python" -VV
"$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available())'
"$python" -m pip list 2>/dev/null | grep -i -E "^(torch|numpy|pybind11|pytest|transformers|triton) " | tr -s ' ' | paste -sd';'
if ! "$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' && [ -z "${PREFIRE_GPU_CHECK_ALLOW_CPU:-}" ]; then
  echo "no GPU visible to torch: stopping"; status=1; exit 1
fi

bench_dir=$(ls -d "$PWD/$deps"/benchmark/usr/lib/*/cmake/benchmark 2>/dev/null | head -1)
export LD_LIBRARY_PATH="$(dirname "$(dirname "${bench_dir:-/x/x}")"):${LD_LIBRARY_PATH:-}"
build=build-gpu
t0=$(date +%s)
cmake -G Ninja -S . -B "$build" -Wno-dev -DCMAKE_BUILD_TYPE=Release \
  -DPREFIRE_PYTHON="$python" -DPREFIRE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DPREFIRE_GTEST_SOURCE_DIR="$PWD/$deps/googletest" \
  -DCLI11_DIR="$PWD/$deps/cli11/usr/share/cmake/CLI11" \
  -Dnlohmann_json_DIR="$PWD/$deps/json/usr/share/cmake/nlohmann_json" \
  ${bench_dir:+-Dbenchmark_DIR="$bench_dir"} >"$res/configure.log" 2>&1 || { tail -40 "$res/configure.log"; status=1; exit 1; }
cmake --build "$build" >"$res/build.log" 2>&1 || { grep -E "error|FAILED" "$res/build.log" | head -40; status=1; exit 1; }
echo "== built in $(( $(date +%s) - t0 )) s; the stages have ${budget} s"
deadline=$(( $(date +%s) + budget ))
native_frames="$PWD/$build/tests/libprefire_native_frames.so"
# The pybind11 the extension compiled against (torch's own, or another that reached the build), and the
# internals ids of the extension and of torch's Python bindings, which must agree for them to share objects.
so=$(ls "$build"/python/prefire/_C*.so)
echo "pybind11 header: $(ninja -C "$build" -t deps python/CMakeFiles/prefire_python.dir/src/module.cpp.o |
  grep -m1 -o '[^ ]*/pybind11/pybind11.h')"
torch_python=$("$python" -c 'import torch, os; print(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_python.so"))')
echo "pybind11 internals: prefire._C $(strings -a "$so" | grep -o '__pybind11_internals_v[^ ]*' | sort -u | paste -sd' ')," \
  "torch $(strings -a "$torch_python" | grep -o '__pybind11_internals_v[^ ]*' | sort -u | paste -sd' ')"

stage "crash capture" 60 ctest --test-dir "$build" -R '^NativeFrames\.' --output-on-failure
tests="$build/tests/prefire_tests"
stage "CUDA tests" 120 "$tests" --gtest_filter='Cuda*' --gtest_output=json:"$res/cuda_tests.json"
if [ -n "${PREFIRE_GPU_CHECK_FAULT:-}" ]; then
  printf 'import ctypes, threading\nlib = ctypes.CDLL(%s)\nt = threading.Thread(target=lib.prefire_native_frames_deliberate_fault)\nt.start(); t.join()\n' \
    "'$native_frames'" >"$res/deliberate_fault.py"
  python_stage "deliberate fault" 30 "$res/deliberate_fault.py"
fi
# Python tests that touch CUDA (schedule: the prefire stream; offload: the pinned tier; allocator) and the
# core files that crashed on the GPU machine (checkpoint, torch_contract), a file a stage.
for file in checkpoint torch_contract schedule offload allocator; do
  python_stage "python test_$file" 90 -m pytest -q -p no:cacheprovider -W ignore::UserWarning -rfEs \
    --junitxml="$res/test_$file.xml" "tests/python/test_$file.py"
done
python_stage "offload benchmark" 120 benchmarks/python_offload_gpu.py --json "$res/offload_gpu.json"
stage "overlap benchmark" 90 "$build/benchmarks/prefire_overlap_benchmark" \
  --benchmark_out="$res/overlap.json" --benchmark_out_format=json
stage "prefire-bench on CUDA" 90 "$build/apps/prefire-bench/prefire-bench" --device cuda --json "$res/prefire-bench.json"
stage "prefire-bench on CUDA, session pool" 90 "$build/apps/prefire-bench/prefire-bench" --device cuda --session-pool \
  --json "$res/prefire-bench-pool.json"
stage "saved-tensor benchmark" 60 "$build/benchmarks/prefire_saved_tensor_benchmark" \
  --benchmark_out="$res/saved_tensor.json" --benchmark_out_format=json
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
if [ -n "$sanitizer" ]; then
  # memcheck over every CUDA test; racecheck (shared-memory races) over the
  # tests that launch prefire's own kernel (CUB's block reduction).
  stage "compute-sanitizer memcheck" 150 "$sanitizer" --tool memcheck --error-exitcode 3 \
    "$tests" --gtest_filter='Cuda*'
  stage "compute-sanitizer racecheck" 90 "$sanitizer" --tool racecheck --error-exitcode 3 \
    "$tests" --gtest_filter='Cuda.Checksum*'
else
  echo "== compute-sanitizer: not installed, skipped"
fi
# The rest of the suite (the Python files above ran in their own stages).
stage "whole suite" 240 ctest --test-dir "$build" -j 8 --output-on-failure --timeout 120 -O "$res/ctest.log" \
  -E '^(NativeFrames\..*|Python\.test_(checkpoint|torch_contract|schedule|offload|allocator))$'
tail -4 "$res/ctest.log" 2>/dev/null
exit $status
