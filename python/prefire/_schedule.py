"""Scheduling: collect checkpoints in forward, prefire them into a session,
share one recomputation between the backward passes inside the session."""

from __future__ import annotations

import threading
from typing import List, Optional

from . import _C, _compile
from ._warn_once import warn_once

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


def _session_id(session: object, what: str) -> int:
    """``session`` as a session id, or a ValueError/TypeError in Python's words."""
    if isinstance(session, bool) or not isinstance(session, int):
        raise TypeError(f"prefire.{what}: a session id is an int >= 0, got {type(session).__name__} {session!r}")
    if not 0 <= session < 2**63:
        raise ValueError(f"prefire.{what}: a session id is an int in [0, 2**63), got {session}")
    return session


def _handle(handle: object, what: str) -> CheckpointHandle:
    if not isinstance(handle, CheckpointHandle):
        raise TypeError(f"prefire.{what}: handle must be a CheckpointHandle (from prefire.collect()), got "
                        f"{type(handle).__name__}")
    return handle


class session:
    """``with session(id, retain_on_unpack=...):`` binds the backward passes
    run inside it to session ``id``: they unpack the recomputations of the
    checkpoints registered to the session with :func:`prefire` (recomputed
    ahead) or :func:`attach` (recomputed by the first pass that needs one),
    and share them. A checkpoint not registered to it is recomputed by every
    pass, as without a session: a scope alone shares nothing, and one that
    ends with nothing registered while backward recomputed warns once (Note
    [A session shares what is registered to it], src/session/session.h).
    With ``retain_on_unpack=True`` a recomputed tensor stays for a later pass
    (B before W); the last pass uses ``False``. Close the scope on the thread
    that opened it.

    ``next_pass_reads`` (with ``retain_on_unpack=True``): what the next pass
    will read, a flag per saved tensor of each registered checkpoint in
    registration order (:mod:`prefire.pipelining` passes what an earlier W of
    the stage read); a saved tensor it leaves out goes at its unpack in this
    pass, not when the session is cleared (Note [A pass lets go of what the
    next pass will not read], src/session/keep_only.cpp). ``lets_go`` says
    whether the mask fit the session when the scope opened."""

    def __init__(self, id: int, retain_on_unpack: bool = False,
                 next_pass_reads: Optional[List[List[bool]]] = None) -> None:
        self._id = _session_id(id, "session")
        if not isinstance(retain_on_unpack, bool):
            raise TypeError(f"prefire.session: retain_on_unpack must be a bool, got {type(retain_on_unpack).__name__}")
        if next_pass_reads is not None and not retain_on_unpack:
            raise ValueError("prefire.session: next_pass_reads is for a pass that keeps what it recomputed "
                             "(retain_on_unpack=True); the last pass lets go of everything anyway")
        self._scope = _C._SessionScope()
        self._retain = retain_on_unpack
        self._next_pass_reads = [] if next_pass_reads is None else next_pass_reads

    def __enter__(self) -> "session":
        self._scope.open(self._id, self._retain, self._next_pass_reads)
        self._torch_path_backwards = _compile.torch_path_backwards
        return self

    @property
    def lets_go(self) -> bool:
        """Whether this open scope lets go of what ``next_pass_reads`` leaves out."""
        return self._scope.lets_go

    def __exit__(self, *exc) -> None:
        self._scope.close()
        # See Note [A block no collector sees runs torch's compiled checkpoint] (_compile.py)
        if _compile.torch_path_backwards > self._torch_path_backwards:
            warn_once(
                "session-torch-path",
                f"prefire: session {self._id}'s scope ran the backward of prefire.compile'd blocks checkpointed "
                "with no prefire.collect() open around their forward; those run as torch's compiled checkpoint, "
                "which no session shares, so each pass recomputed them. Collect their handles (prefire.collect()) "
                "and register them (prefire.attach / prefire.prefire) for a session to share them")


def prefire(handle: CheckpointHandle, session: int) -> PrefireStatus:
    """Recomputes the checkpoint now (on a CUDA device: on its prefire stream)
    and keeps the result in ``session`` for the backward passes bound to it
    (``with prefire.session(session)``). A prefire that no pass of the
    session uses before the session is cleared, or before its graph is freed,
    is wasted: it warns once and counts in ``runtime_stats().wasted_prefires``."""
    return _C.prefire(_handle(handle, "prefire"), _session_id(session, "prefire"))


def fetch_ahead(handle: CheckpointHandle) -> bool:
    """Inside a backward (a hook that runs in it): starts the fetch of the
    handle's offloaded checkpoint for this backward now, on its tier's worker
    (the prefire stream on CUDA), so that its unpacks wait for those reads
    instead of reading then: a plain backward's reload schedule
    (:func:`reload_schedule`). False, doing nothing, for an expired handle, a
    checkpoint that is not offloaded or is registered to a session, or
    outside a backward."""
    return _C.fetch_ahead(_handle(handle, "fetch_ahead"))


def attach(handle: CheckpointHandle, session: int) -> bool:
    """Registers the checkpoint with ``session`` without recomputing it: the
    first pass bound to the session that needs it recomputes it, later passes
    share the result."""
    return _C.attach(_handle(handle, "attach"), _session_id(session, "attach"))


def clear_session(session: int) -> None:
    """Releases everything ``session`` holds and ends it (its counters start
    from zero at its next use: read :func:`session_stats` first). Idempotent;
    raises CheckpointError while a scope of the session is open."""
    _C.clear_session(_session_id(session, "clear_session"))


def discard_session(session: int) -> None:
    """:func:`clear_session` for a caller that lets prefired recomputations
    go on purpose (a budget making room, a prefire that was not needed):
    what no pass used is not counted as wasted nor warned about."""
    _C.discard_session(_session_id(session, "discard_session"))


def set_session_budget(session: int, bytes: Optional[int]) -> None:
    """Caps the bytes ``session`` may hold (``None``: no cap); a prefire that
    would exceed it is refused and the checkpoint stays lazy. The cap belongs
    to the id: it outlives ``clear_session`` and caps the id's later sessions
    until removed with ``None``."""
    session = _session_id(session, "set_session_budget")
    if bytes is not None and (isinstance(bytes, bool) or not isinstance(bytes, int) or bytes < 0):
        raise ValueError(f"prefire.set_session_budget: bytes must be an int >= 0, or None for no cap, got {bytes!r}")
    _C.set_session_budget(session, bytes)


def session_stats(session: int) -> SessionStats:
    """The counters of ``session`` (:class:`SessionStats`; all zero when it
    does not exist, the budget either way)."""
    return _C.session_stats(_session_id(session, "session_stats"))


def runtime_stats() -> RuntimeStats:
    """Process-wide counters (:class:`RuntimeStats`): recomputations, those
    no session shared, wasted prefires, and the bytes prefire holds."""
    return _C.runtime_stats()


def reset_runtime_peak() -> None:
    """Starts new peak windows of :func:`runtime_stats` at the current values."""
    _C.reset_runtime_peak()


def set_recompute_observer(observer) -> None:
    """Calls ``observer(kind, session, begin, end)`` after every recomputation,
    on the thread that ran it: ``kind`` is ``"lazy"`` or ``"prefire"``,
    ``session`` the session id or -1, ``begin``/``end`` host times on
    ``time.monotonic()``'s clock (on CUDA, kernels may still run). ``None``
    removes it. Errors it raises are reported as unraisable, not propagated."""
    _C.set_recompute_observer(observer)
