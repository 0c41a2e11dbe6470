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
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

from prefire.pipelining.actions import Action

from .place import PASSES
from .replay import Costs, Pipeline, Replay

StageMicroBatch = Tuple[int, int]


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


def fill(pipeline: Pipeline, result: Replay, wanted: Dict[StageMicroBatch, float]) -> Dict[StageMicroBatch, float]:
    """How much of ``wanted[(stage, mb)]`` seconds of recomputation the
    waits of ``result`` hold, each micro-batch's between its forward's end
    and its pass's start, earliest pass first (Note [The oracle fill and the
    recomputation's own time])."""
    held: Dict[StageMicroBatch, float] = {}
    for events in result.events:
        ends = {(s, mb): end for kind, s, mb, _, end in events if kind == "F"}
        jobs = sorted((begin, ends[(s, mb)], (s, mb)) for kind, s, mb, begin, _ in events
                      if kind in PASSES and (s, mb) in ends and wanted.get((s, mb), 0.0) > 0)
        left = {key: wanted[key] for _, _, key in jobs}
        for begin, end in sorted((b, e) for kind, _, _, b, e in events if kind == "wait" and e > b):
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
                t += run
    return held


def oracle(pipeline: Pipeline, rounds: int = 24) -> Tuple[float, Dict[StageMicroBatch, float]]:
    """The oracle's step and what it hides per (stage, micro-batch) (Note
    [The oracle fill and the recomputation's own time])."""
    work = _work(pipeline)
    current = pipeline.run("session")
    best_s, best = current.step_s, {}
    hidden: Dict[StageMicroBatch, float] = {}
    for i in range(rounds + 1):
        held = fill(pipeline, current, hidden)
        feasible = all(held.get(key, 0.0) >= want - 1e-12 for key, want in hidden.items())
        if feasible and current.step_s < best_s:
            best_s, best = current.step_s, dict(hidden)
        following = fill(pipeline, current, work) if feasible else held
        if i == rounds or _same(following, hidden):
            break
        hidden = following
        current = _session(pipeline, hidden)
    return best_s, best


def _same(a: Dict[StageMicroBatch, float], b: Dict[StageMicroBatch, float]) -> bool:
    return all(abs(a.get(k, 0.0) - b.get(k, 0.0)) <= 1e-12 for k in set(a) | set(b))


def hidden_over(session_s: float, step_s: Optional[float], cost_s: float) -> Optional[float]:
    """``(session - step) / cost``; None where there is no cost to hide or no step."""
    return None if step_s is None or cost_s <= 0 else (session_s - step_s) / cost_s

