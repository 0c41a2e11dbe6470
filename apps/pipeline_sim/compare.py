"""The simulator's ``place`` command: on a schedule and rank count, how much
of the recomputation the filler's rules, the oracle's fill in whole
checkpoints, the placement search, the oracle and any placement at all (the
floor) hide, replayed with a measured run's durations (Note [Where
recomputation can run] in place.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Union

from pipeline_bench.config import SCHEDULES, stage_rank

from .joint import bubble_budgets, joint_plan
from .measured import measured_costs
from .oracle import hidden_over, oracle, oracle_placement, recompute_of, without_recompute
from .place import PASSES, floor_s, held_ahead, objective, rules_placement, search
from .plan_predict import plan_costs, rank_plan_blocks
from .plan_search import Bandwidth, without_offload
from .predict import scaled_costs
from .ratios import Ratios, with_ratios
from .replay import Pipeline, overlaps, rank_orders


@dataclass
class Joint:
    """What the joint plan is made of: a memory sweep's block costs
    (``python -m pipeline_bench.sweep --offload``, with ``--selective`` for
    selective costs), each rank's budget as a fraction of what keeping
    everything holds there (or "bubble+stage": what bubble mode holds there
    plus one stage's activations), the tier's bandwidth (0: as measured), whether
    offloading is offered."""

    sweep: Dict[str, Any]
    fraction: Union[float, str] = 0.5      # or "bubble+stage" (``bubble_budgets``)
    bandwidth: Bandwidth = 0.0
    offload: bool = True
    max_replays: int = 3000


def compare(summary: Dict, schedule: str, world: int, max_held: Optional[int] = None,
            searched: bool = True, ratios: Optional[Ratios] = None, joint: Optional[Joint] = None) -> Dict:
    """``schedule`` on ``world`` ranks (micro-batches twice the ranks, the
    measured run's median durations scaled as ``predict`` scales them, or
    set to ``ratios``): the steps of none, session and session without its
    recomputation, of the rules' placement, the oracle's in whole
    checkpoints, the search's (``searched``, from the better of those two),
    the floor and the oracle, the best placement of the three (within
    ``max_held``), and H of each over session - none and over the
    recomputation alone (Note [The oracle fill and the recomputation's own
    time] in oracle.py); with ``joint``, the joint plan's step and peak
    (Note [The joint plan] in joint.py)."""
    cfg = summary["config"]
    measured_stages = SCHEDULES[cfg["schedule"]][1] * cfg["world"]
    n_stages = SCHEDULES[schedule][1] * world
    costs = scaled_costs(measured_costs(summary), measured_stages, schedule, world)
    pipeline = Pipeline(rank_orders(schedule, world, 2 * world), stage_rank(schedule, world), n_stages,
                        with_ratios(costs, ratios) if ratios else costs, overlaps(schedule, world, 2 * world))
    session, none = pipeline.run("session"), pipeline.run("none")
    free = without_recompute(pipeline)
    recompute = sum(recompute_of(pipeline.costs, s) for order in pipeline.orders for kind, s, _ in order
                    if kind in PASSES)
    rules = rules_placement(pipeline.run("prefire"))
    rules_run = pipeline.run("placed", rules)
    found_oracle = oracle(pipeline)
    whole = oracle_placement(pipeline, found_oracle)
    whole_run = pipeline.run("placed", whole)
    row: Dict[str, Any] = {
        "schedule": schedule, "ranks": world, "micro_batches": 2 * world, "max_held": max_held,
        "ratios": list(ratios) if ratios else None, "session_s": session.step_s, "none_s": none.step_s,
        "recompute_s": session.step_s - free.step_s, "overhead_s": free.step_s - none.step_s,
        "floor_s": floor_s(pipeline), "oracle_s": found_oracle.step_s, "rules_s": rules_run.step_s,
        "oracle_whole_s": whole_run.step_s, "search_s": None, "rules_held": max(held_ahead(rules_run)),
        "oracle_whole_held": max(held_ahead(whole_run)), "search_held": None,
        "waits_over_recompute": min(1.0, sum(session.wait_s) / recompute) if recompute else None,
        "rules_placement": rules, "oracle_whole_placement": whole}
    if searched:
        start = rules if objective(rules_run) <= objective(whole_run) else whole
        placement, found = search(pipeline, start, max_held)
        row.update(search_s=found.step_s, search_held=max(held_ahead(found)), placement=placement)
    for name, step in (("rules", row["rules_s"]), ("search", row["search_s"]), ("max", row["floor_s"]),
                       ("oracle", row["oracle_s"]), ("oracle_whole", row["oracle_whole_s"])):
        row[f"h_{name}"] = hidden_over(session.step_s, step, session.step_s - none.step_s)
        row[f"h_{name}_recompute"] = hidden_over(session.step_s, step, row["recompute_s"])
    row.update(joint_s=None, joint_peak_fraction=None, joint=None)
    if joint is not None:
        _, measured = plan_costs(joint.sweep, selective=True)
        sweep_cfg = joint.sweep["config"]
        blocks = rank_plan_blocks(measured, SCHEDULES[sweep_cfg["schedule"]][1] * sweep_cfg["world"], schedule,
                                  world, joint.bandwidth)
        if not joint.offload:
            blocks = [(rank, without_offload(rank_blocks)) for rank, rank_blocks in blocks]
        budget = (bubble_budgets(pipeline, blocks, held_ahead(rules_run)) if joint.fraction == "bubble+stage"
                  else float(joint.fraction))
        row["joint"] = joint_plan(pipeline, blocks, budget, joint.max_replays)
        row.update(joint_s=row["joint"]["joint_s"], joint_peak_fraction=row["joint"]["joint_peak_fraction"])
    # the best placement: of those run, within --max-held where given (the search's always is; else the rules')
    held = {k: row[f"{k}_held"] for k in ("rules", "oracle_whole", "search")}
    run = [k for k in held if row[f"{k}_s"] is not None and (max_held is None or held[k] <= max_held)] or ["rules"]
    best = min(run, key=lambda k: row[f"{k}_s"])
    row.update(best=best, best_s=row[f"{best}_s"], h_best=row[f"h_{best}"],
               best_placement=row[{"rules": "rules_placement", "oracle_whole": "oracle_whole_placement",
                                   "search": "placement"}[best]])
    if row["h_max"] is not None:  # the floor leaves out waits no checkpointing has too (place.py)
        row["h_max"] = min(1.0, row["h_max"])
    return row
