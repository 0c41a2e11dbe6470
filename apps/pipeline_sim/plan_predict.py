"""The simulator's predictions of memory plans on more ranks
(``predict-plans``; Note [Predicting plans on more ranks])."""

from __future__ import annotations

import statistics
from typing import Any, Dict, List, Sequence, Tuple

import prefire
from pipeline_bench.config import SCHEDULES, stage_rank
from prefire.pipelining.plans import rank_blocks, rank_items

from .measured import measured_costs
from .plan_search import Bandwidth, directions, item_slots, laid_out, with_bandwidth, with_plan, without_offload
from .predict import measured_stage, scaled_costs
from .replay import overlaps, rank_orders, replay


# Note [Predicting plans on more ranks]
# A memory sweep's plan-offload run (python -m pipeline_bench.sweep
# --offload) recorded each rank's block costs (Note [A pipeline rank's memory
# plan]). ``predict-plans`` takes them to W ranks, weak scaling as ``predict``
# does (micro-batches 2W; Note [What the simulator replays]): each stage's
# blocks cost what the measured stage in its position did (first, last, the
# middle ones in turn: ``measured_stage``), with their lifetimes over the
# W-rank schedule's actions of the rank that runs them (the planner's own
# ``rank_blocks``). Each rank's budget is a fraction of what keeping every
# block holds there by the planner's count; at it the C++ planner chooses per
# block and micro-batch as a pipeline rank does, twice: with offloading and
# without it (recompute-only); where a plan cannot hold the budget (less than
# the least it holds), it is planned at its least, as the pipeline program's
# sweep does, and the row says it does not fit. Both plans, and no checkpointing, are replayed
# on the W-rank timeline with scaled costs (``with_plan``: none's durations
# plus session's extra in the share of recomputation a plan's blocks
# recompute; an offloaded block's share is its copies' exposed seconds). The
# copies take what the run's tier measured or, with a bandwidth per direction,
# moved bytes / bandwidth to the tier plus back; the rows say which. Both plans are the planner's choices:
# the ratio is prefire's plan with offloading against prefire's plan without
# it, not against an exhaustive best (``search`` does that on the run's own
# ranks).


def _by_stage(mode: Dict[str, Any]) -> Dict[int, List[Dict[str, Any]]]:
    by_stage: Dict[int, List[Dict[str, Any]]] = {}
    for rank in mode["ranks"]:
        for fields in rank["plan_costs"]:
            by_stage.setdefault(fields["group"], []).append(dict(fields))
    return by_stage


def plan_costs(summary: Dict[str, Any], selective: bool = False) -> Tuple[str, Dict[int, List[Dict[str, Any]]]]:
    """The first plan-offload run's name and its block costs by measured
    stage (fields by name); ``selective``: with the selective fields of the
    sweep's first plan-selective run, where it has one."""
    runs = {name.split(" ")[0]: mode for name, mode in reversed(list(summary["modes"].items()))}
    if "plan-offload" not in runs:
        raise ValueError("pipeline_sim: predicting plans needs a sweep with a plan-offload run "
                         "(python -m pipeline_bench.sweep --offload)")
    by_stage = _by_stage(runs["plan-offload"])
    if selective and "plan-selective" in runs:
        for stage, blocks in _by_stage(runs["plan-selective"]).items():
            for fields, chosen in zip(by_stage[stage], blocks):
                fields.update({k: v for k, v in chosen.items() if k.startswith("selective_")})
    name = next(n for n in summary["modes"] if n.split(" ")[0] == "plan-offload")
    return name, by_stage


def _bandwidth_of(costs: Sequence[Any]) -> Tuple[float, float]:
    """Bytes per second of the copies ``costs`` were measured with (a copy to the tier and one back, timed
    together: the same both ways)."""
    each_way = statistics.median(2 * c.offload_moved_bytes / c.offload_seconds for c in costs
                                 if c.offload_bytes >= 0 and c.offload_seconds > 0)
    return each_way, each_way


def rank_plan_blocks(measured: Dict[int, List[Dict[str, Any]]], measured_stages: int, schedule: str, world: int,
                     bandwidth: Bandwidth = 0.0) -> List[Tuple[int, List[Any]]]:
    """Per rank of ``schedule`` on ``world`` ranks (micro-batches 2W): its
    blocks, each costing what the block of the measured stage in its
    position did (``measured``: block costs by measured stage, fields by
    name), with their lifetimes over the rank's actions (Note [Predicting
    plans on more ranks]); ``bandwidth``: the copies at an assumed tier's."""
    n_stages, micro_batches = SCHEDULES[schedule][1] * world, 2 * world
    orders, rank_of = rank_orders(schedule, world, micro_batches), stage_rank(schedule, world)
    out = []
    for rank in range(world):
        stages = sorted(s for s in range(n_stages) if rank_of(s) == rank)
        blocks = [prefire.BlockCost.from_dict(dict(fields, group=stage)) for stage in stages
                  for fields in measured[measured_stage(stage, n_stages, measured_stages)]]
        blocks = rank_blocks(blocks, orders[rank], micro_batches)
        out.append((rank, with_bandwidth(blocks, bandwidth) if min(directions(bandwidth)) > 0 else blocks))
    return out


def predict_plans(summary: Dict[str, Any], world: int, fractions: Sequence[float],
                  bandwidth: Bandwidth = 0.0) -> List[Dict[str, Any]]:
    """Per budget fraction, on ``world`` ranks: the step of no checkpointing,
    of prefire's recompute-only plan and of its plan with offloading,
    replayed, each plan at its rank's budget or, where it cannot hold that
    (``fits`` false), at the least it holds (Note [Predicting plans on more
    ranks]); ``bandwidth``: bytes per second to an assumed tier and back (0:
    as the run's tier measured)."""
    cfg = summary["config"]
    schedule = cfg["schedule"]
    run, measured = plan_costs(summary)
    measured_stages = SCHEDULES[schedule][1] * cfg["world"]
    n_stages, micro_batches = SCHEDULES[schedule][1] * world, 2 * world
    orders, groups = rank_orders(schedule, world, micro_batches), overlaps(schedule, world, micro_batches)
    rank_of = stage_rank(schedule, world)
    costs = scaled_costs(measured_costs(summary), measured_stages, schedule, world)
    release = prefire.Release.AT_STEP_END
    assumed = min(directions(bandwidth)) > 0

    ranks = [(rank, blocks, without_offload(blocks))
             for rank, blocks in rank_plan_blocks(measured, measured_stages, schedule, world, bandwidth)]
    all_blocks = [b for _, blocks, _ in ranks for b in blocks]

    def step(options: List[List[Any]], seconds: List[List[float]]) -> float:
        return replay(orders, rank_of, n_stages, with_plan(costs, all_blocks, options, seconds), "plan",
                      groups).step_s

    none_s = replay(orders, rank_of, n_stages, costs, "none", groups).step_s
    rows = []
    for fraction in fractions:
        row: Dict[str, Any] = {"schedule": schedule, "world": world, "micro_batches": micro_batches,
                               "fraction": fraction, "costs_from": run, "none_s": none_s,
                               "bandwidth": directions(bandwidth) if assumed else _bandwidth_of(all_blocks),
                               "bandwidth_assumed": assumed}
        for kind in ("offload", "recompute"):
            options: List[List[Any]] = [[] for _ in range(micro_batches)]  # per micro-batch, every rank's blocks
            seconds: List[List[float]] = [[] for _ in range(micro_batches)]  # what each adds, as its plan counts
            budgets, held, fits, offloaded, items_in_all = [], [], True, 0, 0
            for rank, with_offload, without in ranks:
                blocks = with_offload if kind == "offload" else without
                items = rank_items(blocks, orders[rank], micro_batches)
                budget = int(fraction * prefire.plan_bytes(items, [False] * len(items), 0, release))
                least = prefire.least_plan_bytes(items, release)
                fits = fits and budget >= least
                plan = prefire.plan_for_budget(items, max(budget, least), release)
                budgets.append(budget)
                held.append(plan.peak_bytes)
                offloaded += sum(c == prefire.Choice.OFFLOAD for c in plan.choices)
                items_in_all += len(items)
                rank_options, rank_seconds = laid_out(plan, item_slots(blocks, micro_batches), micro_batches,
                                                      len(blocks))
                for m in range(micro_batches):
                    options[m] += rank_options[m]
                    seconds[m] += rank_seconds[m]
            row[kind] = {"step_s": step(options, seconds), "fits": fits, "budgets": budgets, "peak_bytes": held,
                         "offloaded_items": offloaded, "items": items_in_all}
        row["offload_over_recompute"] = row["offload"]["step_s"] / row["recompute"]["step_s"]
        rows.append(row)
    return rows
