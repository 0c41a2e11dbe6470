#!/usr/bin/env bash
# What a pip user does, checked from a clean environment: builds prefire's
# wheel against the project venv's torch (pip wheel --no-build-isolation
# --no-deps: the wheel alone, no torch downloaded), makes a new venv,
# installs the wheel there with pip resolving its one dependency (torch of
# the release it was built against), checks that it holds the library alone
# (no program module), and runs a checkpoint there with the installed
# package (not the build tree's, not the project venv's). CI runs it
# (.ci/run); a few minutes, most of them the wheel's compile.
#   tests/check_wheel.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python=$(scripts/setup.sh --print-python)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}" CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-true}"

"$python" -m pip wheel -q --disable-pip-version-check --no-build-isolation --no-deps . -w "$tmp/dist" \
  -C build-dir="$tmp/build" >"$tmp/wheel.log" 2>&1 || { tail -50 "$tmp/wheel.log"; exit 1; }
wheel=$(ls "$tmp"/dist/prefire-*.whl)
echo "built $(basename "$wheel")"
# The wheel holds the library alone: the package prefire (its modules, _C, prefire.pipelining,
# prefire.integrations) and its metadata; the programs beside it (apps/) stay in the checkout.
"$python" - "$wheel" <<'PY'
import sys
import zipfile

names = zipfile.ZipFile(sys.argv[1]).namelist()
packages = sorted({n.rsplit("/", 1)[0] for n in names if n.endswith(".py")})
outside = [n for n in names if not (n.startswith("prefire/") or ".dist-info/" in n)]
programs = [n for n in names if any(p in n for p in ("pipeline_bench", "pipeline_sim", "simulate", "prefire/pipeline/"))]
assert packages == ["prefire", "prefire/integrations", "prefire/pipelining"], packages
assert not outside and not programs, (outside, programs)
print(f"the wheel holds the library alone: {len(names)} files, packages {', '.join(packages)}; no program module")
PY

python3 -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q --disable-pip-version-check "$wheel" 2>&1 |
  grep -v "^WARNING: Location .* is ignored" || true
cd "$tmp"  # away from the checkout: nothing of it on sys.path
"$tmp/venv/bin/python" -W ignore::UserWarning - "$tmp/venv" <<'PY'
import sys

import torch

import prefire

venv = sys.argv[1]
assert prefire.__file__.startswith(venv), f"imported {prefire.__file__}, not the installed wheel under {venv}"
torch.manual_seed(0)
torch.set_num_threads(1)
layer = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 16))
x = torch.randn(8, 16, requires_grad=True)

def grads(run):
    torch.manual_seed(1)
    layer.zero_grad(set_to_none=True)
    x.grad = None
    run().sum().backward()
    return [x.grad] + [p.grad for p in layer.parameters()]

plain = grads(lambda: layer(x))
checked = grads(lambda: prefire.checkpoint(layer, x))
assert all(torch.equal(a, b) for a, b in zip(plain, checked)), "checkpoint gradients differ from unchecked"
print(f"wheel in a new venv: prefire {prefire.__file__}, torch {torch.__version__}: checkpoint bit-equal to unchecked")
PY
