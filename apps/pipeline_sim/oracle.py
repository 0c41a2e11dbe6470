"""What a step's recomputation costs and what the waits could hold of it,
were it infinitely divisible (``python -m pipeline_sim place``'s oracle
and its accounting of session mode's step).

Note [The oracle fill and the recomputation's own time]
Two measures beside the placements of Note [Where recomputation can run]:

* **The step's recomputation, and the rest of session mode's cost.**
  ``session - none`` is not all recomputation: session mode's passes also
  pay for what a session does around it (the pack and unpack hooks, the
  handles, retaining saved tensors between B and W). Replaying session mode
  with every pass shorter by its own recomputation (``shortened``: the
  checkpoints it recomputes times one checkpoint's measured time, its B
  first, then its W, each down to none mode's pass) gives the step without
  recomputation: ``recompute_s = session - that`` is what recomputation
  costs the step, ``overhead_s = that - none`` what the session costs
  beyond it. H over recomputation alone is ``(session - X) / recompute_s``.
* **The oracle.** Recomputation split into pieces as small as wanted, each
  piece of a micro-batch's checkpoints run by its rank in a wait between
  that micro-batch's forward and its pass: on one rank that is preemptive
  scheduling with release times (the forward's end) and deadlines (the
  pass's start) into the waits, which earliest-deadline-first solves
  exactly (``fill``). Filling a wait changes nothing else; shortening the
  passes by what was hidden does: the ranks run ahead and the waits move.
  So the oracle iterates: replay with the passes shortened by ``h``; if its
  waits hold ``h`` (EDF meets every demand) the step is one a divisible
  placement reaches, and ``h`` grows to all the new waits hold; if not,
  ``h`` shrinks to what they hold. The least feasible step in at most
  ``rounds`` replays is the oracle's (session mode's, ``h = 0``, is
  feasible). It is a relaxation of the placements of ``place.py`` (they
  move whole checkpoints and only before an action), not a bound on them:
  the floor is that. ``H oracle = (session - oracle) / (session - none)``.

Note [The oracle fill in whole checkpoints]
The oracle's fill is also a placement the runtime can run
(``oracle_placement``): each piece of it goes before the action whose
wait held it (a wait is recorded just before that action), a
micro-batch's pieces rounded to whole checkpoints as they add up (to the
nearest: 1.33 checkpoints' worth places one), so each micro-batch is
prefired as often as its pieces round to, in the order EDF ran them. A
whole checkpoint rounded up runs past its wait and delays the action it
stands before; one rounded down stays in its pass. So the rounding is
replayed (mode "placed"), and what it left in the passes is filled again
into that replay's waits the same way, kept while the step ends earlier (at
most ``rounds`` times). It needs one oracle and a few replays where the
search needs thousands, so it is the search's start when better than the
rules', and at rank counts the search is not run for it is the placement
compared with the oracle. Measured (docs/benchmarks.md, "The oracle's
fill in whole checkpoints"): on DualPipeV at 16 ranks the rules hide 0.81
of what the oracle hides and the whole checkpoints all of it (0.83 and 0.98
at an H200's ratios). EDF runs each piece as late as its pass allows, so on
ZBV and DualPipeV it holds fewer checkpoints ahead than the rules, which
prefire a micro-batch's checkpoints at its gradient's receive; on
interleaved 1F1B as many or more.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, NamedTuple, Optional, Tuple

from prefire.pipelining.actions import Action
from prefire.pipelining.placement import Placement

from .place import PASSES, objective
from .replay import Costs, Pipeline, Replay

StageMicroBatch = Tuple[int, int]
Piece = Tuple[Action, StageMicroBatch, float]  # before which action, whose recomputation, how many seconds


def recompute_of(costs: Costs, stage: int) -> float:
    """One micro-batch's recomputation on ``stage``: its checkpoints times
    one checkpoint's time."""
    return costs.checkpoints.get(stage, 0) * costs.checkpoint.get(stage, 0.0)


def shortened(pipeline: Pipeline, removed: Dict[StageMicroBatch, float]) -> Costs:
    """Session mode's costs with each micro-batch's passes shorter by
    ``removed[(stage, mb)]`` seconds of recomputation: its B (or full
    backward) first, then its W, each down to none mode's pass (as prefires
    shorten them, Note [What the simulator replays]). Replay them in
    session mode only: the durations are per action, whatever the mode."""
    costs = pipeline.costs
    session, none = costs.action["session"], costs.action["none"]
    instance: Dict[Action, float] = dict(costs.instance)

    def took(action: Action) -> float:
        return costs.instance.get(action, session[(action[0], action[1])])

    def inside(action: Action) -> float:
        return max(0.0, took(action) - none.get((action[0], action[1]), 0.0))

    for order in pipeline.orders:
        for action in order:
            kind, stage, mb = action
            gone = removed.get((stage, mb), 0.0)
            if kind == "F" or gone <= 0:
                continue
            if kind == "W":
                gone = max(0.0, gone - inside(("B", stage, mb)))
            instance[action] = took(action) - min(gone, inside(action))
    return dataclasses.replace(costs, instance=instance)


def _work(pipeline: Pipeline) -> Dict[StageMicroBatch, float]:
    """Each micro-batch's recomputation per stage, by its pass."""
    return {(stage, mb): recompute_of(pipeline.costs, stage)
            for order in pipeline.orders for kind, stage, mb in order if kind in PASSES}


def without_recompute(pipeline: Pipeline) -> Replay:
    """Session mode with every pass shorter by its own recomputation."""
    return _session(pipeline, _work(pipeline))


def _session(pipeline: Pipeline, removed: Dict[StageMicroBatch, float]) -> Replay:
    return dataclasses.replace(pipeline, costs=shortened(pipeline, removed)).run("session")


def fill(pipeline: Pipeline, result: Replay, wanted: Dict[StageMicroBatch, float],
         pieces: Optional[List[Piece]] = None) -> Dict[StageMicroBatch, float]:
    """How much of ``wanted[(stage, mb)]`` seconds of recomputation the
    waits of ``result`` hold, each micro-batch's between its forward's end
    and its pass's start, earliest pass first (Note [The oracle fill and the
    recomputation's own time]); ``pieces``: appended to, each piece run, in
    order per rank, with the action its wait stood before."""
    held: Dict[StageMicroBatch, float] = {}
    for events in result.events:
        ends = {(s, mb): end for kind, s, mb, _, end in events if kind == "F"}
        jobs = sorted((begin, ends[(s, mb)], (s, mb)) for kind, s, mb, begin, _ in events
                      if kind in PASSES and (s, mb) in ends and wanted.get((s, mb), 0.0) > 0)
        left = {key: wanted[key] for _, _, key in jobs}
        # a wait is recorded just before the action that stood in it (replay.py)
        waits = sorted((e[3], e[4], events[i + 1][:3]) for i, e in enumerate(events) if e[0] == "wait" and e[4] > e[3])
        for begin, end, action in waits:
            t = begin
            while t < end:
                ready = [(due, key) for due, release, key in jobs if left[key] > 0 and release <= t < due]
                if not ready:  # the next release in this wait, if any
                    t = min((release for due, release, key in jobs if left[key] > 0 and t < release < min(due, end)),
                            default=end)
                    continue
                due, key = min(ready)
                until = min([end, due] + [release for d, release, k in jobs
                                          if left[k] > 0 and t < release and d < due])
                run = min(left[key], until - t)
                left[key] -= run
                held[key] = held.get(key, 0.0) + run
                if pieces is not None:
                    pieces.append((action, key, run))
                t += run
    return held


class Oracle(NamedTuple):
    step_s: float
    hidden: Dict[StageMicroBatch, float]  # per (stage, micro-batch): the seconds of recomputation it hides
    replay: Replay                        # session mode with the passes shortened by ``hidden``: its waits hold it


def oracle(pipeline: Pipeline, rounds: int = 24) -> Oracle:
    """The oracle's step, what it hides per (stage, micro-batch), and the
    replay whose waits hold it (Note [The oracle fill and the
    recomputation's own time])."""
    work = _work(pipeline)
    current = pipeline.run("session")
    best = Oracle(current.step_s, {}, current)
    hidden: Dict[StageMicroBatch, float] = {}
    for i in range(rounds + 1):
        held = fill(pipeline, current, hidden)
        feasible = all(held.get(key, 0.0) >= want - 1e-12 for key, want in hidden.items())
        if feasible and current.step_s < best.step_s:
            best = Oracle(current.step_s, dict(hidden), current)
        following = fill(pipeline, current, work) if feasible else held
        if i == rounds or _same(following, hidden):
            break
        hidden = following
        current = _session(pipeline, hidden)
    return best


def oracle_placement(pipeline: Pipeline, found: Oracle, rounds: int = 4) -> Placement:
    """The oracle's fill in whole checkpoints (Note [The oracle fill in whole
    checkpoints]): each piece placed before the action its wait stood
    before, each micro-batch's pieces rounded as they add up; then what is
    left, into the waits of that placement's replay, while the step ends
    earlier."""
    placement = _whole(pipeline, found.replay, found.hidden, {})
    best = pipeline.run("placed", placement)
    checkpoint, checkpoints = pipeline.costs.checkpoint, pipeline.costs.checkpoints
    for _ in range(rounds):
        placed = _placed(placement)
        left = {key: (checkpoints.get(key[0], 0) - placed.get(key, 0)) * checkpoint.get(key[0], 0.0)
                for key in _work(pipeline)}
        more = _whole(pipeline, best, left, placement)
        trial = pipeline.run("placed", more)
        if objective(trial) >= objective(best):
            break
        placement, best = more, trial
    return placement


def _placed(placement: Placement) -> Dict[StageMicroBatch, int]:
    out: Dict[StageMicroBatch, int] = {}
    for items in placement.values():
        for stage, mb, count in items:
            out[(stage, mb)] = out.get((stage, mb), 0) + count
    return out


def _whole(pipeline: Pipeline, result: Replay, wanted: Dict[StageMicroBatch, float],
           start: Placement) -> Placement:
    """``start`` and the pieces of ``wanted`` that ``result``'s waits hold,
    in whole checkpoints, each micro-batch's rounded as they add up."""
    pieces: List[Piece] = []
    fill(pipeline, result, wanted, pieces)
    checkpoint = pipeline.costs.checkpoint
    placement = {action: list(items) for action, items in start.items()}
    so_far: Dict[StageMicroBatch, float] = {}
    placed: Dict[StageMicroBatch, int] = {}
    for action, key, seconds in pieces:
        so_far[key] = so_far.get(key, 0.0) + seconds
        whole = int(min(so_far[key], wanted[key]) / checkpoint[key[0]] + 0.5)
        if whole > placed.get(key, 0):
            placement.setdefault(action, []).append((key[0], key[1], whole - placed.get(key, 0)))
            placed[key] = whole
    return placement


def _same(a: Dict[StageMicroBatch, float], b: Dict[StageMicroBatch, float]) -> bool:
    return all(abs(a.get(k, 0.0) - b.get(k, 0.0)) <= 1e-12 for k in set(a) | set(b))


def hidden_over(session_s: float, step_s: Optional[float], cost_s: float) -> Optional[float]:
    """``(session - step) / cost``; None where there is no cost to hide or no step."""
    return None if step_s is None or cost_s <= 0 else (session_s - step_s) / cost_s

