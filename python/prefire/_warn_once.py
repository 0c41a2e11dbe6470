"""Warnings the package says once per process, each under its key."""

from __future__ import annotations

import warnings

#: the keys said so far (tests clear it to see a warning again)
warned = set()


def warn_once(key: str, message: str) -> None:
    """A UserWarning with ``message``, the first time ``key`` comes, pointed
    at the caller's caller."""
    if key not in warned:
        warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=3)
