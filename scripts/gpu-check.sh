#!/usr/bin/env bash
# GPU verification of prefire's CUDA runtime (docs/cuda.md, "Verifying on a GPU").
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
#       sm_90 against that machine's torch, runs the test suite (the CUDA
#       tests run there, then again under compute-sanitizer when it is
#       installed: memcheck over all of them, racecheck over the checksum
#       kernel's), the overlap and unpack benchmarks, prefire-bench on CUDA
#       with and without the session pool, the offload benchmark (one GPT
#       block offloaded to pinned host memory against keeping it), and the
#       whole suite last. Every stage has a
#       time limit, so one that hangs costs only its own minutes. What it
#       prints goes to $OUT/gpu-check.log (default out/gpu-check); the other
#       outputs are packed into $OUT/outputs.tgz at the end (the device tool
#       brings back at most 8 files).
#       Set PREFIRE_GPU_CHECK_ALLOW_CPU=1 to rehearse it on a CPU machine.
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
# stage NAME SECONDS CMD...: runs CMD with a time limit, records a failure.
stage() {
  local name=$1 limit=$2; shift 2
  local t=$(date +%s)
  echo "== $name (limit ${limit} s)"
  timeout -k 5 "$limit" "$@"
  local rc=$?
  echo "== $name: exit $rc in $(( $(date +%s) - t )) s"
  [ $rc -eq 0 ] || status=1
}
pack() { tar czf "$out/outputs.tgz" -C "$out" outputs && rm -rf "$res"; }
trap 'echo "== gpu-check exit $status"; pack' EXIT

echo "== gpu-check $(date -u +%FT%TZ)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python="${PREFIRE_PYTHON:-$(command -v python3)}"
"$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available())'
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
echo "== built in $(( $(date +%s) - t0 )) s"

tests="$build/tests/prefire_tests"
stage "CUDA tests" 120 "$tests" --gtest_filter='Cuda*' --gtest_output=json:"$res/cuda_tests.json"
stage "overlap benchmark" 90 "$build/benchmarks/prefire_overlap_benchmark" \
  --benchmark_out="$res/overlap.json" --benchmark_out_format=json
stage "prefire-bench on CUDA" 90 "$build/apps/prefire-bench/prefire-bench" --device cuda --json "$res/prefire-bench.json"
stage "prefire-bench on CUDA, session pool" 90 "$build/apps/prefire-bench/prefire-bench" --device cuda --session-pool \
  --json "$res/prefire-bench-pool.json"
stage "saved-tensor benchmark" 60 "$build/benchmarks/prefire_saved_tensor_benchmark" \
  --benchmark_out="$res/saved_tensor.json" --benchmark_out_format=json
stage "offload benchmark" 120 env PYTHONPATH="$build/python" "$python" benchmarks/python_offload_gpu.py \
  --json "$res/offload_gpu.json"
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
stage "whole suite" 150 ctest --test-dir "$build" -j 8 --output-on-failure --timeout 120 -O "$res/ctest.log"
tail -4 "$res/ctest.log" 2>/dev/null
exit $status
