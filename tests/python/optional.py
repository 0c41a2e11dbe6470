"""Optional test dependencies. A test that needs one is skipped where it is
missing, that test alone: a file never skips as a whole, so every test of
it that does not need the dependency still runs (and is counted)."""

import importlib
from types import ModuleType
from typing import Optional

import pytest


def optional(name: str) -> Optional[ModuleType]:
    """The module, or None where it does not import."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def requires(name: str):
    """Marks a test (or, as ``pytestmark``, each test of a file) that needs ``name``."""
    return pytest.mark.skipif(optional(name) is None, reason=f"needs {name}, which does not import here")
