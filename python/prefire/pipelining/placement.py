"""A placement of a rank's recomputation: before which of its actions to
prefire which checkpoints (Note [Running a placement] in ``_bubbles.py``).
One type, one check against a rank's order of actions, and one file
format: what ``enable(schedule, bubble=True, placement=...)`` runs and what
the pipeline simulator's ``place --write-placement`` writes, for every rank
of a pipeline."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from .actions import Action

#: before an action of the rank's order, (stage, micro-batch, count) checkpoints to prefire, last block first
Placement = Dict[Action, List[Tuple[int, int, int]]]

_WHERE = "prefire.pipelining.enable: placement"


def check_placement(placement: Any, order: Optional[List[Action]]) -> Placement:
    """``placement`` as a dict of lists of tuples, after checking it against
    the rank's ``order`` of actions: every named action is one of the
    rank's, every listed micro-batch's forward runs before it and its
    backward (B or full) not before it. ValueError naming the first entry
    that does not fit."""
    if order is None:
        raise ValueError(f"{_WHERE} needs a schedule that keeps an order of actions (one built on "
                         "_PipelineScheduleRuntime)")
    if not isinstance(placement, dict):
        raise ValueError(f"{_WHERE} must be a dict from (kind, stage, micro-batch) to [(stage, micro-batch, count)], "
                         f"got {type(placement).__name__}")
    index = {action: i for i, action in enumerate(order)}
    out: Placement = {}
    for key, items in placement.items():
        action = tuple(key) if isinstance(key, (tuple, list)) else key
        if action not in index:
            raise ValueError(f"{_WHERE} names {key!r}, not an action of this rank's order (its actions are "
                             f"(kind, stage, micro-batch) with kind F, B, W or BW)")
        out[action] = [_checked_item(key, item, index, index[action]) for item in items]
    return out


def _checked_item(key: Any, item: Any, index: Dict[Action, int], at: int) -> Tuple[int, int, int]:
    if not (isinstance(item, (tuple, list)) and len(item) == 3 and all(type(v) is int for v in item)
            and item[2] >= 1):
        raise ValueError(f"{_WHERE}[{key!r}] lists {item!r}; each entry is (stage, micro-batch, count) of ints "
                         "with count >= 1")
    stage, mb, count = item
    forward = index.get(("F", stage, mb))
    backward = index.get(("B", stage, mb), index.get(("BW", stage, mb)))
    if forward is None or backward is None:
        raise ValueError(f"{_WHERE}[{key!r}] lists stage {stage} micro-batch {mb}, which this rank does not "
                         "run forward and backward")
    if not forward < at <= backward:
        raise ValueError(f"{_WHERE}[{key!r}] prefires stage {stage} micro-batch {mb} outside its forward and "
                         "backward: a checkpoint can be recomputed only after the first and before the second")
    return stage, mb, count


def placement_file(placement: Placement, schedule: str, world: int, micro_batches: int,
                   stage_rank: Callable[[int], int]) -> Dict[str, Any]:
    """Every rank's placement in one JSON-able dict: the schedule's name,
    rank count and micro-batches it was placed for, and per rank its
    entries ``[action, items]`` (``stage_rank(stage)``: the rank that runs
    a stage)."""
    ranks: List[List[Any]] = [[] for _ in range(world)]
    for action, items in sorted(placement.items()):
        ranks[stage_rank(action[1])].append([list(action), [list(item) for item in items]])
    return {"schedule": schedule, "world": world, "micro_batches": micro_batches, "ranks": ranks}


def check_placement_file(data: Dict[str, Any], schedule: str, world: int, micro_batches: int,
                         what: str = "placement") -> None:
    """ValueError unless ``data`` (a :func:`placement_file`, or what:
    "choices", a ``plans.choices_file``) was made for this schedule, rank
    count and number of micro-batches."""
    got = {key: data.get(key) for key in ("schedule", "world", "micro_batches")}
    want = {"schedule": schedule, "world": world, "micro_batches": micro_batches}
    if got != want or not isinstance(data.get("ranks"), list) or len(data["ranks"]) != world:
        raise ValueError(f"prefire.pipelining: the {what} was made for {got}, this run is {want} (the "
                         f"simulator's place --write-{what} writes one per schedule, rank count and micro-batch "
                         "count)")


def rank_placement(data: Dict[str, Any], rank: int) -> Placement:
    """One rank's placement from a :func:`placement_file` (not checked
    against its order: :func:`check_placement` and ``enable`` do that)."""
    return {tuple(action): [tuple(item) for item in items] for action, items in data["ranks"][rank]}
