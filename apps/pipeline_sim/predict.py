"""The simulator's predictions on more ranks (``predict``; Note [What the
simulator replays] in replay.py): weak scaling from a 2-rank run."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Dict, List, Tuple

from pipeline_bench.config import SCHEDULES, stage_rank
from prefire.pipelining.actions import KINDS, Action

from .measured import _step_durations, _steps, measured_costs
from .place import floor_s
from .replay import REPLAYED, Costs, Pipeline, overlaps, rank_orders, replay


def _positions(costs: Costs, n_stages: int) -> Dict[str, Dict[str, float]]:
    """Per position (first, middle, last) and kind: what a measured stage
    there took, per mode; a kind not measured in a position is derived
    (a full backward is B + W, B is a full backward less W)."""
    out: Dict[str, Dict[str, float]] = {}
    middle = list(range(1, n_stages - 1))
    if not middle:
        raise ValueError("pipeline_sim: predicting needs a measured run with a middle stage "
                         "(2 stages per rank: every schedule but 1f1b; 1f1b is predicted from interleaved-1f1b)")
    for mode, table in costs.action.items():
        for position, stages in (("first", [0]), ("middle", middle), ("last", [n_stages - 1])):
            got = {kind: statistics.mean(table[(kind, s)] for s in stages if (kind, s) in table)
                   for kind in KINDS if any((kind, s) in table for s in stages)}
            if "BW" not in got and {"B", "W"} <= set(got):
                got["BW"] = got["B"] + got["W"]
            if "B" not in got and "BW" in got:
                got["B"] = got["BW"] - got.get("W", 0.0)
                got.setdefault("W", 0.0)
            out[f"{mode}/{position}"] = got
    return out


def scaled_costs(costs: Costs, measured_stages: int, schedule: str, world: int) -> Costs:
    """Costs for ``schedule`` on ``world`` ranks (Note [What the simulator
    replays]: stages keep their measured size; 1F1B's stage is two)."""
    per_rank = SCHEDULES[schedule][1]
    group = 2 if schedule == "1f1b" else 1
    n_stages = per_rank * world
    fine = _positions(costs, measured_stages)
    mean_checkpoint = statistics.mean(costs.checkpoint.values())
    per_checkpoints = max(costs.checkpoints.values())

    def position(fine_stage: int, fine_stages: int) -> str:
        return "first" if fine_stage == 0 else "last" if fine_stage == fine_stages - 1 else "middle"

    action: Dict[str, Dict[Tuple[str, int], float]] = {}
    for mode in costs.action:
        table: Dict[Tuple[str, int], float] = {}
        for stage in range(n_stages):
            parts = [position(stage * group + k, n_stages * group) for k in range(group)]
            for kind in KINDS:
                if all(kind in fine[f"{mode}/{p}"] for p in parts):
                    table[(kind, stage)] = sum(fine[f"{mode}/{p}"][kind] for p in parts)
        action[mode] = table
    return Costs(action, {s: mean_checkpoint for s in range(n_stages)},
                 {s: per_checkpoints * group for s in range(n_stages)}, costs.latency, costs.overhead, costs.tail)


def measured_stage(stage: int, stages: int, measured_stages: int) -> int:
    """The measured stage that ``stage`` of ``stages`` takes its durations
    from: the first and the last from theirs, a middle one from the measured
    middle ones in turn."""
    if stage in (0, stages - 1):
        return 0 if stage == 0 else measured_stages - 1
    return 1 + (stage - 1) % (measured_stages - 2)


def scaled_steps(summary: Dict[str, Any], mode: str, schedule: str, world: int) -> List[Dict[Action, float]]:
    """Per measured step of ``mode``, the durations of ``schedule``'s
    actions on ``world`` ranks taken from that step (Note [What the
    simulator replays]): a stage in the position of a measured one (first,
    last, a middle one in turn), a micro-batch as the measured one of its
    index modulo theirs; 1F1B's stage two measured ones together. An action
    whose measured parts are not all there is left to the medians."""
    cfg = summary["config"]
    measured_stages, measured_mbs = SCHEDULES[cfg["schedule"]][1] * cfg["world"], cfg["model"]["micro_batches"]
    group = 2 if schedule == "1f1b" else 1
    fine_stages = SCHEDULES[schedule][1] * world * group

    out = []
    steps = min(len(_steps(rank)) for rank in summary["timelines"][mode])
    for k in range(steps):
        took, _ = _step_durations(summary, mode, k)
        instance: Dict[Action, float] = {}
        for stage in range(fine_stages // group):
            parts = [measured_stage(stage * group + g, fine_stages, measured_stages) for g in range(group)]
            for kind in KINDS:
                for mb in range(2 * world):
                    got = [took.get((kind, part, mb % measured_mbs)) for part in parts]
                    if all(t is not None for t in got):
                        instance[(kind, stage, mb)] = sum(got)
        out.append(instance)
    return out


def predict(summary: Dict[str, Any], schedule: str, world: int) -> Dict[str, Any]:
    """One schedule on ``world`` ranks, micro-batches twice the ranks, from
    a measured run's durations, every measured step replayed with its own
    (``scaled_steps``; prefire mode with session mode's): step per mode (the
    median over steps), its ratios to torch's checkpoint, the bubble
    fraction (the mean), H (Note [What the simulator replays]), the most H
    any placement allows (the floor of Note [Where recomputation can run],
    the median over the steps) and all waits over all recomputation."""
    cfg = summary["config"]
    measured_stages = SCHEDULES[cfg["schedule"]][1] * cfg["world"]
    costs = scaled_costs(measured_costs(summary), measured_stages, schedule, world)
    n_stages = SCHEDULES[schedule][1] * world
    modes = [m for m in REPLAYED if not (m == "prefire" and schedule == "1f1b")]  # no bubble hook in 1F1B
    orders, groups = rank_orders(schedule, world, 2 * world), overlaps(schedule, world, 2 * world)
    rank_of = stage_rank(schedule, world)
    runs = {mode: [replay(orders, rank_of, n_stages, dataclasses.replace(costs, instance=instance), mode, groups)
                   for instance in scaled_steps(summary, "session" if mode == "prefire" else mode, schedule, world)]
            for mode in modes}
    step = {mode: statistics.median(r.step_s for r in replays) for mode, replays in runs.items()}
    floor = statistics.median(floor_s(Pipeline(orders, rank_of, n_stages, dataclasses.replace(costs, instance=i),
                                               groups)) for i in scaled_steps(summary, "session", schedule, world))
    waits = {mode: statistics.mean(sum(r.wait_s) for r in replays) for mode, replays in runs.items()}
    lazy = step["session"] - step["none"]
    # all ranks' recomputation in session mode against all their waits: H can be no larger
    recompute = 2 * world * sum(costs.checkpoints[s] * costs.checkpoint[s] for s in range(n_stages))
    return {
        "schedule": schedule, "world": world, "micro_batches": 2 * world, "step_s": step,
        "ratio_to_torch": {mode: step[mode] / step["torch"] for mode in step},
        "bubble_fraction": {mode: statistics.mean(r.bubble_fraction() for r in replays)
                            for mode, replays in runs.items()},
        "hidden_fraction": (step["session"] - step["prefire"]) / lazy if "prefire" in step and lazy > 0 else None,
        "waits_over_recompute": min(1.0, waits["session"] / recompute) if recompute > 0 else None,
        "hidden_fraction_max": min(1.0, max(0.0, (step["session"] - floor) / lazy)) if lazy > 0 else None,
        "prefire_s": statistics.mean(sum(r.prefire_s) for r in runs["prefire"]) if "prefire" in runs else None,
    }
