"""A scikit-build-core dynamic-metadata provider (pyproject.toml): the wheel
depends on the torch release it is built against, since its extension module
links that torch's libraries and works with no other."""

from __future__ import annotations

from typing import Any, Mapping


def dynamic_metadata(settings: Mapping[str, Any], project: Mapping[str, Any]) -> dict[str, Any]:
    import torch

    release = torch.__version__.split("+")[0]  # 2.14.1+cu130 -> 2.14.1 (PEP 440 matches any local build)
    return {"dependencies": [f"torch=={release}"]}
