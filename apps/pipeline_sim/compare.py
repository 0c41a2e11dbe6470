"""The simulator's ``place`` command: on a schedule and rank count, how much
of the recomputation the filler's rules, the placement search and any
placement at all (the floor) hide, replayed with a measured run's durations
(Note [Where recomputation can run] in place.py)."""

from __future__ import annotations

from typing import Dict, Optional

from pipeline_bench.config import SCHEDULES, stage_rank

from .measured import measured_costs
from .place import PASSES, floor_s, held_ahead, rules_placement, search
from .predict import scaled_costs
from .replay import Pipeline, overlaps, rank_orders


def compare(summary: Dict, schedule: str, world: int, max_held: Optional[int] = None,
            searched: bool = True) -> Dict:
    """``schedule`` on ``world`` ranks (micro-batches twice the ranks, the
    measured run's median durations scaled as ``predict`` scales them): H
    of the rules, of the search (``searched``), the most any placement
    allows (the floor) and all waits over all recomputation."""
    cfg = summary["config"]
    measured_stages = SCHEDULES[cfg["schedule"]][1] * cfg["world"]
    n_stages = SCHEDULES[schedule][1] * world
    pipeline = Pipeline(rank_orders(schedule, world, 2 * world), stage_rank(schedule, world), n_stages,
                        scaled_costs(measured_costs(summary), measured_stages, schedule, world),
                        overlaps(schedule, world, 2 * world))
    session, none = pipeline.run("session"), pipeline.run("none")
    lazy = session.step_s - none.step_s

    def hidden(step_s: float) -> Optional[float]:
        return (session.step_s - step_s) / lazy if lazy > 0 else None

    recompute = sum(pipeline.costs.checkpoints[s] * pipeline.costs.checkpoint[s]
                    for order in pipeline.orders for kind, s, _ in order if kind in PASSES)
    row = {"schedule": schedule, "world": world, "micro_batches": 2 * world, "max_held": max_held,
           "session_s": session.step_s, "none_s": none.step_s, "floor_s": floor_s(pipeline),
           "waits_over_recompute": min(1.0, sum(session.wait_s) / recompute) if recompute else None}
    rules = rules_placement(pipeline.run("prefire"))
    rules_run = pipeline.run("placed", rules)
    row.update(rules_s=rules_run.step_s, rules_held=max(held_ahead(rules_run)), rules_placement=rules,
               hidden={"rules": hidden(rules_run.step_s), "max": min(1.0, hidden(row["floor_s"]))
                       if lazy > 0 else None})
    if searched:
        placement, found = search(pipeline, rules, max_held)
        row.update(search_s=found.step_s, search_held=max(held_ahead(found)), placement=placement)
        row["hidden"]["search"] = hidden(found.step_s)
    return row
