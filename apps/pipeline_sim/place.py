"""Where a rank's recomputation can run (``python -m pipeline_sim place``):
the filler's rules, a search over placements, and the most any placement
could hide.

Note [Where recomputation can run]
A checkpoint's recomputation may run on its rank at any point after its
micro-batch's forward and before the pass that reads it; wherever it runs,
it holds its bytes from then on. The replay models that as recompute
actions of their own (mode "placed", replay.py): before an action of the
rank's order, (stage, micro-batch, count) checkpoints run back to back when
the rank reaches that action, whether what the action consumes is there or
not, so placed before an action that waits they fill the wait, placed
before one that does not they delay it. Four placements are compared,
each replayed with the same (median) durations:

* the rules of Note [Filling bubbles] (the runtime's), as prefire mode
  replays them with the exact slack (session mode's waits), and recorded
  as a placement (``rules_placement``): replaying it in mode "placed" gives
  the same timeline;
* the oracle's fill in whole checkpoints (Note [The oracle fill in whole
  checkpoints] in oracle.py);
* a search (``search``) that starts from the better of those two and moves one
  checkpoint at a time to any point between its forward and its pass (or
  back into the pass), keeping a move when the step ends earlier or, at
  the same step, the ranks' forwards and backwards end earlier in sum (the
  step is the slowest rank's, so a move that helps another rank first shows
  there); until a sweep over every checkpoint moves none (four at most). Optionally at
  most ``max_held`` checkpoints per rank recomputed before their pass at once
  (a memory plan's room, in checkpoints);
* the floor (``floor_s``): no placement, and no order of the rank's actions,
  ends a step before every rank has done session mode's work after its
  first input arrived. A prefire moves recomputation; it never removes it
  (a pass shortens by at most what was prefired, Note [What the simulator
  replays]). And a rank's first input arrives after the forwards of the
  ranks before it, which hold no recomputation. So the step is at least,
  over the ranks, the start of the rank's first action in session mode's
  replay plus all of its actions in session mode (with the rank's own time
  per action), plus the step's ending. ``H max = (session - floor) /
  (session - none)``, at most 1 (the floor leaves out the waits no
  checkpointing has too, so it can lie below none's step).

The floor is what bounds H, not the waits: a rank's waits before its first
forward (the forward chain reaching it) are bubbles no recomputation can
use, since nothing is forwarded yet, and with micro-batches twice the ranks
a rank's waits after that are short beside its recomputation. So "all
waits / all recomputation" (the column the program printed as the bound
before) overstates what any filler can reach. Measured (docs/benchmarks.md,
"Where recomputation can run"; 2-rank runs, predicted to 4-16): the rules
come within 0.01 of the floor on ZBV at 4-16 ranks and within 0.05 on
interleaved zero bubble, whose floors stay under H = 0.35; the search
adds most on DualPipeV (H 0.45 -> 0.54 at 8 ranks, floor 0.59), which the
program's placed mode runs (Note [Running a placement] in _bubbles.py).
"""

from __future__ import annotations

import copy
from typing import List, Optional, Tuple

from prefire.pipelining.placement import Placement

from .replay import Pipeline, Replay

PASSES = ("B", "BW")


def rules_placement(prefired: Replay) -> Placement:
    """The bubble rules' prefires in a prefire-mode replay, as a placement:
    each one before the action that followed it on its rank."""
    placement: Placement = {}
    for events in prefired.events:
        pending: List[Tuple[int, int, int]] = []
        for kind, stage, mb, _, _ in events:
            if kind == "recompute-bubble":
                pending.append((stage, mb, 1))
            elif kind != "wait" and pending:
                placement.setdefault((kind, stage, mb), []).extend(pending)
                pending = []
    return placement


def floor_s(pipeline: Pipeline) -> float:
    """The earliest any placement can end the step (Note [Where
    recomputation can run])."""
    costs = pipeline.costs
    session = pipeline.run("session")
    durations = costs.action["session"]
    ends = []
    for rank, order in enumerate(pipeline.orders):
        first = next(e[3] for e in session.events[rank] if e[0] != "wait")
        work = sum(costs.instance.get(a, durations[(a[0], a[1])]) + costs.overhead for a in order)
        ends.append(first + work)
    return max(ends) + costs.tail


def held_ahead(result: Replay) -> List[int]:
    """Per rank, the most checkpoints recomputed by placed actions and not
    yet read by their pass at one time."""
    out = []
    for events in result.events:
        passes = {(stage, mb): begin for kind, stage, mb, begin, _ in events if kind in PASSES}
        moments: List[Tuple[float, int]] = []
        for kind, stage, mb, begin, end in events:
            if kind == "recompute-placed":  # one event per checkpoint
                moments.append((begin, 1))
                moments.append((passes.get((stage, mb), end), -1))
        held = most = 0
        for _, change in sorted(moments, key=lambda m: (m[0], m[1])):
            held += change
            most = max(most, held)
        out.append(most)
    return out


def objective(result: Replay) -> Tuple[float, float]:
    return (round(result.step_s, 9),
            sum(e[4] for events in result.events for e in events if e[0] in ("F",) + PASSES))


def _take_one(placement: Placement, stage: int, mb: int) -> Tuple[Placement, bool]:
    """``placement`` less one of ``(stage, mb)``'s placed checkpoints (the
    first found), and whether there was one."""
    out = copy.deepcopy(placement)
    for action, items in out.items():
        for i, (s, m, count) in enumerate(items):
            if (s, m) == (stage, mb):
                if count > 1:
                    items[i] = (s, m, count - 1)
                else:
                    del items[i]
                if not items:
                    del out[action]
                return out, True
    return out, False


def search(pipeline: Pipeline, start: Optional[Placement] = None, max_held: Optional[int] = None,
           every_point: bool = False, sweeps: int = 4) -> Tuple[Placement, Replay]:
    """A local search over placements (Note [Where recomputation can run]):
    from ``start``, one checkpoint at a time, to the point that ends the
    step earliest. Candidate points: before the actions between the
    checkpoint's forward and its pass that waited, or are a W, or the pass
    itself (``every_point``: before every action in between). ``max_held``:
    at most this many checkpoints per rank held recomputed before their
    pass at once (``held_ahead``)."""
    def fits(result: Replay) -> bool:
        return max_held is None or max(held_ahead(result)) <= max_held

    placement = copy.deepcopy(start or {})
    current = pipeline.run("placed", placement)
    if not fits(current):
        placement, current = {}, pipeline.run("placed", {})
    best = objective(current)
    for _ in range(sweeps):
        moved = 0
        for order in pipeline.orders:
            index = {action: i for i, action in enumerate(order)}
            for kind, stage, mb in order:
                if kind not in PASSES:
                    continue
                first, last = index[("F", stage, mb)] + 1, index[(kind, stage, mb)]
                for slot in range(pipeline.costs.checkpoints.get(stage, 0)):
                    # the first slots move a placed checkpoint, the others place one its pass recomputes
                    placed = sum(n for items in placement.values() for s, m, n in items if (s, m) == (stage, mb))
                    rest, had = _take_one(placement, stage, mb) if slot < placed else (placement, False)
                    chosen = None
                    if had:  # back into its pass
                        result = pipeline.run("placed", rest)
                        if objective(result) < best:
                            best, chosen = objective(result), (rest, result)
                    points = [order[i] for i in range(first, last + 1)
                              if every_point or i == last or order[i][0] == "W" or current.waited.get(order[i], 0) > 0]
                    for point in points:
                        trial = copy.deepcopy(rest)
                        trial.setdefault(point, []).append((stage, mb, 1))
                        result = pipeline.run("placed", trial)
                        got = objective(result)
                        if got < best and fits(result):
                            best, chosen = got, (trial, result)
                    if chosen is not None:
                        placement, current = chosen
                        moved += 1
        if not moved:
            break
    return placement, current
