"""The torch releases prefire is tested with, and what it says about a torch
outside their range.

CI builds and tests prefire against each release of
``cmake/torch-releases.txt`` (the oldest, the pinned one, the newest);
the build writes them into ``_build.py``. The tested range runs from the
oldest's major.minor to the newest's; a release between two listed ones is
inside it, though not tested itself. Outside it, ``import prefire`` warns
(the extension module was built against that torch and may well work) and
``prefire.pipelining.enable`` refuses (Note [Hook points fail loudly]).
"""

from __future__ import annotations

from typing import Optional, Tuple

from . import _build

TESTED_RELEASES = tuple(_build.TESTED_TORCH_RELEASES)


def minor_release(version: str) -> Tuple[int, int]:
    """2.14.1+cu130 -> (2, 14)."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


#: (oldest, newest) as (major, minor)
TESTED_RANGE = (minor_release(TESTED_RELEASES[0]), minor_release(TESTED_RELEASES[-1]))


def describe_range() -> str:
    low, high = (".".join(map(str, v)) for v in TESTED_RANGE)
    return f"torch {low} to {high} (CI runs {', '.join(TESTED_RELEASES)})"


def outside_message(version: str, what: str) -> Optional[str]:
    """None where ``version`` is inside the tested range; else a sentence
    saying that ``what`` was tested with the range and this is ``version``."""
    if TESTED_RANGE[0] <= minor_release(version) <= TESTED_RANGE[1]:
        return None
    return f"{what} is tested with {describe_range()}; this is torch {version}"
