"""The replay of the pipeline simulator (``python -m pipeline_sim``):
torch's orders of actions for any number of ranks, and a timeline of them
with measured durations.

    python -m pipeline_bench --schedule zbv --modes none,torch,session,prefire --json zbv.json
    python -m pipeline_sim validate zbv.json
    python -m pipeline_sim predict zbv.json --ranks 4,8,16
    python -m pipeline_bench.sweep --json sweep.json
    python -m pipeline_sim search sweep.json

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
Modes: none, torch and session replay their own measured durations; prefire
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
Mode placed replays session's durations with recompute actions of
their own where a placement puts them (before an action: the rank runs
them when it reaches the action, then the action as soon as what it
consumes is there; Note [Where recomputation can run] in place.py),
the passes shortened as in prefire mode; ``validate`` replays a run's
placed mode (the pipeline program's ``--placement``) so, on session mode's
steps of the same index.
``validate`` replays prefire mode twice: by these rules, from the steps of
session mode of the same index (the program runs the modes' steps in
turn, so those ran beside them) and the recorded slack; and as it ran
("prefire as run"): its own steps' durations, each bubble prefire rank
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

import functools
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from pipeline_bench.config import SCHEDULES, stage_indices
from prefire.pipelining.actions import Action, compute_actions
from prefire.pipelining.placement import Placement


StageMicroBatch = Tuple[int, int]  # (stage, micro-batch)
REPLAYED = ("none", "torch", "session", "prefire")


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
           slack: Optional[Dict[Action, float]] = None, placement: Optional[Placement] = None) -> Replay:
    """Replays one step (Note [What the simulator replays]); ``groups``:
    actions whose outputs are sent together after the last of them
    (``overlaps``); ``slack``: prefire mode's, per receiving action (what
    the runtime learned, ``measured_slack``); without it, prefire mode first
    replays session mode and takes its waits; ``placement``: placed mode's
    recompute actions."""
    if mode == "prefire" and slack is None:
        slack = _replay(orders, stage_rank, n_stages, costs, "session", {}, groups, {}).waited
    return _replay(orders, stage_rank, n_stages, costs, mode, slack or {}, groups, placement or {})


def _replay(orders: Sequence[Sequence[Action]], stage_rank: Callable[[int], int], n_stages: int, costs: Costs,
            mode: str, slack: Dict[Tuple[str, int, int], float], groups: Sequence[Tuple[Action, ...]],
            placement: Placement) -> Replay:
    return _Timeline(orders, stage_rank, n_stages, costs, mode, slack, groups, placement).run()


class _Timeline:
    """One replayed step (Note [What the simulator replays]): each rank runs
    its actions in order, an action when the rank is free and what it
    consumes is there."""

    def __init__(self, orders: Sequence[Sequence[Action]], stage_rank: Callable[[int], int], n_stages: int,
                 costs: Costs, mode: str, slack: Dict[Tuple[str, int, int], float],
                 groups: Sequence[Tuple[Action, ...]], placement: Placement) -> None:
        self.orders, self.stage_rank, self.n_stages, self.costs = orders, stage_rank, n_stages, costs
        self.mode, self.slack, self.placement = mode, slack, placement
        self.prefires = mode in ("prefire", "placed")
        self.durations = costs.action["session" if self.prefires else mode]
        world = len(orders)
        self.end: Dict[Tuple[str, int, int], float] = {}   # ("F" or "back", stage, micro-batch) -> when it ended
        self.sent: Dict[Tuple[str, int, int], float] = {}  # ... -> when its output left for another rank
        self.last_of = {action: group[-1] for group in groups for action in group}
        self.members = {group[-1]: group for group in groups}
        self.free = [0.0] * world
        self.at = [0] * world
        self.wait = [0.0] * world
        self.prefire = [0.0] * world
        self.waited: Dict[Action, float] = {}               # before which action, how long
        self.left: Dict[StageMicroBatch, int] = {}          # prefire: checkpoints not prefired yet
        self.events: List[List[Tuple[str, int, int, float, float]]] = [[] for _ in range(world)]
        self.placed: set = set()

    def run(self) -> Replay:
        todo = sum(len(o) for o in self.orders)
        while todo:
            ran = 0
            for rank in range(len(self.orders)):
                while self.at[rank] < len(self.orders[rank]) and self.step(rank):
                    todo -= 1
                    ran += 1
            if not ran:
                stuck = {rank: self.orders[rank][self.at[rank]] for rank in range(len(self.orders))
                         if self.at[rank] < len(self.orders[rank])}
                raise RuntimeError(f"pipeline_sim: the schedule's order deadlocks at {stuck}")
        return Replay(max(self.free) + self.costs.tail, self.wait, self.prefire, self.waited, self.events)

    def step(self, rank: int) -> bool:
        """Runs the rank's next action; False where what it consumes is not there yet."""
        costs = self.costs
        kind, stage, mb = action = self.orders[rank][self.at[rank]]
        if action in self.placement and action not in self.placed:  # recompute actions placed before it
            self.placed.add(action)
            for r_stage, r_mb, count in self.placement[action]:
                self.free[rank] = self.prefire_all(rank, (r_stage, r_mb), self.free[rank], count=count,
                                                   kind="recompute-placed")
        dep = _consumes(action, self.n_stages)
        received = dep is not None and self.stage_rank(dep[1]) != self.stage_rank(stage)
        if dep is not None and dep not in (self.sent if received else self.end):
            return False  # another rank has not produced it yet
        ready = 0.0 if dep is None else (self.sent[dep] + costs.latency) if received else self.end[dep]
        start = self.free[rank] + costs.before.get(action, 0.0)
        if self.mode == "prefire" and received:  # Note [Filling bubbles]
            began = start
            if kind in ("B", "BW"):  # rule 1, whether or not the gradient is there
                start = self.prefire_all(rank, (stage, mb), start)
            start = self.fill(rank, start, began + self.slack.get(action, 0.0))  # rule 2
        if ready > start:
            self.wait[rank] += ready - start
            self.waited[action] = ready - start
            self.events[rank].append(("wait", stage, mb, start, ready))
            start = ready
        took = costs.instance.get(action, self.durations[(kind, stage)]) + costs.overhead
        if self.prefires and kind != "F":
            took -= self.shorter(kind, stage, mb)
        self.free[rank] = start + took
        self.end[_produced(action)] = self.free[rank]
        if action not in self.last_of:
            self.sent[_produced(action)] = self.free[rank]
        elif self.last_of[action] == action:
            self.sent.update({_produced(a): self.free[rank] for a in self.members[action]})
        self.events[rank].append((kind, stage, mb, start, self.free[rank]))
        self.at[rank] += 1
        return True

    def prefire_all(self, rank: int, key: StageMicroBatch, now: float, until: float = float("inf"),
                    count: Optional[int] = None, kind: str = "recompute-bubble") -> float:
        """Prefires ``key``'s checkpoints not prefired yet, one at a time
        while the next one ends by ``until``, at most ``count`` (a placed
        recompute action's); returns when it stopped."""
        stage, mb = key
        checkpoint = self.costs.checkpoint
        remaining = self.left.setdefault(key, self.costs.checkpoints.get(stage, 0))
        ran = 0
        while remaining and now + checkpoint[stage] <= until and (count is None or ran < count):
            self.events[rank].append((kind, stage, mb, now, now + checkpoint[stage]))
            now += checkpoint[stage]
            self.prefire[rank] += checkpoint[stage]
            remaining -= 1
            ran += 1
        self.left[key] = remaining
        return now

    def fill(self, rank: int, now: float, until: float) -> float:
        """Rule 2 until ``until`` (the receive's slack): the micro-batches
        already forwarded whose backward comes next on the rank, in order."""
        for kind, stage, mb in self.orders[rank][self.at[rank]:]:
            if now >= until:
                break
            if kind in ("B", "BW") and self.end.get(("F", stage, mb), until) <= now:
                now = self.prefire_all(rank, (stage, mb), now, until)
        return now

    def shorter(self, kind: str, stage: int, mb: int) -> float:
        """What the micro-batch's passes no longer recompute: B first, then
        W, each down to what it takes without checkpoints (none mode)."""
        costs = self.costs
        checkpoints = costs.checkpoints.get(stage, 0)
        prefired = (checkpoints - self.left.get((stage, mb), checkpoints)) * costs.checkpoint.get(stage, 0.0)

        def recomputes(pass_kind: str) -> float:  # the pass's recomputation: it less the pass without checkpoints
            took = costs.instance.get((pass_kind, stage, mb), self.durations[(pass_kind, stage)])
            return max(0.0, took - costs.action["none"].get((pass_kind, stage), 0.0))

        if kind == "BW":  # a full backward, even on a stage that splits other micro-batches' (DualPipeV)
            return min(prefired, recomputes("BW"))
        inside_b = recomputes("B")
        if kind == "B":
            return min(prefired, inside_b)
        return min(max(0.0, prefired - inside_b), recomputes("W"))


@dataclass
class Pipeline:
    """One schedule on a number of ranks, as the replay takes it."""

    orders: Sequence[Sequence[Action]]
    stage_rank: Callable[[int], int]
    n_stages: int
    costs: Costs
    groups: Sequence[Tuple[Action, ...]] = ()

    def run(self, mode: str, placement: Optional[Placement] = None) -> Replay:
        return replay(self.orders, self.stage_rank, self.n_stages, self.costs, mode, self.groups,
                      placement=placement)
