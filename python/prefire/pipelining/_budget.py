"""The byte budget of one rank's pipeline sessions (used by
:mod:`prefire.pipelining`).

Note [A rank's byte budget]
``enable(schedule, budget_bytes=N)`` caps the recomputed activations the
sessions of the rank's stages hold together, all micro-batches at once. A
B keeping its recomputation for W (zero-bubble schedules hold several
micro-batches between B and W) and bubble prefires ahead of a B make them
hold it.
1. A pass that recomputes holds its micro-batch's recomputation of the
   stage while it runs. A stage's need is the most one of its sessions
   held (learnt as they close; from the first session whose B let go of
   what W does not read as it went, Note [What a session keeps for W] in
   _sessions.py, counting only those and later ones); the floor is the
   most over the stages (``floor_bytes``). Below the floor the rank keeps
   nothing for W and prefires nothing, and says so once.
2. Both decisions below walk the rank's actions in the schedule's order,
   counted by the C++ planner (include/prefire/pipeline_plan.h): a B or full
   backward holds its stage's need less what is prefired of it; a W lets go
   of its micro-batch, and holds its stage's need while it runs if it
   recomputes. "Now" is the rank's place in its actions (``ran``).
3. After B, a session keeps its recomputation for W only if the actions up
   to that W stay within N, every other micro-batch at its floor meanwhile
   (a later B lets go, its W recomputes): what any later decision can fall
   back to, so none finds a kept session over N (``keep_for_w``). Otherwise
   it is cleared and its checkpoints join a fresh session W recomputes into
   (two recomputations, still fewer than torch's checkpoint).
4. A bubble prefire may fill a micro-batch's session up to what keeps the
   rank within N from now until its B, every B before it keeping its
   recomputation for W (what its stage's sessions keep after B once trimmed:
   Note [What a session keeps for W] in _sessions.py). The session's budget
   is set to that right before; the runtime refuses a prefire over it and
   the rest is B's.
5. Keeping for W saves a recomputation; a prefire only moves one. So a B
   that fits only without some bubble-prefired sessions lets go of them,
   those whose B comes last first (their B recomputes them): whether a B
   keeps does not depend on when the bubbles fell.
6. Without a place in the actions (a schedule not built on
   ``_PipelineScheduleRuntime``, or a step run in another order than the
   schedule's), both decisions keep room for one pass beside what is held.
7. Under a memory plan (Note [A pipeline rank's memory plan] in _plan.py), N
   is what the plan leaves the sessions while each action runs
   (``Plan.room_bytes``, Note [What a plan holds] in
   src/plan/plan_bytes.cpp), and a micro-batch whose blocks it keeps needs
   no pass.
8. On a stage that holds FSDP2 modules W runs unsharded (the runtime's
   UNSHARD comes before its compute), so a W that recomputes all-gathers
   nothing (tests/python/test_fsdp.py).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

from .. import _C
from .actions import Action, planner_actions

StageMicroBatch = Tuple[int, int]  # (stage index, micro-batch)


def _holds(mb: Any) -> int:
    return _C.session_stats(mb.session).current_bytes


class RankBudget:
    """The budget of one rank's sessions (Note [A rank's byte budget])."""

    def __init__(self, budget_bytes: Optional[int], pending: Callable[[], Dict[StageMicroBatch, Any]],
                 actions: Callable[[], Optional[List[Action]]], holds: Callable[[Any], int] = _holds) -> None:
        """``pending()``: the rank's open sessions, (stage, micro-batch) ->
        ``_MicroBatch``; ``actions()``: the rank's actions in one step, in
        order (None: the schedule keeps no order); ``holds(mb)``: the bytes
        a micro-batch's session holds now."""
        self.bytes = budget_bytes
        self.room: Optional[List[int]] = None  # a memory plan's room for the sessions at each action (set())
        self.pending = pending
        self.holds = holds
        self.stage_bytes: Dict[int, int] = {}   # a stage's need: the most one of its sessions held
        self.idle: Set[StageMicroBatch] = set()  # micro-batches of a stage a memory plan recomputes nothing of
        self.kept_bytes: Dict[int, int] = {}    # what a stage's session keeps for W after B, when trimmed
        self._read_actions = actions
        self._actions: Optional[List[Action]] = None
        self._planned: Optional[List[Any]] = None  # the actions as the C++ planner takes them
        self._b_at: Dict[StageMicroBatch, int] = {}  # where each B (or full backward) is in the actions
        self._at: Optional[int] = None           # the rank's place in its actions this step (None: unknown)
        self._warned = False
        self._let_go_stages: Set[int] = set()  # stages a session closed of whose B let go as it went

    @property
    def floor_bytes(self) -> int:
        """What one pass holds while it recomputes, the most over the stages
        seen: the least the budget can hold the sessions to."""
        return max(self.stage_bytes.values(), default=0)

    def set(self, budget_bytes: Optional[int], warn: bool = True, room: Optional[List[int]] = None) -> None:
        """A new budget of the sessions (None: none); ``warn=False``: a
        budget below the floor on purpose (a memory plan's measuring step),
        said nothing of. ``room``: under a memory plan, what it leaves the
        sessions while each of the rank's actions runs (``Plan.room_bytes``;
        ``budget_bytes`` is then the least of it)."""
        self.bytes = budget_bytes
        self.room = room
        self._warned = not warn or room is not None  # the plan counted its passes where they run

    def _room(self, at: Optional[int]) -> int:
        """What the sessions may hold while the action at index ``at``
        runs (None: anywhere in the step)."""
        assert self.bytes is not None
        room = self.room
        if not room:
            return self.bytes
        if at is None or len(room) != len(self.actions()) or not 0 <= at < len(room):
            return min(room)
        return room[at]

    def expect(self, stage_bytes: Dict[int, int], idle: Iterable[StageMicroBatch] = ()) -> None:
        """What a pass of each stage will hold from now on (a new memory
        plan), and the (stage, micro-batch) pairs whose passes recompute
        nothing (the plan keeps their blocks): replaces what was learnt;
        sessions that hold more raise it again as they close."""
        self.stage_bytes = dict(stage_bytes)
        self.idle = set(idle)
        self.kept_bytes = {}

    def kept(self, stage: int, nbytes: int) -> None:
        """A session of ``stage`` keeps ``nbytes`` for W after its B
        (trimmed to what W reads): what later Bs of it keep, at the most
        seen."""
        self.kept_bytes[stage] = max(self.kept_bytes.get(stage, 0), nbytes)

    @property
    def step_ended(self) -> bool:
        """The rank ran the last of its actions this step, in the schedule's order."""
        return self._at is not None and self._at == len(self.actions()) > 0

    def actions(self) -> List[Action]:
        """The rank's actions in one step (empty: the schedule keeps no order)."""
        if self._actions is None:
            self._actions = self._read_actions() or []
            for i, (kind, s, m) in enumerate(self._actions):
                if kind in ("B", "BW"):
                    self._b_at.setdefault((s, m), i)
        return self._actions

    def _planner_actions(self) -> List[Any]:
        if self._planned is None:
            self._planned = planner_actions(self.actions())
        return self._planned

    def step_begins(self) -> None:
        self._at = 0 if self.actions() else None

    def ran(self, action: Action) -> None:
        """A stage began ``action``: the place moves past it, or becomes
        unknown if the step runs another order than the schedule's."""
        actions = self.actions()
        if self._at is not None and self._at < len(actions) and actions[self._at] == action:
            self._at += 1
        else:
            self._at = None

    def room_for_prefires(self, key: StageMicroBatch) -> Optional[int]:
        """The budget the session of ``key`` gets before a bubble prefire
        into it: the most it may hold (None: no cap)."""
        if self.bytes is None:
            return None
        if not self.stage_bytes or self._room(self._at) < self.floor_bytes:  # nothing learnt yet, or below the floor
            return 0
        held = self._held()
        held.pop(key, None)
        b_at = self._b_at.get(key)
        if self._at is None or b_at is None or b_at < self._at:
            return max(0, self._room(None) - self.floor_bytes - sum(held.values()))
        return max(0, self._headroom(held, self._at, b_at, self.floor_bytes, keep=True))

    def after_b(self, key: StageMicroBatch) -> Tuple[bool, List[StageMicroBatch]]:
        """After the B of ``key``: whether its session may keep its
        recomputation for W, and the bubble-prefired sessions to let go
        first so that it may (the planner's ``keep_for_w``)."""
        pending = self.pending()
        held = self._held()
        holds = held[key]
        if self.bytes is None or holds == 0:  # one that holds nothing has nothing to let go
            return True, []
        need = max(self.floor_bytes, holds)  # for a stage not seen close yet
        last = len(self.actions())
        prefired = sorted((k for k, mb in pending.items() if k != key and not mb.kept_for_w and held[k] > 0),
                          key=lambda k: self._b_at.get(k, last), reverse=True)
        keys, actions, bytes_held, room = self._sessions(held, need)
        b_at = self._b_at.get(key, -1) if actions else -1
        decision = _C.keep_for_w(room, actions, bytes_held, keys[key], b_at, need, [keys[k] for k in prefired])
        by_index = {i: k for k, i in keys.items()}
        return decision.keep, [by_index[i] for i in decision.let_go]

    def _held(self) -> Dict[StageMicroBatch, int]:
        return {k: self.holds(mb) for k, mb in self.pending().items()}

    def _sessions(self, held: Dict[StageMicroBatch, int], unseen_need: int) -> Tuple[
            Dict[StageMicroBatch, int], List[Any], List[int], List[int]]:
        """The rank's sessions as the planner counts them (Note [A rank's
        byte budget]): an index per (stage, micro-batch), its actions
        (``SessionAction``: each B or full backward holds its stage's need,
        a stage not seen close yet ``unseen_need``; each W that recomputes
        its stage's need), what each holds now, and the room at each action
        (one entry, anywhere in the step, without an order of actions)."""
        pending = self.pending()
        actions = self.actions()
        keys: Dict[StageMicroBatch, int] = {k: i for i, k in enumerate(held)}
        for _, stage, mb in actions:
            keys.setdefault((stage, mb), len(keys))
        session_actions = []
        for (kind, stage, mb), planned in zip(actions, self._planner_actions()):
            k = (stage, mb)
            mine = pending.get(k)
            session_actions.append(_C.SessionAction(
                kind=planned.kind, key=keys[k],
                need=0 if k in self.idle else self.stage_bytes.get(stage) or unseen_need,
                kept=self.kept_bytes.get(stage, -1), w_recomputes=mine is not None and mine.w_recomputes,
                kept_for_w=mine is not None and mine.kept_for_w))
        bytes_held = [0] * len(keys)
        for k, n in held.items():
            bytes_held[keys[k]] = n
        room = [self._room(at) for at in range(len(actions))] if actions else [self._room(None)]
        return keys, session_actions, bytes_held, room

    def _headroom(self, held: Dict[StageMicroBatch, int], begin: int, end: int, unseen_need: int, keep: bool,
                  now: Optional[int] = None) -> int:
        """The least room the sessions leave of the budget from now (the
        rank about to run action ``begin``, or running ``now``), holding
        ``held``, through the actions ``begin:end`` (the planner's
        ``least_session_room``); ``keep``: a later B keeps what it
        recomputed for W (what its stage's trimmed sessions keep), else it
        lets go and its W recomputes."""
        _, actions, bytes_held, room = self._sessions(held, unseen_need)
        return _C.least_session_room(room, actions, bytes_held, begin if now is None else now, begin, end, keep)

    def closed(self, stage: int, peak_bytes: int, b_let_go: bool = False) -> None:
        """A session of ``stage`` closed after holding at most ``peak_bytes``;
        ``b_let_go``: its B let go of what W does not read as it unpacked it.
        The first such session of a stage sets the stage's need afresh (the
        Bs before it held everything until they ended); later ones raise it."""
        if b_let_go and stage not in self._let_go_stages:
            self._let_go_stages.add(stage)
            self.stage_bytes[stage] = peak_bytes
        else:
            self.stage_bytes[stage] = max(self.stage_bytes.get(stage, 0), peak_bytes)
        if self.bytes is not None and self.floor_bytes > self.bytes and not self._warned:
            self._warned = True
            warnings.warn(
                f"prefire.pipelining: budget_bytes={self.bytes} is below what one backward pass of a micro-batch "
                f"holds while it runs ({self.floor_bytes} bytes, its checkpoints' recomputation): this rank keeps "
                "nothing for W and prefires nothing, and holds that much during each pass", UserWarning,
                stacklevel=2)
