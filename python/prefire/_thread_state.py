"""A thread's setting, set for the length of a block and put back after."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator


@contextlib.contextmanager
def set_in_block(state: threading.local, name: str, value: Any) -> Iterator[None]:
    """``state.name = value`` inside the block, what it was (None if unset) after."""
    outer = getattr(state, name, None)
    setattr(state, name, value)
    try:
        yield
    finally:
        setattr(state, name, outer)
