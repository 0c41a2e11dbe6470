"""A timeline simulator of pipeline schedules: what the pipeline program
would measure on more ranks than this machine can time.

    python -m prefire.pipeline_bench --schedule zbv --modes none,torch,session,bubble --json zbv.json
    python -m prefire.pipeline_bench.simulate validate zbv.json
    python -m prefire.pipeline_bench.simulate predict zbv.json --ranks 4,8,16
    python -m prefire.pipeline_bench.sweep --json sweep.json
    python -m prefire.pipeline_bench.simulate search sweep.json

Note [What the simulator replays]
The order is torch's own: each rank's compute actions as the schedule
class lays them out for any number of ranks (``pipeline_order_with_comms``
of a schedule built over stand-in stages, which needs no process group;
Schedule1F1B's own loop for 1F1B, which keeps no order). The durations are
measured: from a 2-rank run of the program (every measured step's
timeline), per mode and stage, the median F, B, W and full-backward action
(with the mode's recomputation inside), the median recomputation of one
checkpoint (session mode), a rank's own time between two actions where the
second waited for nothing (Python, the loss, posting sends and receives:
the median such gap), a message's latency (the median time from a send to
the start of the action that waited for it, less that own time), and the
step's ending after its last action. ``validate`` checks the replay
against the run step by step: each measured step replayed with every
action as long as that step measured it (the medians above for the rest:
own time, latency, checkpoints), then the median step and the mean wait
over the steps. Medians alone hold back what a step's waits are made of:
a wait is one rank's path less another's, and which actions ran long
differs from step to step (ZBV without checkpoints on 2 ranks: a replay
of the medians waited 23 ms where the steps waited 21-97, mean 55, and
their replays 49).
Replaying: each rank runs its actions in order; an action starts when the
rank is free and what it consumes is there (the forward of the stage before
for F, the backward of the stage after for B or a full backward, plus the
latency when that ran on another rank, counted from when it was sent: a
DualPipeV OVERLAP_F_B action sends what its parts produced after its last
part; its own B for W). The time a rank
stands before a dependency that is not there yet is a wait: the bubble.
Modes: none, torch and session replay their own measured durations; bubble
replays session's, and while a rank waits on another rank it recomputes
checkpoints of the micro-batches already forwarded whose backward comes
next on it, in that order, last block first, one checkpoint at a time
that ends within the receive's slack -- the rules of Note [Filling
bubbles], with the slack the runtime learned in its warm-up steps, where
nothing is prefired (``validate``: as the run recorded it for the step;
``predict``: the wait there in session mode's replay, the exact slack, so
an upper end for what the rules hide). At the receive of a micro-batch's
gradient all its checkpoints are prefired first, whether or not the
gradient is there (rule 1: Gloo's receive work
reports completion only once waited on, so the runtime does). A
micro-batch's passes then take less by what was prefired: its B first,
then its W (a first stage's B computes no input gradient, its W
recomputes), each down to what it takes without checkpoints.
``validate`` replays bubble mode twice: by these rules, from the steps of
session mode of the same index (the program runs the modes' steps in
turn, so those ran beside them) and the recorded slack; and as it ran
("bubble as run"): its own steps' durations, each bubble prefire rank
time before the action it preceded, no rules. The second checks the
timeline, the first the rules on top of it.
Predictions (``predict``) keep what a stage is: a stage of the measured
size costs what the measured first, middle (mean of the others) or last
stage cost in that position, so a pipeline of more ranks is a model with
more blocks (weak scaling), and micro-batches are twice the ranks. They
replay steps too, one per measured step (``scaled_steps``): each action
as long as the measured one of its kind took in that step, from the
stage in its position (the middle ones in turn) and the micro-batch of
its index modulo the measured count. 1F1B's stage holds what two stages
of the measured interleaved run hold (its cost the sum of the two), so
its model per rank is the other schedules'. The
2-rank run cannot show contention that more ranks add (the network, a
shared memory bus): these are predictions, said so wherever they appear.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import _C
from .._order import Action, compute_actions
from .config import SCHEDULES, stage_indices

Key = Tuple[int, int]  # (stage, micro-batch)
KINDS = ("F", "B", "W", "BW")
REPLAYED = ("none", "torch", "session", "bubble")


class _StandInStage:
    """What a schedule's constructor reads of its stages."""

    def __init__(self, index: int, n_stages: int, world: int, rank: int) -> None:
        self.stage_index, self.num_stages = index, n_stages
        self.group_size, self.group_rank = world, rank
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.submod = torch.nn.Module()


def _one_f_one_b(stage: int, n_stages: int, micro_batches: int) -> List[Action]:
    """Schedule1F1B's loop: as many forwards as stages from this one to the
    last, then a backward and a forward in turn, then the backwards left."""
    warmup = min(micro_batches, n_stages - stage)
    order: List[Action] = [("F", stage, m) for m in range(warmup)]
    forwards, backwards = warmup, 0
    while True:
        order.append(("BW", stage, backwards))
        backwards += 1
        if forwards == micro_batches:
            break
        order.append(("F", stage, forwards))
        forwards += 1
    return order + [("BW", stage, m) for m in range(backwards, micro_batches)]


@functools.lru_cache(maxsize=None)
def _built(schedule: str, world: int, micro_batches: int):
    cls, per_rank, _ = SCHEDULES[schedule]
    stages = [_StandInStage(i, per_rank * world, world, 0) for i in stage_indices(schedule, 0, world)]
    return cls(stages, micro_batches, loss_fn=lambda output, target: output)


def rank_orders(schedule: str, world: int, micro_batches: int) -> List[List[Action]]:
    """Each rank's compute actions in one step, in torch's order."""
    if schedule == "1f1b":
        return [_one_f_one_b(rank, world, micro_batches) for rank in range(world)]
    built = _built(schedule, world, micro_batches)
    return [compute_actions(built.pipeline_order_with_comms[rank]) for rank in range(world)]


def overlaps(schedule: str, world: int, micro_batches: int) -> List[Tuple[Action, ...]]:
    """The compute actions torch runs as one OVERLAP_F_B action (DualPipeV):
    it sends what each produced only after the last (``_add_send_recv``)."""
    if schedule == "1f1b":
        return []
    built = _built(schedule, world, micro_batches)
    return [tuple(compute_actions(action.sub_actions)) for rank in range(world)
            for action in built.pipeline_order_with_comms[rank] if action is not None and action.sub_actions]


@dataclass
class Costs:
    """Seconds, as the replay takes them: ``action[mode][(kind, stage)]``
    (one micro-batch, the mode's recomputation inside),
    ``checkpoint[stage]`` (one checkpoint's recomputation) and
    ``checkpoints[stage]`` (how many a micro-batch has there), the latency
    of a message and the rank's own time per action."""

    action: Dict[str, Dict[Tuple[str, int], float]]
    checkpoint: Dict[int, float]
    checkpoints: Dict[int, int]
    latency: float
    overhead: float
    tail: float = 0.0
    #: one measured step's actions, each as it took there (``step_costs``, ``scaled_steps``); the rest by ``action``
    instance: Dict[Action, float] = field(default_factory=dict)
    #: a bubble step as it ran: the rank's bubble prefires before each action (``step_costs``)
    before: Dict[Action, float] = field(default_factory=dict)


def _produced(action: Action) -> Tuple[str, int, int]:
    """What an action produces: a forward's output, a backward's (B or
    full) input gradient, or W's weight gradients."""
    kind, stage, mb = action
    return ("F" if kind == "F" else "back" if kind in ("B", "BW") else "W", stage, mb)


def _consumes(action: Action, n_stages: int) -> Optional[Tuple[str, int, int]]:
    """What an action consumes (as ``_produced`` names it): the forward of
    the stage before (F), the backward of the stage after (B or a full
    backward; the last stage its own forward), its own B (W)."""
    kind, stage, mb = action
    if kind == "F":
        return ("F", stage - 1, mb) if stage > 0 else None
    if kind in ("B", "BW"):
        return ("F", stage, mb) if stage == n_stages - 1 else ("back", stage + 1, mb)
    return ("back", stage, mb)


@dataclass
class Replay:
    step_s: float
    wait_s: List[float]               # per rank: standing before a dependency
    prefire_s: List[float]            # per rank: recomputing in bubbles
    waited: Dict[Action, float]       # the waits, by the action they stood before
    events: List[List[Tuple[str, int, int, float, float]]] = field(default_factory=list)

    def bubble_fraction(self) -> float:
        return sum(self.wait_s) / (len(self.wait_s) * self.step_s)


def replay(orders: Sequence[Sequence[Action]], stage_rank: Callable[[int], int], n_stages: int, costs: Costs,
           mode: str, groups: Sequence[Tuple[Action, ...]] = (),
           slack: Optional[Dict[Action, float]] = None) -> Replay:
    """Replays one step (Note [What the simulator replays]); ``groups``:
    actions whose outputs are sent together after the last of them
    (``overlaps``); ``slack``: bubble mode's, per receiving action (what
    the runtime learned, ``measured_slack``); without it, bubble mode first
    replays session mode and takes its waits."""
    if mode == "bubble" and slack is None:
        slack = _replay(orders, stage_rank, n_stages, costs, "session", {}, groups).waited
    return _replay(orders, stage_rank, n_stages, costs, mode, slack or {}, groups)


def _replay(orders: Sequence[Sequence[Action]], stage_rank: Callable[[int], int], n_stages: int, costs: Costs,
            mode: str, slack: Dict[Tuple[str, int, int], float], groups: Sequence[Tuple[Action, ...]]) -> Replay:
    durations = costs.action["session" if mode == "bubble" else mode]
    world = len(orders)
    end: Dict[Tuple[str, int, int], float] = {}   # ("F" or "back", stage, micro-batch) -> when it ended
    sent: Dict[Tuple[str, int, int], float] = {}  # ... -> when its output left for another rank
    last_of = {action: group[-1] for group in groups for action in group}
    members = {group[-1]: group for group in groups}
    free = [0.0] * world
    at = [0] * world
    wait = [0.0] * world
    prefire = [0.0] * world
    waited: Dict[Action, float] = {}               # before which action, how long
    left: Dict[Key, int] = {}                       # bubble: checkpoints not prefired yet
    events: List[List[Tuple[str, int, int, float, float]]] = [[] for _ in range(world)]

    def prefire_all(rank: int, key: Key, now: float, until: float) -> float:
        """Prefires ``key``'s checkpoints not prefired yet, one at a time
        while the next one ends by ``until``; returns when it stopped."""
        stage, mb = key
        remaining = left.setdefault(key, costs.checkpoints.get(stage, 0))
        while remaining and now + costs.checkpoint[stage] <= until:
            events[rank].append(("recompute-bubble", stage, mb, now, now + costs.checkpoint[stage]))
            now += costs.checkpoint[stage]
            prefire[rank] += costs.checkpoint[stage]
            remaining -= 1
        left[key] = remaining
        return now

    def fill(rank: int, now: float, until: float) -> float:
        """Rule 2 until ``until`` (the receive's slack): the micro-batches
        already forwarded whose backward comes next on the rank, in order."""
        for kind, stage, mb in orders[rank][at[rank]:]:
            if now >= until:
                break
            if kind in ("B", "BW") and end.get(("F", stage, mb), until) <= now:
                now = prefire_all(rank, (stage, mb), now, until)
        return now

    def shorter(kind: str, stage: int, mb: int) -> float:
        """What the micro-batch's passes no longer recompute: B first, then
        W, each down to what it takes without checkpoints (none mode)."""
        checkpoints = costs.checkpoints.get(stage, 0)
        prefired = (checkpoints - left.get((stage, mb), checkpoints)) * costs.checkpoint.get(stage, 0.0)

        def recomputes(pass_kind: str) -> float:  # the pass's recomputation: it less the pass without checkpoints
            took = costs.instance.get((pass_kind, stage, mb), durations[(pass_kind, stage)])
            return max(0.0, took - costs.action["none"].get((pass_kind, stage), 0.0))

        inside_b = recomputes("B" if ("B", stage) in durations else "BW")
        if kind in ("B", "BW"):
            return min(prefired, inside_b)
        return min(max(0.0, prefired - inside_b), recomputes("W"))

    todo = sum(len(o) for o in orders)
    while todo:
        ran = 0
        for rank in range(world):
            while at[rank] < len(orders[rank]):
                kind, stage, mb = orders[rank][at[rank]]
                action = (kind, stage, mb)
                dep = _consumes(action, n_stages)
                received = dep is not None and stage_rank(dep[1]) != stage_rank(stage)
                if dep is not None and dep not in (sent if received else end):
                    break  # another rank has not produced it yet
                ready = 0.0 if dep is None else (sent[dep] + costs.latency) if received else end[dep]
                start = free[rank] + costs.before.get(action, 0.0)
                if mode == "bubble" and received:  # Note [Filling bubbles]
                    began = start
                    if kind in ("B", "BW"):  # rule 1, whether or not the gradient is there
                        start = prefire_all(rank, (stage, mb), start, float("inf"))
                    start = fill(rank, start, began + slack.get((kind, stage, mb), 0.0))  # rule 2
                if ready > start:
                    wait[rank] += ready - start
                    waited[(kind, stage, mb)] = ready - start
                    events[rank].append(("wait", stage, mb, start, ready))
                    start = ready
                took = costs.instance.get(action, durations[(kind, stage)]) + costs.overhead
                if mode == "bubble" and kind != "F":
                    took -= shorter(kind, stage, mb)
                free[rank] = start + took
                end[_produced(action)] = free[rank]
                if action not in last_of:
                    sent[_produced(action)] = free[rank]
                elif last_of[action] == action:
                    sent.update({_produced(a): free[rank] for a in members[action]})
                events[rank].append((kind, stage, mb, start, free[rank]))
                at[rank] += 1
                todo -= 1
                ran += 1
        if not ran:
            stuck = {rank: orders[rank][at[rank]] for rank in range(world) if at[rank] < len(orders[rank])}
            raise RuntimeError(f"prefire.pipeline_bench.simulate: the schedule's order deadlocks at {stuck}")
    return Replay(max(free) + costs.tail, wait, prefire, waited, events)


# --- what a 2-rank run measured -------------------------------------------------------------------------------


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
    """The durations a run measured (``python -m prefire.pipeline_bench --json``):
    medians over its modes' measured steps (Note [What the simulator
    replays])."""
    timelines = summary["timelines"]
    missing = [m for m in ("none", "torch", "session") if m not in timelines]
    if missing:
        raise ValueError(f"prefire.pipeline_bench.simulate: the run has no {', '.join(missing)} mode "
                         "(run the program with --modes none,torch,session,bubble)")
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


def _placement(schedule: str, world: int) -> Callable[[int], int]:
    owner = {stage: rank for rank in range(world) for stage in stage_indices(schedule, rank, world)}
    return owner.__getitem__


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
    each (bubble mode: replayed as a session step, its rules already
    applied)."""
    took, before = _step_durations(summary, mode, index)
    return dataclasses.replace(costs, instance=took, before=before)


def measured_slack(summary: Dict[str, Any], index: int) -> Optional[Dict[Action, float]]:
    """The slack bubble mode's runtime worked to in its ``index``-th
    measured step, per receiving action (Note [Filling bubbles]: a forward
    receive is its F, a backward one its B or full backward); None where
    the run did not record it."""
    slack: Dict[Action, float] = {}
    for rank in summary["timelines"]["bubble"]:
        points = _steps(rank)[index].get("slack")
        if points is None:
            return None
        for kind, stage, mb, seconds in points:
            for action_kind in (("F",) if kind == "forward" else ("B", "BW")):
                slack[(action_kind, stage, mb)] = seconds
    return slack


def validate(summary: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Each mode of a run, measured against its replay: every measured
    step replayed with its own durations (bubble mode with session mode's
    step of the same index, the steps of modes run in turn, and the slack
    its runtime learned), then the step (median over the steps) and the
    bubble (waits of all ranks together: their mean over the steps, which
    swing widely from step to step, and the range) set beside what was
    measured (Note [What the simulator replays])."""
    cfg = summary["config"]
    schedule, world = cfg["schedule"], cfg["world"]
    micro_batches = cfg["model"]["micro_batches"]
    orders, groups = rank_orders(schedule, world, micro_batches), overlaps(schedule, world, micro_batches)
    placement, n_stages = _placement(schedule, world), SCHEDULES[schedule][1] * world
    costs = measured_costs(summary)
    modes = [mode for mode in REPLAYED if mode in summary["timelines"]]
    steps = min(len(_steps(rank)) for mode in modes for rank in summary["timelines"][mode])
    rows = []
    for name, mode in [(m, m) for m in modes] + ([("bubble as run", "bubble")] if "bubble" in modes else []):
        if name == "bubble as run":  # its own steps, prefires where they ran
            replays = [replay(orders, placement, n_stages, step_costs(costs, summary, "bubble", k), "session",
                              groups) for k in range(steps)]
        else:
            source = "session" if mode == "bubble" else mode
            replays = [replay(orders, placement, n_stages, step_costs(costs, summary, source, k), mode, groups,
                              measured_slack(summary, k) if mode == "bubble" else None) for k in range(steps)]
        step, waits = measured_step(summary, mode)
        rows.append({"schedule": schedule, "mode": name, "step_s": step,
                     "simulated_step_s": statistics.median(r.step_s for r in replays),
                     "wait_s": statistics.mean(waits) if waits else None, "wait_range_s": waits and
                     [min(waits), max(waits)], "simulated_wait_s": statistics.mean(sum(r.wait_s) for r in replays)})
    return rows


# --- predictions -------------------------------------------------------------------------------------------------


def _positions(costs: Costs, n_stages: int) -> Dict[str, Dict[str, float]]:
    """Per position (first, middle, last) and kind: what a measured stage
    there took, per mode; a kind not measured in a position is derived
    (a full backward is B + W, B is a full backward less W)."""
    out: Dict[str, Dict[str, float]] = {}
    middle = list(range(1, n_stages - 1))
    if not middle:
        raise ValueError("prefire.pipeline_bench.simulate: predicting needs a measured run with a middle stage "
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

    def measured_stage(fine: int) -> int:
        if fine in (0, fine_stages - 1):
            return 0 if fine == 0 else measured_stages - 1
        return 1 + (fine - 1) % (measured_stages - 2)

    out = []
    steps = min(len(_steps(rank)) for rank in summary["timelines"][mode])
    for k in range(steps):
        took, _ = _step_durations(summary, mode, k)
        instance: Dict[Action, float] = {}
        for stage in range(fine_stages // group):
            parts = [measured_stage(stage * group + g) for g in range(group)]
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
    (``scaled_steps``; bubble mode with session mode's): step per mode (the
    median over steps), its ratios to torch's checkpoint, the bubble
    fraction (the mean) and H (Note [What the simulator replays])."""
    cfg = summary["config"]
    measured_stages = SCHEDULES[cfg["schedule"]][1] * cfg["world"]
    costs = scaled_costs(measured_costs(summary), measured_stages, schedule, world)
    n_stages = SCHEDULES[schedule][1] * world
    modes = [m for m in REPLAYED if not (m == "bubble" and schedule == "1f1b")]  # no bubble hook in 1F1B
    orders, groups = rank_orders(schedule, world, 2 * world), overlaps(schedule, world, 2 * world)
    placement = _placement(schedule, world)
    runs = {mode: [replay(orders, placement, n_stages, dataclasses.replace(costs, instance=instance), mode, groups)
                   for instance in scaled_steps(summary, "session" if mode == "bubble" else mode, schedule, world)]
            for mode in modes}
    step = {mode: statistics.median(r.step_s for r in replays) for mode, replays in runs.items()}
    waits = {mode: statistics.mean(sum(r.wait_s) for r in replays) for mode, replays in runs.items()}
    lazy = step["session"] - step["none"]
    # all ranks' recomputation in session mode against all their waits: H can be no larger
    recompute = 2 * world * sum(costs.checkpoints[s] * costs.checkpoint[s] for s in range(n_stages))
    return {
        "schedule": schedule, "world": world, "micro_batches": 2 * world, "step_s": step,
        "ratio_to_torch": {mode: step[mode] / step["torch"] for mode in step},
        "bubble_fraction": {mode: statistics.mean(r.bubble_fraction() for r in replays)
                            for mode, replays in runs.items()},
        "hidden_fraction": (step["session"] - step["bubble"]) / lazy if "bubble" in step and lazy > 0 else None,
        "hidden_fraction_bound": min(1.0, waits["session"] / recompute) if recompute > 0 else None,
        "prefire_s": statistics.mean(sum(r.prefire_s) for r in runs["bubble"]) if "bubble" in runs else None,
    }


# --- the search over per-block plans ------------------------------------------------------------------------------

# Note [Searching per-block plans]
# A memory sweep (python -m prefire.pipeline_bench.sweep) runs prefire's plan at
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
# selective seconds); the rest of the replay is as in
# Note [What the simulator replays]. Both sides of the ratio are replays:
# it measures the planner's choice (least recomputation, bytes by its
# count), not the replay's fidelity (``validate`` does that).


KEEP, CHECKPOINT, SELECTIVE = _C.Choice.KEEP, _C.Choice.CHECKPOINT, _C.Choice.SELECTIVE


def _plan_of(rank: Dict[str, Any]) -> Tuple[List[Any], List[List[int]]]:
    """A plan run's rank: its blocks' costs and prefire's choice, per
    micro-batch (a Choice per block, in the plan's order)."""
    if any(not isinstance(fields, dict) for fields in rank["plan_costs"]):
        raise ValueError("prefire.pipeline_bench.simulate: this sweep's plan_costs are lists of values by position, "
                         "as an older prefire wrote them; run the sweep again (costs are written by field name)")
    costs = [_C.BlockCost.from_dict(fields) for fields in rank["plan_costs"]]
    stages = sorted(rank["plan"], key=int)

    def per_micro_batch(plan: Dict[str, Any], stage: str) -> List[List[bool]]:
        got = plan.get(stage)
        if got is None:
            return [[False] * len(rank["plan"][stage][0])] * len(rank["plan"][stage])
        return got

    checkpointed = {stage: per_micro_batch(rank["plan"], stage) for stage in stages}
    selective = {stage: per_micro_batch(rank.get("plan_selective") or {}, stage) for stage in stages}
    micro_batches = len(checkpointed[stages[0]])
    chosen = [[SELECTIVE if sel else CHECKPOINT if c else KEEP for stage in stages
               for c, sel in zip(checkpointed[stage][m], selective[stage][m])] for m in range(micro_batches)]
    return costs, chosen


def _plan_bytes(blocks: Sequence[Any], choices: Sequence[Any]) -> int:
    return _C.describe_plan(list(blocks), list(choices), 0, 0, _C.Release.AT_STEP_END).peak_bytes


def _with_plan(costs: Costs, blocks: Sequence[Any], options: Sequence[Sequence[int]]) -> Costs:
    """``costs`` with a mode "plan": per stage and micro-batch (``options``:
    per micro-batch, a choice per block), none's durations plus session's
    extra in the share of the stage's recomputation the plan recomputes
    there."""
    total: Dict[int, float] = {}
    for cost in blocks:
        total[cost.group] = total.get(cost.group, 0.0) + cost.recompute_seconds
    none, session = costs.action["none"], costs.action["session"]
    instance: Dict[Action, float] = {}
    for mb, per_block in enumerate(options):
        chosen: Dict[int, float] = {}
        for cost, o in zip(blocks, per_block):
            chosen[cost.group] = chosen.get(cost.group, 0.0) + _C.choice_seconds(cost, o)
        for (kind, stage), base in none.items():
            share = chosen.get(stage, 0.0) / total[stage] if total.get(stage) else 0.0
            instance[(kind, stage, mb)] = base + share * max(0.0, session.get((kind, stage), base) - base)
    return Costs(dict(costs.action, plan=dict(none)), costs.checkpoint, costs.checkpoints, costs.latency,
                 costs.overhead, costs.tail, instance=instance)


def search(summary: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Per plan run of a memory sweep: the fastest replayed per-block plan
    within every rank's budget, and prefire's plan (per micro-batch)
    replayed (Note [Searching per-block plans])."""
    cfg = summary["config"]
    schedule, world, micro_batches = cfg["schedule"], cfg["world"], cfg["model"]["micro_batches"]
    costs = measured_costs(summary)
    orders = rank_orders(schedule, world, micro_batches)
    groups = overlaps(schedule, world, micro_batches)
    n_stages = SCHEDULES[schedule][1] * world
    placement = _placement(schedule, world)

    def step(blocks: Sequence[Any], options: Sequence[Sequence[int]]) -> float:
        return replay(orders, placement, n_stages, _with_plan(costs, blocks, options), "plan", groups).step_s

    rows = []
    for name, mode in summary["modes"].items():
        if name.split(" ")[0] not in ("plan", "plan-selective"):  # plan-bubble's prefires are not replayed here
            continue
        plans = [_plan_of(r) for r in mode["ranks"]]
        budgets = [r["memory_budget"] for r in mode["ranks"]]
        fitting = []
        for (blocks, _), budget in zip(plans, budgets):
            choices = itertools.product(*[(KEEP, CHECKPOINT, SELECTIVE) if b.selective_bytes >= 0 else (KEEP, CHECKPOINT)
                                          for b in blocks])
            fitting.append([list(c) for c in choices if _plan_bytes(blocks, c) <= budget])
        blocks = [b for rank_blocks, _ in plans for b in rank_blocks]
        best_s, best = float("inf"), None
        for combo in itertools.product(*fitting):
            options = [o for rank in combo for o in rank]
            s = step(blocks, [options] * micro_batches)
            if s < best_s:
                best_s, best = s, options
        chosen = [[o for _, rank_chosen in plans for o in rank_chosen[m]] for m in range(micro_batches)]
        chosen_s = step(blocks, chosen)
        rows.append({"name": name, "budgets": budgets, "plans_tried": math.prod(len(f) for f in fitting),
                     "best_s": best_s, "best": [best] * micro_batches, "chosen_s": chosen_s, "chosen": chosen,
                     "chosen_over_best": chosen_s / best_s, "measured_s": mode["step_s"]})
    return rows


def _read(path: str) -> Dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefire.pipeline_bench.simulate",
                                description="Replays pipeline schedules with durations a 2-rank run of "
                                            "python -m prefire.pipeline_bench measured (its --json summary).")
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate", help="each run's modes, measured against their replay")
    v.add_argument("runs", nargs="+", metavar="SUMMARY.json")
    pr = sub.add_parser("predict", help="the runs' schedules on more ranks (micro-batches = 2 x ranks)")
    pr.add_argument("runs", nargs="+", metavar="SUMMARY.json")
    pr.add_argument("--ranks", default="4,8,16")
    pr.add_argument("--json", metavar="PATH", help="write the predictions as JSON")
    pr.add_argument("--plot", metavar="PATH", help="plot step time / torch's and H against ranks")
    se = sub.add_parser("search", help="a memory sweep's plans against the fastest per-block plan within each "
                                       "budget (python -m prefire.pipeline_bench.sweep --json)")
    se.add_argument("runs", nargs="+", metavar="SWEEP.json")
    a = p.parse_args(argv)
    summaries = [_read(path) for path in a.runs]
    if a.command == "search":
        print(f"{'schedule':14} {'run':9} {'plans':>5} {'best ms':>8} {'prefire ms':>10} {'prefire/best':>12} "
              f"{'measured ms':>11}  best plan (k: kept, c: checkpointed, s: selectively) / prefire's")
        for summary in summaries:
            for row in search(summary):
                def letters(plan):  # per micro-batch, split by / where they differ
                    per_micro_batch = ["".join("kcs"[int(o)] for o in options) for options in plan]
                    return per_micro_batch[0] if len(set(per_micro_batch)) == 1 else "/".join(per_micro_batch)
                print(f"{summary['config']['schedule']:14} {row['name']:9} {row['plans_tried']:5d} "
                      f"{row['best_s'] * 1e3:8.1f} {row['chosen_s'] * 1e3:10.1f} {row['chosen_over_best']:12.3f} "
                      f"{row['measured_s'] * 1e3:11.1f}  {letters(row['best'])} / {letters(row['chosen'])}")
        return 0
    if a.command == "validate":
        print(f"{'schedule':18} {'mode':13} {'step ms':>8} {'replay':>8} {'diff':>6}   "
              f"{'bubble ms (steps min-max)':>26} {'replay':>8} {'diff':>6}")
        for summary in summaries:
            for row in validate(summary):
                waits, sim_wait = row["wait_s"], row["simulated_wait_s"] * 1e3
                bubble = (f"{waits * 1e3:9.1f} ({row['wait_range_s'][0] * 1e3:5.1f}-{row['wait_range_s'][1] * 1e3:5.1f})"
                          f" {sim_wait:8.1f} {row['simulated_wait_s'] / waits - 1:+6.1%}" if waits else
                          f"{'not seen':>26} {sim_wait:8.1f} {'-':>6}")
                print(f"{row['schedule']:18} {row['mode']:13} {row['step_s'] * 1e3:8.1f} "
                      f"{row['simulated_step_s'] * 1e3:8.1f} {row['simulated_step_s'] / row['step_s'] - 1:+6.1%}   "
                      + bubble)
        return 0
    ranks = [int(r) for r in a.ranks.split(",") if r]
    by_schedule = {s["config"]["schedule"]: s for s in summaries}
    schedules = [s for s in by_schedule if s != "1f1b"]  # 1f1b's own run has no middle stage:
    if "interleaved-1f1b" in by_schedule:                # it is predicted from interleaved-1f1b's
        schedules.append("1f1b")
    predictions = [predict(by_schedule["interleaved-1f1b" if schedule == "1f1b" else schedule], schedule, world)
                   for schedule in schedules for world in ranks]
    print("PREDICTED (simulated from 2-rank measurements; weak scaling, micro-batches = 2 x ranks)")
    print(f"{'schedule':18} {'ranks':>5} {'none/torch':>10} {'session/torch':>13} {'bubble/torch':>12} "
          f"{'bubble frac (session)':>21} {'H':>6} {'H bound':>8}")

    def fmt(value: Optional[float], digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    for row in predictions:
        ratio = row["ratio_to_torch"]
        print(f"{row['schedule']:18} {row['world']:5d} {ratio['none']:10.3f} {ratio['session']:13.3f} "
              f"{fmt(ratio.get('bubble'), 3):>12} {row['bubble_fraction']['session']:21.3f} "
              f"{fmt(row['hidden_fraction'], 2):>6} {fmt(row['hidden_fraction_bound'], 2):>8}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(predictions, f, indent=1)
    if a.plot:
        plot(predictions, a.plot)
    return 0


def plot(predictions: List[Dict[str, Any]], path: str) -> None:
    """Predicted step time over torch's checkpoint (session, bubble) and H
    against ranks, one line per schedule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for schedule in dict.fromkeys(r["schedule"] for r in predictions):
        rows = [r for r in predictions if r["schedule"] == schedule]
        worlds = [r["world"] for r in rows]
        line, = left.plot(worlds, [r["ratio_to_torch"]["session"] for r in rows], marker="o", label=schedule)
        if all("bubble" in r["ratio_to_torch"] for r in rows):
            left.plot(worlds, [r["ratio_to_torch"]["bubble"] for r in rows], marker="x", linestyle="--",
                      color=line.get_color())
        if all(r["hidden_fraction"] is not None for r in rows):
            right.plot(worlds, [r["hidden_fraction"] for r in rows], marker="o", color=line.get_color(),
                       label=schedule)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks (micro-batches = 2 x ranks)")
        ax.grid(alpha=0.3)
    left.set_ylabel("step / torch's checkpoint")
    left.set_title("PREDICTED: session (solid), bubble (dashed)", fontsize=9)
    right.set_ylabel("H = (session - bubble) / (session - none)")
    right.set_title("PREDICTED: recomputation hidden in bubbles", fontsize=9)
    left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
