"""The simulator's search over per-block plans of a memory sweep
(``search``; Note [Searching per-block plans])."""

from __future__ import annotations

import itertools
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import prefire
import prefire.pipelining.plans
from pipeline_bench.config import SCHEDULES, stage_rank
from prefire.pipelining.actions import Action
from prefire.pipelining.plans import rank_items

from .measured import measured_costs
from .replay import Costs, overlaps, rank_orders, replay


# Note [Searching per-block plans]
# A memory sweep (python -m pipeline_bench.sweep) runs prefire's plan at
# several budgets and records what each rank's plan was chosen from (its
# blocks' costs, Note [A pipeline rank's memory plan]). ``search`` tries
# every keep/checkpoint choice of every block on every rank (and the
# selective checkpoint where the plan had one to choose) that fits each
# rank's budget by the plan's own count (plan_bytes), replays each, and sets
# the fastest beside prefire's choice replayed the same way (prefire's
# chooses per micro-batch where the rank's actions are known: Note [A
# pipeline rank's memory plan]). A stage's action on a micro-batch with
# some of its blocks checkpointed takes none mode's time for its kind plus
# session mode's extra (its recomputation) in the share of the stage's
# recomputation seconds those blocks recompute (a selective one its
# selective seconds, an offloaded one its copies' exposed seconds, or whole
# where the rank's plan leaves no room for a copy in flight: what
# Plan.block_seconds counts, Note [Offloaded blocks in a plan]); the rest of the replay is as in Note [What
# the simulator replays]. Offloaded blocks (a sweep's plan-offload runs) are
# tried too; their copies take what the tier measured on the run's machine,
# or, with --bandwidth, moved bytes / bandwidth to the tier plus back (an assumed tier:
# pinned host memory over PCIe, say), the hidden part as measured runs count it. Both sides of the ratio are replays:
# it measures the planner's choice (least recomputation, bytes by its
# count), not the replay's fidelity (``validate`` does that).


def _plan_of(rank: Dict[str, Any]) -> Tuple[List[Any], List[List[Any]]]:
    """A plan run's rank: its blocks' costs and prefire's choice, per
    micro-batch (a Choice per block, in the plan's order: stage by stage)."""
    if any(not isinstance(fields, dict) for fields in rank["plan_costs"]):
        raise ValueError("pipeline_sim: this sweep's plan_costs are lists of values by position, as an older prefire "
                         "wrote them; run the sweep again (costs are written by field name)")
    costs = [prefire.BlockCost.from_dict(fields) for fields in rank["plan_costs"]]
    stages = [prefire.pipelining.plans.StagePlan.from_dict({"stage": int(stage), "choices": choices, "pass_bytes": 0})
              for stage, choices in sorted(rank["plan"].items(), key=lambda item: int(item[0]))]
    micro_batches = len(stages[0].choices)
    return costs, [[c for stage in stages for c in stage.choices[m]] for m in range(micro_batches)]


#: bytes per second to an offload tier and back; one number: the same both ways
Bandwidth = Union[float, Tuple[float, float]]


def directions(bandwidth: Bandwidth) -> Tuple[float, float]:
    """``bandwidth`` as (to the tier, back)."""
    return (bandwidth, bandwidth) if isinstance(bandwidth, (int, float)) else (bandwidth[0], bandwidth[1])


def without_offload(costs: Sequence[Any]) -> List[Any]:
    """``costs`` offered no offload (recompute-only plans)."""
    return [prefire.BlockCost.from_dict(dict(c.to_dict(), offload_bytes=-1)) for c in costs]


def with_bandwidth(costs: List[Any], bandwidth: Bandwidth) -> List[Any]:
    """``costs`` with each offloadable block's copies at ``bandwidth`` (its
    moved bytes to the tier and back)."""
    to_tier, back = directions(bandwidth)
    return [prefire.with_offload(c, moved_bytes=c.offload_moved_bytes,
                                 copy_seconds=prefire.copy_seconds(c.offload_moved_bytes, to_tier, back))
            if c.offload_bytes >= 0 else c for c in costs]


def item_slots(rank_blocks: Sequence[Any], micro_batches: int) -> List[Tuple[int, int]]:
    """Per item of ``rank_items(rank_blocks, ...)`` (stage by stage, then
    micro-batch, then block): its block in the rank and its micro-batch."""
    slots: List[Tuple[int, int]] = []
    start = 0
    while start < len(rank_blocks):
        end = start
        while end < len(rank_blocks) and rank_blocks[end].group == rank_blocks[start].group:
            end += 1
        slots += [(b, mb) for mb in range(micro_batches) for b in range(start, end)]
        start = end
    return slots


def laid_out(plan: Any, slots: Sequence[Tuple[int, int]], micro_batches: int,
             n_blocks: int) -> Tuple[List[List[Any]], List[List[float]]]:
    """A rank's ``plan`` of its items (``item_slots``) as per micro-batch, per
    block: its choices and what each adds (``Plan.block_seconds``)."""
    choices: List[List[Any]] = [[None] * n_blocks for _ in range(micro_batches)]
    seconds = [[0.0] * n_blocks for _ in range(micro_batches)]
    for (block, mb), choice, s in zip(slots, plan.choices, plan.block_seconds):
        choices[mb][block], seconds[mb][block] = choice, s
    return choices, seconds


def with_plan(costs: Costs, blocks: Sequence[Any], options: Sequence[Sequence[Any]],
              seconds: Optional[Sequence[Sequence[float]]] = None) -> Costs:
    """``costs`` with a mode "plan": per stage and micro-batch (``options``:
    per micro-batch, a choice per block), none's durations plus session's
    extra in the share of the stage's recomputation the plan recomputes
    there. ``seconds``, shaped as ``options``: what each choice adds as its
    rank's plan counts it (``Plan.block_seconds``: an offloaded block's
    copies whole where the plan leaves no room for one in flight); without
    it, ``choice_seconds``."""
    total: Dict[int, float] = {}
    for cost in blocks:
        total[cost.group] = total.get(cost.group, 0.0) + cost.recompute_seconds
    none, session = costs.action["none"], costs.action["session"]
    instance: Dict[Action, float] = {}
    for mb, per_block in enumerate(options):
        chosen: Dict[int, float] = {}
        for i, (cost, o) in enumerate(zip(blocks, per_block)):
            s = prefire.choice_seconds(cost, o) if seconds is None else seconds[mb][i]
            chosen[cost.group] = chosen.get(cost.group, 0.0) + s
        for (kind, stage), base in none.items():
            share = chosen.get(stage, 0.0) / total[stage] if total.get(stage) else 0.0
            instance[(kind, stage, mb)] = base + share * max(0.0, session.get((kind, stage), base) - base)
    return Costs(dict(costs.action, plan=dict(none)), costs.checkpoint, costs.checkpoints, costs.latency,
                 costs.overhead, costs.tail, instance=instance)


def search(summary: Dict[str, Any], bandwidth: Bandwidth = 0.0) -> List[Dict[str, Any]]:
    """Per plan run of a memory sweep: the fastest replayed per-block plan
    within every rank's budget, and prefire's plan (per micro-batch)
    replayed (Note [Searching per-block plans]); ``bandwidth``: bytes per
    second to an assumed offload tier and back (0: as measured)."""
    cfg = summary["config"]
    schedule, world, micro_batches = cfg["schedule"], cfg["world"], cfg["model"]["micro_batches"]
    costs = measured_costs(summary)
    orders = rank_orders(schedule, world, micro_batches)
    groups = overlaps(schedule, world, micro_batches)
    n_stages = SCHEDULES[schedule][1] * world
    rank_of = stage_rank(schedule, world)

    def step(blocks: Sequence[Any], options: Sequence[Sequence[Any]], seconds: Sequence[Sequence[float]]) -> float:
        return replay(orders, rank_of, n_stages, with_plan(costs, blocks, options, seconds), "plan", groups).step_s

    release = prefire.Release.AT_STEP_END
    rows = []
    for name, mode in summary["modes"].items():
        if name.split(" ")[0] not in ("plan", "plan-selective", "plan-offload"):  # bubble prefires: not replayed
            continue
        plans = [_plan_of(r) for r in mode["ranks"]]
        if min(directions(bandwidth)) > 0:
            plans = [(with_bandwidth(blocks, bandwidth), chosen) for blocks, chosen in plans]
        budgets = [r["memory_budget"] for r in mode["ranks"]]
        fitting = []  # per rank, (choices, block_seconds) of every per-block plan within its budget
        for (blocks, _), budget in zip(plans, budgets):
            described = (prefire.describe_plan(blocks, list(c), budget, 0, release)
                         for c in itertools.product(*[prefire.offered_choices(b) for b in blocks]))
            fitting.append([(p.choices, p.block_seconds) for p in described if p.peak_bytes <= budget])
        blocks = [b for rank_blocks, _ in plans for b in rank_blocks]
        best_s, best = float("inf"), None
        for combo in itertools.product(*fitting):
            options = [o for rank_choices, _ in combo for o in rank_choices]
            s = step(blocks, [options] * micro_batches, [[x for _, sec in combo for x in sec]] * micro_batches)
            if s < best_s:
                best_s, best = s, options
        chosen: List[List[Any]] = [[] for _ in range(micro_batches)]
        chosen_seconds: List[List[float]] = [[] for _ in range(micro_batches)]
        for rank, ((rank_blocks, rank_chosen), budget) in enumerate(zip(plans, budgets)):  # as the planner counts it
            slots = item_slots(rank_blocks, micro_batches)
            plan = prefire.describe_plan(rank_items(rank_blocks, orders[rank], micro_batches),
                                         [rank_chosen[mb][b] for b, mb in slots], budget, 0, release)
            choices, seconds = laid_out(plan, slots, micro_batches, len(rank_blocks))
            for m in range(micro_batches):
                chosen[m] += choices[m]
                chosen_seconds[m] += seconds[m]
        chosen_s = step(blocks, chosen, chosen_seconds)
        rows.append({"name": name, "budgets": budgets, "plans_tried": math.prod(len(f) for f in fitting),
                     "best_s": best_s, "best": [best] * micro_batches, "chosen_s": chosen_s, "chosen": chosen,
                     "chosen_over_best": chosen_s / best_s, "measured_s": mode["step_s"]})
    return rows
