"""The byte budget of one rank's pipeline sessions (used by
:mod:`prefire.pipelining`).

Note [A rank's byte budget]
``enable(schedule, budget_bytes=N)`` caps the recomputed activations that
the sessions of the rank's stages hold together, all micro-batches at once:
what the rank's memory sees. Two things make a rank hold them:
  * B keeps what it recomputed for W (``retain_on_unpack``): in a zero-bubble
    schedule several micro-batches sit between their B and their W;
  * bubble prefires hold a micro-batch's recomputation until its B.
Every pass that recomputes holds its micro-batch's recomputation of the
stage while it runs (a session's last pass lets go when it ends): that is
the floor no budget goes below. A stage's need, learnt as its sessions
close, is the most one of its sessions held; ``pass_bytes`` the most of all
stages. The budget is kept at the two moments that add to what is held:
  * after B, a micro-batch keeps its recomputation for W only if the rank
    stays within N until its next B ends: walking the rank's actions in the
    schedule's order from this B, each W lets go of a kept micro-batch, a W
    that recomputes holds its stage's need while it runs, and the next B
    (or full backward) holds its stage's need less what is prefired of it.
    Otherwise the session is cleared and its checkpoints join a fresh
    session that W recomputes into (one more recomputation per checkpoint:
    two instead of one, still fewer than torch's checkpoint, which
    recomputes for B and for each weight group). A schedule with no order of
    actions (not built on ``_PipelineScheduleRuntime``) keeps room for one
    pass, ``pass_bytes``, instead;
  * a bubble prefire into a session runs only if the rank keeps room for one
    pass: the session's budget is set, right before, to ``N - pass_bytes``
    less what the other sessions hold, and the runtime refuses a prefire
    over it (the rest stays B's).
A budget below a stage's need cannot be kept: nothing is kept nor
prefired, and the rank holds that need while a pass runs; a warning says
so once. On a stage that holds FSDP2 modules, W runs with the stage
unsharded (the runtime's UNSHARD action comes before its compute), so a W
that recomputes all-gathers nothing (tests/python/test_fsdp.py).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import _C
from ._order import Action, rank_actions

Key = Tuple[int, int]  # (stage index, micro-batch)


def _holds(mb: Any) -> int:
    return _C.session_stats(mb.session).current_bytes


class RankBudget:
    """The budget of one rank's sessions (Note [A rank's byte budget])."""

    def __init__(self, budget_bytes: Optional[int], schedule, pending: Callable[[], Dict[Key, Any]]) -> None:
        """``pending()``: the rank's open sessions, (stage, micro-batch) ->
        ``_MicroBatch``."""
        self.bytes = budget_bytes
        self.schedule = schedule
        self.pending = pending
        self.stage_bytes: Dict[int, int] = {}   # a stage's need: the most one of its sessions held
        self._actions: Optional[List[Action]] = None
        self._b_at: Dict[Key, int] = {}          # where each B is in _actions
        self._warned = False

    @property
    def pass_bytes(self) -> int:
        return max(self.stage_bytes.values(), default=0)

    def set(self, budget_bytes: Optional[int]) -> None:
        self.bytes = budget_bytes
        self._warned = False

    def room_for_prefires(self, session: int) -> Optional[int]:
        """The budget ``session`` gets before a bubble prefire into it: what
        it may hold so that the rank keeps room for one pass (None: no cap)."""
        if self.bytes is None:
            return None
        if not self.stage_bytes:  # nothing learnt yet: no room known
            return 0
        others = sum(_holds(mb) for mb in self.pending().values() if mb.session != session)
        return max(0, self.bytes - self.pass_bytes - others)

    def keeps_for_w(self, key: Key) -> bool:
        """After the B of ``key``: whether its session may keep its
        recomputation for W (one that holds nothing has nothing to let go)."""
        pending = self.pending()
        holds = _holds(pending[key])
        if self.bytes is None or holds == 0:
            return True
        held = {k: _holds(mb) for k, mb in pending.items()}

        def need(stage: int) -> int:  # a stage not seen close yet: like this one
            return self.stage_bytes.get(stage) or max(self.pass_bytes, holds)

        after = self._actions_after(key)
        if after is None:
            return sum(held.values()) + max(self.pass_bytes, holds) <= self.bytes
        total = peak = sum(held.values())
        for kind, stage, mb in after:
            k = (stage, mb)
            if kind == "W" and k in pending:
                if pending[k].w_recomputes:
                    peak = max(peak, total + need(stage))
                total -= held[k]  # W ends the session
            elif kind in ("B", "BW"):
                peak = max(peak, total + max(0, need(stage) - held.get(k, 0)))
                break
        return peak <= self.bytes

    def _actions_after(self, key: Key) -> Optional[List[Action]]:
        """The rank's actions after the B of ``key``, in order (None: the
        schedule keeps no order of actions)."""
        if self._actions is None:
            self._actions = rank_actions(self.schedule) or []
            self._b_at = {(s, m): i for i, (kind, s, m) in enumerate(self._actions) if kind == "B"}
        at = self._b_at.get(key)
        return None if at is None else self._actions[at + 1:]

    def closed(self, stage: int, peak_bytes: int) -> None:
        """A session of ``stage`` closed after holding at most ``peak_bytes``."""
        self.stage_bytes[stage] = max(self.stage_bytes.get(stage, 0), peak_bytes)
        if self.bytes is not None and self.pass_bytes > self.bytes and not self._warned:
            self._warned = True
            warnings.warn(
                f"prefire.pipelining: budget_bytes={self.bytes} is below what one backward pass of a micro-batch "
                f"holds while it runs ({self.pass_bytes} bytes, its checkpoints' recomputation): this rank keeps "
                "nothing for W and prefires nothing, and holds that much during each pass", UserWarning,
                stacklevel=2)
