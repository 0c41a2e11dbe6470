"""A pipeline rank's actions, and what the planner makes of them.

An action is ``(kind, stage, micro_batch)``: kind ``"F"`` (forward), ``"B"``
(input gradients), ``"W"`` (weight gradients) or ``"BW"`` (full backward).
A rank's actions in one step, in its schedule's order, say when each
micro-batch of each stage is alive (from its F to its W or full backward)
and which action recomputes it (``lifetime``); the C++ planner counts a
pipeline rank's plan over them (``plans``; Note [A pipeline rank's memory
plan] in ``_plan.py``). ``compute_actions``, ``rank_actions`` and
``is_full_backward`` read them from torch's schedules (``_hook_points.py``).
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Sequence, Tuple

from .. import _C
from ._hook_points import compute_actions, is_full_backward, rank_actions

__all__ = ["Action", "KINDS", "compute_actions", "is_full_backward", "lifetime", "planner_actions", "rank_actions"]

#: (kind, stage index, micro-batch): kind "F", "B" (input gradients), "W"
#: (weight gradients) or "BW" (full backward)
Action = Tuple[str, int, int]

KINDS = ("F", "B", "W", "BW")
_PLANNER_KINDS = {"F": _C.ActionKind.FORWARD, "B": _C.ActionKind.B, "W": _C.ActionKind.W,
                  "BW": _C.ActionKind.FULL_BACKWARD}


def planner_actions(actions: Iterable[Action]) -> List[_C.RankAction]:
    """``actions`` as the C++ planner takes them (``RankAction``)."""
    return [_C.RankAction(kind=_PLANNER_KINDS[kind], stage=stage, micro_batch=mb) for kind, stage, mb in actions]


def lifetime(actions: Sequence[Action], stage: int, micro_batch: Optional[int] = None) -> _C.Lifetime:
    """Per action of ``actions``, how many micro-batches of ``stage`` (of
    ``micro_batch`` alone, when given) are alive after it (between their F
    and their W), done, and in a pass during it (the C++ planner's
    ``lifetime``)."""
    return _C.lifetime(planner_actions(actions), stage, -1 if micro_batch is None else micro_batch)
