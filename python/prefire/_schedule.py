"""Scheduling: collect checkpoints in forward, prefire them into a session,
share one recomputation between the backward passes inside the session."""

from __future__ import annotations

import threading
from typing import List, Optional

from . import _C

_open_collectors = threading.local()


def _collecting() -> bool:
    """Whether a prefire.collect() scope is open on this thread."""
    return getattr(_open_collectors, "depth", 0) > 0

CheckpointHandle = _C.CheckpointHandle
PrefireStatus = _C.PrefireStatus
SessionStats = _C.SessionStats
RuntimeStats = _C.RuntimeStats


class collect:
    """``with collect() as handles:`` gathers the outermost checkpoints the
    block creates on this thread; ``handles`` (a list) is filled when the
    block ends. Collectors nest: the innermost one collects."""

    def __init__(self) -> None:
        self._collector = _C._Collector()
        self._handles: List[CheckpointHandle] = []

    def __enter__(self) -> List[CheckpointHandle]:
        self._collector.open()
        _open_collectors.depth = getattr(_open_collectors, "depth", 0) + 1
        return self._handles

    def __exit__(self, *exc) -> None:
        _open_collectors.depth -= 1
        self._handles.extend(self._collector.handles())
        self._collector.close()


class session:
    """``with session(id, retain_on_unpack=...):`` binds the backward passes
    run inside it to session ``id``: they unpack the session's recomputations
    (prefired, or recomputed by the first pass that needs one). With
    ``retain_on_unpack=True`` a recomputed tensor stays for a later pass (B
    before W); the last pass uses ``False``. Close the scope on the thread
    that opened it."""

    def __init__(self, id: int, retain_on_unpack: bool = False) -> None:
        self._scope = _C._SessionScope()
        self._id = id
        self._retain = retain_on_unpack

    def __enter__(self) -> "session":
        self._scope.open(self._id, self._retain)
        return self

    def __exit__(self, *exc) -> None:
        self._scope.close()


def prefire(handle: CheckpointHandle, session: int) -> PrefireStatus:
    """Recomputes the checkpoint now (on a CUDA device: on its prefire stream)
    and keeps the result in ``session`` for the backward passes bound to it."""
    return _C.prefire(handle, session)


def attach(handle: CheckpointHandle, session: int) -> bool:
    """Registers the checkpoint with ``session`` without recomputing it: the
    first pass bound to the session that needs it recomputes it, later passes
    share the result."""
    return _C.attach(handle, session)


def clear_session(session: int) -> None:
    """Releases everything ``session`` holds. Idempotent."""
    _C.clear_session(session)


def set_session_budget(session: int, bytes: Optional[int]) -> None:
    """Caps the bytes ``session`` may hold (``None``: no cap); a prefire that
    would exceed it is refused and the checkpoint stays lazy. The cap belongs
    to the id: it outlives ``clear_session`` and caps the id's later sessions
    until removed with ``None``."""
    _C.set_session_budget(session, bytes)


def session_stats(session: int) -> SessionStats:
    return _C.session_stats(session)


def runtime_stats() -> RuntimeStats:
    return _C.runtime_stats()


def reset_runtime_peak() -> None:
    _C.reset_runtime_peak()


def set_recompute_observer(observer) -> None:
    """Calls ``observer(kind, session, begin, end)`` after every recomputation,
    on the thread that ran it: ``kind`` is ``"lazy"`` or ``"prefire"``,
    ``session`` the session id or -1, ``begin``/``end`` host times on
    ``time.monotonic()``'s clock (on CUDA, kernels may still run). ``None``
    removes it. Errors it raises are reported as unraisable, not propagated."""
    _C.set_recompute_observer(observer)
