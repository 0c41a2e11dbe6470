"""A pipeline rank's plans, as the C++ planner counts them
(``prefire/pipeline_plan.h``): its blocks with their stage's lifetime over
the rank's actions, the planner's items (one per stage, micro-batch and
block, so that a plan chooses per micro-batch), and a plan seen per stage.
``enable(schedule, memory_budget=...)`` plans so (Note [A pipeline rank's
memory plan] in ``_plan.py``); the pipeline simulator predicts with them.
Blocks are :class:`prefire.BlockCost` whose ``group`` is their stage."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

from .. import _C
from .actions import Action, planner_actions

StagePlan = _C.StagePlan


def rank_blocks(blocks: Sequence[_C.BlockCost], actions: Sequence[Action], micro_batches: int) -> List[_C.BlockCost]:
    """``blocks`` with their stage's lifetime over the rank's ``actions``
    (alive, done and passes per action; in flight the most alive at once);
    without actions, in flight ``micro_batches`` at every moment."""
    return _C.rank_blocks(list(blocks), planner_actions(actions), micro_batches)


def rank_items(blocks: Sequence[_C.BlockCost], actions: Sequence[Action], micro_batches: int) -> List[_C.BlockCost]:
    """The planner's items for ``blocks``: with ``actions``, one per (stage,
    micro-batch, block), stage by stage, then micro-batch, then block;
    without, :func:`rank_blocks`."""
    return _C.rank_items(list(blocks), planner_actions(actions), micro_batches)


def stage_plans(plan: _C.Plan, blocks: Sequence[_C.BlockCost], micro_batches: int) -> List[StagePlan]:
    """``plan`` (of ``rank_items(blocks, ...)``, or one choice per block) per
    stage: ``choices[micro_batch][block]`` and what one pass of the stage
    holds (``pass_bytes``)."""
    return _C.stage_plans(plan, list(blocks), micro_batches)


def choices_file(choices: Sequence[Dict[int, List[List[str]]]], schedule: str, world: int,
                 micro_batches: int) -> Dict[str, Any]:
    """Every rank's given choices (``enable(..., choices=)``) in one
    JSON-able dict: the schedule's name, rank count and micro-batches they
    were chosen for, and per rank ``{stage: [[choice name per block] per
    micro-batch]}`` (the simulator's ``place --write-choices``)."""
    return {"schedule": schedule, "world": world, "micro_batches": micro_batches,
            "ranks": [{str(stage): rows for stage, rows in rank.items()} for rank in choices]}


def rank_choices(data: Dict[str, Any], rank: int) -> Dict[int, List[List[str]]]:
    """One rank's choices from a :func:`choices_file`, for ``enable(...,
    choices=)`` (which checks them against the rank's stages and blocks)."""
    return {int(stage): rows for stage, rows in data["ranks"][rank].items()}
