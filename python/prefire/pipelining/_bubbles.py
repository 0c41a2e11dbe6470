"""Prefire in a pipeline's bubbles: which checkpoints a rank recomputes while
it waits on a receive, and for how long (used by :mod:`prefire.pipelining`).

Note [Filling bubbles]
A wait point is a (kind, stage, micro-batch) receive the schedule waits on;
the same points recur every step, with about the same idle time. Two rules
decide what a rank recomputes there, both stopping when the receive is
reported complete or the rank's byte budget refuses a prefire (Note [A
rank's byte budget] in _budget.py):

1. At a backward receive of (stage, micro-batch) the rank's next compute is
   that micro-batch's backward, which would recompute its checkpoints first
   anyway (the runtime pops the receive right before backward_one_chunk).
   So they are all prefired there, last block first, whatever the wait: the
   same work moved earlier, into the wait, so it can only shorten it and
   delays nothing (nothing else runs on the rank in between).
2. Then, at any point, the checkpoints of the micro-batches whose backward
   comes next on this rank (in the schedule's own order of B and
   full-backward actions), last block first, while the time spent here
   plus one checkpoint's recomputation (a running mean) fits the point's
   slack. This work is pulled ahead of other actions (a forward a
   neighbour waits for), so it must stay inside the bubble.

The slack is measured, not guessed: during the first training steps after
``enable`` (``bubble_warmup_steps``, 3 by default; ``schedule.eval()`` steps
neither count nor teach) nothing is prefired, and each point's slack becomes
the shortest wait seen there in all of them but the first (which also infers
shapes and warms up), the natural bubble. It is not re-learned from later waits:
those depend on the prefires of both neighbours, and a rank whose prefires
ran long makes its neighbour wait longer, which would teach the neighbour a
longer slack in turn. A wait that ended at once (under 0.1 ms) after rule-2
prefires means they may have run past the receive: the point's slack
shrinks by one checkpoint's time, so it settles just inside the bubble.
Measuring is needed because a Gloo receive reports completion only once
waited on (``is_completed()`` is False before ``wait()`` however long ago
the data came); backends that report arrival also stop the prefires early
through ``is_completed()``.

Note [Running a placement]
``enable(schedule, bubble=True, placement=P)`` replaces both rules with a
placement: before each action of the rank's order that ``P`` names, the
(stage, micro-batch, count) checkpoints it lists are prefired, last block
first, whatever the wait -- the recompute actions of the simulator's mode
"placed" (Note [Where recomputation can run] in
apps/pipeline_sim/place.py, whose search writes such a ``P`` for a
schedule, a rank count and measured durations). An action that pops a
receive runs them at the pop, before the wait; any other at the start of
its stage method (the wrappers of Note [Where prefire hooks into a pipeline
schedule]): no hook point beyond the two the rules use. Why both exist: the
rules need nothing but the schedule and learn each wait as it is on this
machine; a placement is what the simulator found from one run's durations,
and where the search reaches further than the rules (DualPipeV,
docs/benchmarks.md) it is the way to run that. Placed prefires run from the
second training step (the first infers shapes), never in ``eval()`` steps,
through the same budget (Note [A rank's byte budget]) and FSDP2 rule as
the rules'. ``enable`` checks the placement against the rank's order:
every named action is one of the rank's, every listed micro-batch's
forward runs before it and its backward (B or full) not before it.

On a stage that holds FSDP2 modules a prefire may all-gather (Note
[Prefire of FSDP2-sharded blocks] in _fsdp.py): a collective that every
rank of the FSDP group must issue at the same point, where the ranks' waits
(and so these rules' choices) differ, and an all-gather that backward would
then do again. So both rules pass over such a stage's micro-batches while
any of its FSDP modules is resharded, and prefire them only while all are
gathered: no collective, no all-gather added.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .. import _C
from .actions import Action
from .placement import Placement

_ENDED_AT_ONCE_S = 1e-4

WaitPoint = Tuple[str, int, int]


class BubbleFiller:
    """The bubble prefires of one rank's schedule (Note [Filling bubbles])."""

    def __init__(self, order: Optional[List[Action]], pending: Callable[[int, int], Optional[Any]], stats,
                 prefire=_C.prefire, clock=time.monotonic, warmup_steps: int = 3,
                 placement: Optional[Placement] = None) -> None:
        """``pending(stage_index, micro_batch)``: that micro-batch's
        ``_MicroBatch`` (session, handles, prefired) or None; ``prefire``
        and ``clock`` are ``prefire.prefire`` and ``time.monotonic`` (a test
        passes its own); ``order``: the rank's actions in one step (None:
        the schedule keeps no order); ``placement``: Note [Running a
        placement], checked against ``order`` (``check_placement``)."""
        self.prefire = prefire
        self.clock = clock
        self.pending = pending
        self.stats = stats
        self.slack: Dict[WaitPoint, float] = {}
        self.spent: Dict[WaitPoint, float] = {}   # prefire seconds at a point whose wait is running
        self.done: set = set()                    # (stage, micro-batch) whose backward started this step
        self.steps = 0                            # training steps begun
        self.warmup_steps = warmup_steps          # the first only warms up (shapes are inferred then)
        self.training = True                      # the current step has a backward (not schedule.eval())
        self.checkpoint_s: Optional[float] = None
        self.placement = placement
        self.actions = set(order or ())
        self.backwards = [(stage, mb) for kind, stage, mb in order or () if kind in ("B", "BW")]
        self.placed: set = set()                  # actions whose placed prefires ran this step

    def new_step(self, training: bool = True) -> None:
        self.done.clear()
        self.placed.clear()
        self.training = training
        if training:
            self.steps += 1

    def backward_started(self, stage_index: int, micro_batch: int) -> None:
        self.done.add((stage_index, micro_batch))

    def before_action(self, action: Action) -> None:
        """The rank is about to run ``action`` (its receive, if any, not
        waited on yet): a placement's prefires before it (Note [Running a
        placement])."""
        if self.placement is None or action in self.placed or not self.training or self.steps <= 1:
            return
        self.placed.add(action)
        begin = self.clock()
        ran = 0
        for stage, mb, count in self.placement.get(action, ()):
            ran += self._fill((stage, mb), (), fits=lambda: True, limit=count)[0]
        if ran:
            self.stats.bubble_seconds += self.clock() - begin

    def before_wait(self, kind: str, stage_index: int, micro_batch: int, works: Sequence[Any]) -> None:
        if self.placement is not None:
            backward = ("B", stage_index, micro_batch)
            self.before_action(("F", stage_index, micro_batch) if kind == "forward" else
                               backward if backward in self.actions else ("BW", stage_index, micro_batch))
            return
        point = (kind, stage_index, micro_batch)
        begin = self.clock()
        if not self.training or self.steps <= self.warmup_steps:
            return
        first = 0
        if kind == "backward":  # rule 1
            first, _ = self._fill((stage_index, micro_batch), works, fits=lambda: True)
        slack = self.slack.get(point)
        ran = 0
        if slack is not None:  # rule 2
            def fits() -> bool:
                return self.clock() - begin + (self.checkpoint_s or 0.0) <= slack

            for target in self.backwards:
                if target in self.done:
                    continue
                count, stopped = self._fill(target, works, fits)
                ran += count
                if stopped:
                    break
        spent = self.clock() - begin
        if first or ran:
            self.stats.bubble_seconds += spent
        if ran:
            self.spent[point] = spent

    def _fill(self, target: Tuple[int, int], works: Sequence[Any], fits: Callable[[], bool],
              limit: Optional[int] = None) -> Tuple[int, bool]:
        """Prefires ``target``'s checkpoints, last block first, while the
        receive is pending and ``fits()``; returns how many it recomputed and
        whether it stopped for the receive or the time (not for running out
        of checkpoints or budget); at most ``limit`` prefires. A micro-batch
        not ``ready()`` is passed over (an FSDP2 stage not all gathered;
        Note [Filling bubbles])."""
        mb = self.pending(*target)
        if mb is not None and mb.ready is not None and not mb.ready():
            return 0, False  # its recomputation would all-gather (FSDP2): left to B
        ran = tried = 0
        while mb is not None and mb.prefired < len(mb.handles) and (limit is None or tried < limit):
            if (works and all(w.is_completed() for w in works)) or not fits():
                return ran, True
            handle = mb.handles[len(mb.handles) - 1 - mb.prefired]
            started = self.clock()
            tried += 1
            status = self.prefire(handle, mb.session)
            if status == _C.PrefireStatus.REFUSED_OVER_BUDGET:
                self.stats.bubble_refused += 1
                mb.prefired = len(mb.handles)  # its session is full: the rest is B's
                break
            mb.prefired += 1
            if status == _C.PrefireStatus.RECOMPUTED:
                ran += 1
                took = self.clock() - started
                self.checkpoint_s = took if self.checkpoint_s is None else 0.8 * self.checkpoint_s + 0.2 * took
                self.stats.bubble_prefires += 1
        return ran, False

    def after_wait(self, kind: str, stage_index: int, micro_batch: int, begin: float, end: float) -> None:
        if self.placement is not None:
            return
        point = (kind, stage_index, micro_batch)
        spent = self.spent.pop(point, 0.0)
        waited = end - begin
        if not self.training or self.steps <= 1:
            return
        if self.steps <= self.warmup_steps:
            self.slack[point] = min(self.slack.get(point, waited), waited)
        elif spent > 0 and waited < _ENDED_AT_ONCE_S and point in self.slack:
            self.slack[point] = max(0.0, self.slack[point] - (self.checkpoint_s or 0.0))
