"""A rank's compute actions in a pipeline schedule's own order (used by
:mod:`prefire._bubbles`, :mod:`prefire._budget` and the pipeline
simulator)."""

from __future__ import annotations

from typing import Any, Iterable, List, Optional, Tuple

#: (kind, stage index, micro-batch): kind "F", "B" (input gradients), "W"
#: (weight gradients) or "BW" (full backward)
Action = Tuple[str, int, int]


def rank_actions(schedule) -> Optional[List[Action]]:
    """The compute actions of ``schedule``'s rank in one step, in order (an
    OVERLAP_F_B action as its parts); None for a schedule that keeps no
    order of actions (those not built on ``_PipelineScheduleRuntime``)."""
    order = getattr(schedule, "pipeline_order_with_comms", None)
    if order is None:
        return None
    return compute_actions(order[schedule.rank])


def compute_actions(actions: Iterable[Any]) -> List[Action]:
    """The compute actions among torch's ``_Action``s (None entries and
    communication left out, an OVERLAP_F_B action as its parts)."""
    from torch.distributed.pipelining.schedules import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD

    kinds = {FORWARD: "F", BACKWARD_INPUT: "B", BACKWARD_WEIGHT: "W", FULL_BACKWARD: "BW"}
    return [(kinds[a.computation_type], a.stage_index, a.microbatch_index)
            for action in actions if action is not None
            for a in (action.sub_actions or (action,)) if a.computation_type in kinds]
