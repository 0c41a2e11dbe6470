"""The package and the torch it was built against: the wheel's metadata
depends on exactly that torch release, and importing prefire under another
torch raises ImportError naming both (before the extension module loads,
which would fail to link or crash); the type stubs name what the
extension module has."""

import os
import subprocess
import sys
import tempfile

import pytest
import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_wheel_depends_on_the_torch_release_it_is_built_against():
    build = pytest.importorskip("scikit_build_core.build")
    with tempfile.TemporaryDirectory() as out:
        cwd = os.getcwd()
        os.chdir(ROOT)
        try:
            info = build.prepare_metadata_for_build_wheel(out)
        finally:
            os.chdir(cwd)
        with open(os.path.join(out, info, "METADATA")) as f:
            requires = [line.split(":", 1)[1].strip() for line in f if line.startswith("Requires-Dist:")]
    assert requires == ["torch==" + torch.__version__.split("+")[0]]


def test_import_under_another_torch_raises_a_clear_error():
    code = "import torch; torch.__version__ = '2.0.0+other'; import prefire"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=dict(os.environ), timeout=120)
    assert result.returncode != 0
    assert "ImportError" in result.stderr
    assert "prefire was built against torch " + torch.__version__ in result.stderr
    assert "imports torch 2.0.0+other" in result.stderr


def test_the_type_stubs_name_what_the_extension_module_has():
    """_C.pyi stays true: every class and function it declares is in
    prefire._C, and every keyword a stubbed planner constructor takes is
    accepted (the planner's types are keyword-only)."""
    import ast

    from prefire import _C

    with open(os.path.join(os.path.dirname(_C.__file__), "_C.pyi")) as f:
        stub = ast.parse(f.read())
    names = [n.name for n in stub.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))]
    assert names and [n for n in names if not hasattr(_C, n)] == []
    for cls in (n for n in stub.body if isinstance(n, ast.ClassDef) and n.name in ("BlockCost", "Plan", "StagePlan")):
        init = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
        assert [a.arg for a in init.args.kwonlyargs] == list(getattr(_C, cls.name).FIELDS), cls.name


def releases_file():
    with open(os.path.join(ROOT, "cmake", "torch-releases.txt")) as f:
        return [line.split()[0] for line in f if line[:1].isdigit()]


def test_the_build_carries_the_releases_ci_tests_and_this_torch_imports_it_without_a_warning():
    from prefire import _build, _torch_range

    assert list(_build.TESTED_TORCH_RELEASES) == releases_file()
    assert _torch_range.outside_message(torch.__version__, "prefire") is None  # CI runs only listed releases
    result = subprocess.run([sys.executable, "-W", "error", "-c", "import prefire"], capture_output=True, text=True,
                            env=dict(os.environ), timeout=120)
    assert result.returncode == 0, result.stderr


def test_import_under_a_torch_outside_the_tested_range_warns_naming_the_range(tmp_path):
    """The package as built, with a tested range that leaves this torch out
    (its _build.py rewritten in a copy): import works and warns once."""
    import shutil

    import prefire

    package = tmp_path / "prefire"
    shutil.copytree(os.path.dirname(prefire.__file__), package, ignore=shutil.ignore_patterns("__pycache__"))
    build = package / "_build.py"
    text = build.read_text()
    assert "TESTED_TORCH_RELEASES" in text
    build.write_text(text + '\nTESTED_TORCH_RELEASES = ["1.8.0", "1.9.1"]\n')
    code = "import warnings; warnings.simplefilter('always'); import prefire; print(prefire.checkpoint.__name__)"
    env = dict(os.environ, PYTHONPATH=str(tmp_path), PYTHONDONTWRITEBYTECODE="1")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "checkpoint"
    release = torch.__version__
    assert result.stderr.count("prefire is tested with torch 1.8 to 1.9 (CI runs 1.8.0, 1.9.1); "
                               f"this is torch {release}: it was built against this torch") == 1, result.stderr
