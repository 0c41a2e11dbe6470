#!/usr/bin/env bash
# GPU verification of prefire's CUDA runtime (../shared/guide/GPU.md).
#
#   scripts/gpu-check.sh --prepare
#       Here, on a CPU machine: copies what the GPU machine lacks into
#       .gpu-deps/ (git-ignored): GoogleTest's sources (Debian's googletest
#       package), Google Benchmark's headers, library and CMake config
#       (Debian's libbenchmark-dev, libbenchmark1debian) and CLI11's headers
#       and CMake config (libcli11-dev).
#   scripts/gpu-check.sh
#       On the GPU machine (device tool, carry=[".gpu-deps"]): builds for
#       sm_90 against that machine's torch, runs the test suite (the CUDA
#       tests run there), the overlap and unpack benchmarks and prefire-bench
#       on CUDA; everything it prints goes to $OUT (default out/gpu-check).
#       Set PREFIRE_GPU_CHECK_ALLOW_CPU=1 to rehearse it on a CPU machine.
set -uo pipefail
cd "$(dirname "$0")/.."
deps=.gpu-deps

if [ "${1:-}" = "--prepare" ]; then
  set -e
  scripts/setup.sh >/dev/null
  [ -d /usr/src/googletest ] || { apt-get update -qq && apt-get install -y -qq googletest >/dev/null; }
  rm -rf "$deps" && mkdir -p "$deps/benchmark" "$deps/cli11"
  cp -r /usr/src/googletest "$deps/googletest"
  (cd "$deps" && apt-get download -qq libbenchmark-dev libbenchmark1debian libcli11-dev >/dev/null 2>&1)
  for deb in "$deps"/libbenchmark*.deb; do dpkg -x "$deb" "$deps/benchmark"; done
  dpkg -x "$deps"/libcli11-dev*.deb "$deps/cli11"
  rm -f "$deps"/*.deb
  du -sh "$deps"
  exit 0
fi

out="${OUT:-out/gpu-check}"
mkdir -p "$out"
log="$out/gpu-check.log"
exec > >(tee "$log") 2>&1
echo "== gpu-check $(date -u +%FT%TZ)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python="${PREFIRE_PYTHON:-$(command -v python3)}"
"$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available())'
if ! "$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' && [ -z "${PREFIRE_GPU_CHECK_ALLOW_CPU:-}" ]; then
  echo "no GPU visible to torch: stopping"; exit 1
fi

bench_dir=$(ls -d "$PWD/$deps"/benchmark/usr/lib/*/cmake/benchmark 2>/dev/null | head -1)
export LD_LIBRARY_PATH="$(dirname "$(dirname "${bench_dir:-/x/x}")"):${LD_LIBRARY_PATH:-}"
build=build-gpu
t0=$(date +%s)
cmake -G Ninja -S . -B "$build" -Wno-dev -DCMAKE_BUILD_TYPE=Release \
  -DPREFIRE_PYTHON="$python" -DPREFIRE_CUDA=ON -DPREFIRE_CUDA_ARCHITECTURES=90 \
  -DPREFIRE_GTEST_SOURCE_DIR="$PWD/$deps/googletest" \
  -DCLI11_DIR="$PWD/$deps/cli11/usr/share/cmake/CLI11" \
  ${bench_dir:+-Dbenchmark_DIR="$bench_dir"} >"$out/configure.log" 2>&1 || { tail -40 "$out/configure.log"; exit 1; }
cmake --build "$build" >"$out/build.log" 2>&1 || { grep -E "error|FAILED" "$out/build.log" | head -40; exit 1; }
echo "== built in $(( $(date +%s) - t0 )) s"

status=0
echo "== CUDA tests"
"$build/tests/prefire_tests" --gtest_filter='Cuda.*' --gtest_output=json:"$out/cuda_tests.json" || status=1
echo "== whole suite"
ctest --test-dir "$build" -j 8 --output-on-failure >"$out/ctest.log" 2>&1 || status=1
tail -3 "$out/ctest.log"
echo "== overlap benchmark"
"$build/benchmarks/prefire_overlap_benchmark" --benchmark_out="$out/overlap.json" --benchmark_out_format=json || status=1
echo "== saved-tensor benchmark"
"$build/benchmarks/prefire_saved_tensor_benchmark" --benchmark_out="$out/saved_tensor.json" --benchmark_out_format=json || status=1
echo "== prefire-bench on CUDA"
"$build/apps/prefire-bench/prefire-bench" --device cuda --json "$out/prefire-bench.json" || status=1
echo "== gpu-check exit $status"
exit $status
