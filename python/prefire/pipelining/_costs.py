"""The costs of a pipeline rank's blocks, from what its measuring forwards
and Ws measured (Note [A pipeline rank's memory plan] in _plan.py): what
each block was seen to hold and take, as BlockCosts. What a plan makes of
them (lifetimes, offloading's costs, what a plan holds) is the C++
planner's."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .. import _C
from .._measuring import Measured

KEEP, CHECKPOINT, SELECTIVE, OFFLOAD = _C.Choice.KEEP, _C.Choice.CHECKPOINT, _C.Choice.SELECTIVE, _C.Choice.OFFLOAD


@dataclass
class StageMeasured:
    """What the forwards of one stage and signature measured, per block:
    (kept bytes, what its measuring forward measured) of each micro-batch;
    and what a block still held after its micro-batch's W, per choice
    (KEEP, CHECKPOINT, SELECTIVE, OFFLOAD; None: not seen yet); where
    offloading is a choice, each run's copies into an offload tier and back."""

    blocks: List[List[Tuple[int, Measured]]] = field(default_factory=list)
    after: Dict[Any, List[Optional[int]]] = field(default_factory=dict)  # per choice, per block
    copies: List[List[Tuple[int, float]]] = field(default_factory=list)  # per block, per run: (bytes moved, seconds)


def stage_costs(measured: StageMeasured, stage: int, last: bool) -> List[Any]:
    """One BlockCost per block of ``stage`` (its group): the most it was
    measured to hold per choice, its median times, what it holds after its
    micro-batch's W (``last``: the last stage, whose blocks may hold their
    graph past W until seen not to) and, where offloading is a choice, its
    copies (the planner's ``with_offload``). The planner's ``rank_blocks``
    gives them their stage's lifetime over the rank's actions."""
    # per choice, per block: what it holds (selective: -1 where a block has none)
    wholes = {KEEP: [max(kept for kept, _ in runs) for runs in measured.blocks],
              CHECKPOINT: [max(r.input_bytes for _, r in runs) for runs in measured.blocks],
              SELECTIVE: [-1 if min(r.selective_bytes for _, r in runs) < 0
                          else max(r.selective_bytes for _, r in runs) for runs in measured.blocks]}
    shares = {c: _share(measured.after[c], wholes[c]) for c in wholes}
    costs = []
    for index, runs in enumerate(measured.blocks):
        after = {c: _after(measured.after[c][index], max(0, wholes[c][index]), last, shares[c]) for c in wholes}
        selective = wholes[SELECTIVE][index]
        cost = _C.BlockCost(
            saved_bytes=wholes[KEEP][index], input_bytes=wholes[CHECKPOINT][index],
            recompute_seconds=statistics.median(r.seconds for _, r in runs), group=stage,
            saved_after_bytes=after[KEEP], input_after_bytes=after[CHECKPOINT], selective_bytes=selective,
            selective_seconds=statistics.median(r.selective_seconds for _, r in runs) if selective >= 0 else 0.0,
            selective_after_bytes=after[SELECTIVE] if selective >= 0 else 0)
        copies = measured.copies[index] if measured.copies else []
        if copies:  # an offload moves what keeping it holds, each way
            cost = _C.with_offload(cost, moved_bytes=max(moved for moved, _ in copies),
                                   copy_seconds=statistics.median(seconds for _, seconds in copies))
        costs.append(cost)
    return costs


def _after(measured: Optional[int], whole: int, last: bool, share: Optional[float]) -> int:
    """What a block is taken to hold after its micro-batch's W: what was
    measured; before that, on the last stage the largest ``share`` of their
    bytes its other blocks were seen to hold then (all of it when none
    was), elsewhere nothing."""
    if measured is not None:
        return min(whole, measured)
    if not last:
        return 0
    return whole if share is None else min(whole, math.ceil(share * whole))


def _share(after: List[Optional[int]], wholes: List[int]) -> Optional[float]:  # wholes of -1: none
    seen = [a / w for a, w in zip(after, wholes) if a is not None and w > 0]
    return max(seen, default=None)
