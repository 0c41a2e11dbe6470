#!/usr/bin/env bash
# Installs what prefire needs to build, when it is missing, and prints nothing
# else on success. Idempotent: a second run does no work.
#
#   * torch (LibTorch comes from the wheel) in a virtual environment outside
#     the repository, so clean clones and CI reuse it: the pinned release
#     (scripts/torch-releases.sh --pinned) in ~/.cache/prefire/venv, or
#     PREFIRE_TORCH_VERSION=X (another release CI tests, or any) in
#     ~/.cache/prefire/venv-X; $PREFIRE_VENV overrides the folder
#   * pytest, scikit-build-core, numpy and matplotlib in that venv (the Python
#     package's tests and wheel, torch.distributed's object messages, the pipeline plot)
#   * transformers (pinned; pure Python over its own wheels, never a second
#     torch) for the tests of prefire.integrations.transformers
#   * Debian packages: GoogleTest, GoogleMock, Google Benchmark, CLI11, nlohmann-json, Ninja, ccache
#
# Sourced or executed; prints the venv's python path on stdout as its last line
# when run with --print-python.
set -euo pipefail

pinned=$("$(dirname "${BASH_SOURCE[0]}")/torch-releases.sh" --pinned)
TORCH_VERSION="${PREFIRE_TORCH_VERSION:-$pinned}"
if [ "$TORCH_VERSION" = "$pinned" ]; then
  VENV="${PREFIRE_VENV:-$HOME/.cache/prefire/venv}"
else
  VENV="${PREFIRE_VENV:-$HOME/.cache/prefire/venv-$TORCH_VERSION}"
fi

log() { echo "[setup] $*" >&2; }
# pip install into the venv. A machine's pip configuration may cap torch below
# a release CI tests (a constraint file of the machine's); PIP_CONSTRAINT
# replaces that file for these installs alone, keeping the rest of the
# configuration (indexes, local wheels). torch and transformers are pinned
# here, and the check after each install refuses a venv whose torch moved.
venv_pip() {
  PIP_CONSTRAINT=/dev/null "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 |
    grep -v "^WARNING: Location .* is ignored" >&2 || true
}

need_apt=()
[ -f /usr/include/gtest/gtest.h ] || need_apt+=(libgtest-dev)
[ -f /usr/include/gmock/gmock.h ] || need_apt+=(libgmock-dev)
[ -f /usr/include/benchmark/benchmark.h ] || need_apt+=(libbenchmark-dev)
[ -f /usr/include/CLI/CLI.hpp ] || need_apt+=(libcli11-dev)
[ -f /usr/include/nlohmann/json.hpp ] || need_apt+=(nlohmann-json3-dev)
command -v ninja >/dev/null || need_apt+=(ninja-build)
command -v ccache >/dev/null || need_apt+=(ccache)
command -v cmake >/dev/null || need_apt+=(cmake)
if [ ${#need_apt[@]} -gt 0 ]; then
  log "installing Debian packages: ${need_apt[*]}"
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >&2
fi

have_torch() {
  [ -x "$VENV/bin/python" ] &&
    "$VENV/bin/python" -c "import torch,sys; sys.exit(0 if torch.__version__.split('+')[0]=='$TORCH_VERSION' else 1)" 2>/dev/null
}
if ! have_torch; then
  log "creating $VENV with torch==$TORCH_VERSION (first time only; several GB)"
  mkdir -p "$(dirname "$VENV")"
  python3 -m venv "$VENV"
  venv_pip "torch==$TORCH_VERSION"
  have_torch || { log "torch $TORCH_VERSION did not install into $VENV"; exit 1; }
fi

# The Python package's tests (pytest) and wheel build (scikit-build-core);
# NumPy (torch.distributed sends Python objects through it) and matplotlib
# (the plot of the pipeline program, apps/pipeline_bench).
if ! "$VENV/bin/python" -c "import pytest, scikit_build_core, numpy, matplotlib" 2>/dev/null; then
  log "installing pytest, scikit-build-core, numpy and matplotlib into $VENV"
  venv_pip pytest scikit-build-core numpy matplotlib
fi

# Hugging Face transformers, a tested client (tests/python/test_transformers.py).
# It does not depend on torch; --no-deps on torch is not needed, but the
# check below makes sure the torch of the venv is still the pinned one.
TRANSFORMERS_VERSION="${PREFIRE_TRANSFORMERS_VERSION:-5.24.0}"
if ! "$VENV/bin/python" -c "import transformers,sys; sys.exit(0 if transformers.__version__=='$TRANSFORMERS_VERSION' else 1)" 2>/dev/null; then
  log "installing transformers==$TRANSFORMERS_VERSION into $VENV"
  venv_pip "transformers==$TRANSFORMERS_VERSION"
  have_torch || { log "installing transformers changed torch in $VENV"; exit 1; }
fi

if [ "${1:-}" = "--print-python" ]; then echo "$VENV/bin/python"; fi
