"""What a 2-rank run of the pipeline program measured, as the simulator's
costs, and the replay checked against it step by step (``validate``; Note
[What the simulator replays] in replay.py)."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple

from pipeline_bench.config import SCHEDULES, stage_rank
from prefire.pipelining.actions import KINDS, Action
from prefire.pipelining.placement import rank_placement

from .replay import Costs, REPLAYED, _consumes, _produced, overlaps, rank_orders, replay


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def _blocks_per_stage(summary: Dict[str, Any]) -> int:
    cfg = summary["config"]
    return cfg["model"]["blocks"] // (SCHEDULES[cfg["schedule"]][1] * cfg["world"])


def _steps(rank_timeline: Dict[str, Any]) -> List[Dict[str, Any]]:
    """A rank's measured steps in a mode (a summary from before the
    timelines kept every step has the last one only)."""
    return rank_timeline.get("steps") or [rank_timeline]


def measured_costs(summary: Dict[str, Any]) -> Costs:
    """The durations a run measured (``python -m pipeline_bench --json``):
    medians over its modes' measured steps (Note [What the simulator
    replays])."""
    timelines = summary["timelines"]
    missing = [m for m in ("none", "torch", "session") if m not in timelines]
    if missing:
        raise ValueError(f"pipeline_sim: the run has no {', '.join(missing)} mode "
                         "(run the program with --modes none,torch,session,prefire)")
    per_stage = _blocks_per_stage(summary)
    action: Dict[str, Dict[Tuple[str, int], float]] = {}
    for mode in ("none", "torch", "session"):
        samples: Dict[Tuple[str, int], List[float]] = {}
        for rank in timelines[mode]:
            for step in _steps(rank):
                for kind, stage, _, begin, end in step["events"]:
                    if kind in KINDS:
                        samples.setdefault((kind, stage), []).append(end - begin)
        action[mode] = {key: _median(v) for key, v in samples.items()}
    checkpoint_samples: Dict[int, List[float]] = {}
    for rank in timelines["session"]:
        for step in _steps(rank):
            for kind, _, block, begin, end in step["events"]:
                if kind == "recompute":
                    checkpoint_samples.setdefault(block // per_stage, []).append(end - begin)
    checkpoint = {stage: _median(v) for stage, v in checkpoint_samples.items()}
    checkpoints = {stage: per_stage for stage in checkpoint}
    own, after_producer = _gaps(summary)
    overhead = _median(own)
    # the replay adds the rank's own time to the action: the latency is what is left
    latency = max(0.0, _median(after_producer) - overhead)
    return Costs(action, checkpoint, checkpoints, latency, overhead, _tail(summary))


def _all_steps(summary: Dict[str, Any]):
    """(mode, [each rank's step]) for every measured step of every mode."""
    for mode, ranks in summary["timelines"].items():
        for steps in zip(*(_steps(rank) for rank in ranks)):
            yield mode, list(steps)


def _gaps(summary: Dict[str, Any]) -> Tuple[List[float], List[float]]:
    """Before each action after a rank's first, the time since the rank's
    previous action ended (less bubble prefires in between): where what the
    action consumes was there by then, a rank's own time between actions;
    where it came later from another rank, the time from its producer's end
    to the action's start."""
    cfg = summary["config"]
    groups = overlaps(cfg["schedule"], cfg["world"], cfg["model"]["micro_batches"])
    own, after_producer = [], []
    for _, ranks in _all_steps(summary):
        ends: Dict[Tuple[str, int, int], float] = {}  # when what each action produced was sent
        for rank in ranks:
            for kind, stage, mb, _, end in rank["events"]:
                if kind in KINDS:
                    ends[_produced((kind, stage, mb))] = end
        for group in groups:
            if _produced(group[-1]) in ends:
                ends.update({_produced(a): ends[_produced(group[-1])] for a in group})
        n_stages = max(stage for _, stage, _ in ends) + 1
        for rank in ranks:
            events = sorted(rank["events"], key=lambda e: e[3])
            actions = [e for e in events if e[0] in KINDS]
            stages = {e[1] for e in actions}
            for before, (kind, stage, mb, begin, _) in zip(actions, actions[1:]):
                prefired = sum(e[4] - e[3] for e in events if e[0] == "recompute-bubble" and before[4] <= e[3] < begin)
                gap = begin - before[4] - prefired
                producer = _consumes((kind, stage, mb), n_stages)
                produced = ends.get(producer) if producer is not None and producer[1] not in stages else None
                if produced is None or produced <= before[4]:
                    own.append(gap)
                else:
                    after_producer.append(begin - produced)
    return own, after_producer


def _span(rank_step: Dict[str, Any]) -> float:
    return max(e[4] for e in rank_step["events"] if e[0] in KINDS) - rank_step["begin"]


def _tail(summary: Dict[str, Any]) -> float:
    """What a step takes after its last action (the schedule's own ending):
    the median over steps and modes (0 where steps kept no length)."""
    return _median([max(0.0, max(r.get("step_s", 0.0) for r in ranks) - max(_span(r) for r in ranks))
                    for _, ranks in _all_steps(summary) if all("step_s" in r for r in ranks)])


def measured_step(summary: Dict[str, Any], mode: str) -> Tuple[float, Optional[List[float]]]:
    """A mode's measured step (the median, slowest rank) and, per measured
    step, its ranks' waits together (None where the schedule's waits are
    not seen: Schedule1F1B)."""
    if summary["modes"][mode]["ranks"][0]["wait_s"] is None:
        return summary["modes"][mode]["step_s"], None
    waits = [sum(e[4] - e[3] for r in ranks for e in r["events"] if e[0] == "wait")
             for _, ranks in _all_steps({"timelines": {mode: summary["timelines"][mode]}})]
    return summary["modes"][mode]["step_s"], waits


def _step_durations(summary: Dict[str, Any], mode: str, index: int) -> Tuple[Dict[Action, float],
                                                                               Dict[Action, float]]:
    """Every action of ``mode``'s ``index``-th measured step (all ranks'):
    how long it took, and the bubble prefires its rank ran before it."""
    took: Dict[Action, float] = {}
    before: Dict[Action, float] = {}
    for rank in summary["timelines"][mode]:
        prefired = 0.0
        for kind, stage, mb, begin, end in sorted(_steps(rank)[index]["events"], key=lambda e: e[3]):
            if kind == "recompute-bubble":
                prefired += end - begin
            elif kind in KINDS:
                took[(kind, stage, mb)], before[(kind, stage, mb)], prefired = end - begin, prefired, 0.0
    return took, before


def step_costs(costs: Costs, summary: Dict[str, Any], mode: str, index: int) -> Costs:
    """``costs`` with every action of ``mode``'s ``index``-th measured step
    as long as it took there, and the bubble prefires the step ran before
    each (prefire mode: replayed as a session step, its rules already
    applied)."""
    took, before = _step_durations(summary, mode, index)
    return dataclasses.replace(costs, instance=took, before=before)


def measured_slack(summary: Dict[str, Any], index: int) -> Optional[Dict[Action, float]]:
    """The slack prefire mode's runtime worked to in its ``index``-th
    measured step, per receiving action (Note [Filling bubbles]: a forward
    receive is its F, a backward one its B or full backward); None where
    the run did not record it."""
    slack: Dict[Action, float] = {}
    for rank in summary["timelines"]["prefire"]:
        points = _steps(rank)[index].get("slack")
        if points is None:
            return None
        for kind, stage, mb, seconds in points:
            for action_kind in (("F",) if kind == "forward" else ("B", "BW")):
                slack[(action_kind, stage, mb)] = seconds
    return slack


def validate(summary: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Each mode of a run, measured against its replay: every measured
    step replayed with its own durations (prefire mode with session mode's
    step of the same index, the steps of modes run in turn, and the slack
    its runtime learned), then the step (median over the steps) and the
    bubble (waits of all ranks together: their mean over the steps, which
    swing widely from step to step, and the range) set beside what was
    measured (Note [What the simulator replays]); placed mode, where the
    run has it, with its placement's recompute actions on session mode's
    steps."""
    cfg = summary["config"]
    schedule, world = cfg["schedule"], cfg["world"]
    micro_batches = cfg["model"]["micro_batches"]
    orders, groups = rank_orders(schedule, world, micro_batches), overlaps(schedule, world, micro_batches)
    rank_of, n_stages = stage_rank(schedule, world), SCHEDULES[schedule][1] * world
    costs = measured_costs(summary)
    modes = [mode for mode in REPLAYED + ("placed",) if mode in summary["timelines"]]
    placed = {action: items for rank in range(world) if cfg.get("placement")  # placed mode's, every rank's
              for action, items in rank_placement(cfg["placement"], rank).items()}
    steps = min(len(_steps(rank)) for mode in modes for rank in summary["timelines"][mode])
    rows = []
    for name, mode in [(m, m) for m in modes] + ([("prefire as run", "prefire")] if "prefire" in modes else []):
        if name == "prefire as run":  # its own steps, prefires where they ran
            replays = [replay(orders, rank_of, n_stages, step_costs(costs, summary, "prefire", k), "session",
                              groups) for k in range(steps)]
        else:
            source = "session" if mode in ("prefire", "placed") else mode
            replays = [replay(orders, rank_of, n_stages, step_costs(costs, summary, source, k), mode, groups,
                              measured_slack(summary, k) if mode == "prefire" else None, placed)
                       for k in range(steps)]
        step, waits = measured_step(summary, mode)
        rows.append({"schedule": schedule, "mode": name, "step_s": step,
                     "simulated_step_s": statistics.median(r.step_s for r in replays),
                     "wait_s": statistics.mean(waits) if waits else None, "wait_range_s": waits and
                     [min(waits), max(waits)], "simulated_wait_s": statistics.mean(sum(r.wait_s) for r in replays)})
    return rows
