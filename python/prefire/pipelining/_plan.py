"""A pipeline rank's plan from a memory budget (used by
:mod:`prefire.pipelining`): ``enable(schedule, memory_budget=N)``.

Note [A pipeline rank's memory plan]
The budget covers what the rank's blocks hold for backward: kept blocks'
saved tensors, checkpointed blocks' inputs, what the sessions hold
recomputed (the census, ``runtime_stats().peak_held_bytes``).
1. The blocks are a stage forward's outermost prefire.checkpoint calls, in
   order (Note [Planned checkpoints] in _checkpoint.py), each run inside a
   SavedTensorMeter. A forward that makes another number of calls than its
   measurement raises: the plan is per call.
2. The first step of a signature (the shapes, dtypes and devices of a
   stage's first block's inputs) measures: every block checkpointed, the
   sessions keeping nothing for W (W recomputes). Per block: what keeping
   it holds (``kept_bytes``), its inputs' storages, its forward's time (one
   recomputation; synchronised on CUDA), and, offered, what a selective
   checkpoint would hold and recompute (Note [Measuring a selective
   checkpoint] in _selective.py) and what its copies to an offload tier
   take (the tier's ``measure_copy_seconds``). ``_costs.py`` makes
   BlockCosts of it.
3. When the rank's last action has run (or the next step begins, for a
   schedule without an order of actions) the C++ planner chooses over the
   rank's items (``rank_items``): one per (stage, micro-batch, block), alive
   from its micro-batch's F to its W, recomputed by its B and W, each pass
   counted where it runs (Note [What a plan holds] in
   src/plan/plan_bytes.cpp); so a micro-batch whose lifetime misses the
   rank's peak may keep blocks the others recompute. Without an order of
   actions, one choice per block. ``stage_plans`` says, per stage, each
   micro-batch's choices and what one pass of the stage holds.
4. A choice runs as: kept, the block itself; checkpointed,
   ``prefire.checkpoint``; selective, with the policy's context_fn (Note
   [Selective checkpoints in a plan]); offloaded, with ``offload_to`` (Note
   [Offloaded blocks in a plan]; a bubble prefire of it is a prefetch).
5. The least budget is the least any plan holds (``least_plan_bytes``, as
   for a plain model); below it ValueError names it. The measuring step
   holds what checkpointing every block holds; a budget below that is taken
   with a warning that the measuring step held more.
6. What the plan leaves is the sessions' byte budget, action by action
   (``Plan.room_bytes``; Note [A rank's byte budget] in _budget.py); a
   micro-batch whose blocks the plan keeps recomputes nothing.
7. A block may hold bytes after its micro-batch's W until the step ends
   (the last stage's outputs and losses, in a schedule that keeps their
   graphs: Note [The last stage lets go of its graph after W] in
   _hook_points.py); its meter says how much. Until seen, a last-stage
   block is taken to hold the largest share its stage's other blocks were
   seen to hold (all of it when none was), every other block nothing, and
   the last stage's nothing once ``enable`` let go of a loss. A step that
   sees a block's bytes after W for the first time plans again at its end;
   a kept block that holds more than counted warns.
8. A later step whose signature was measured runs its plan; a new signature
   measures again (a shape change re-plans; alternating shapes each keep
   theirs).
9. Given choices (``enable(..., choices=)``: per stage, micro-batch and
   block, as the simulator's joint plan writes them) take the planner's
   place: the measuring step still measures, and its end checks them
   against what it found (each choice offered, the blocks' count, the
   plan's peak by the planner's count within the budget: else ValueError)
   and runs them as rules 4-7 run the planner's. A schedule without an order
   of actions takes one choice per block, the same in every micro-batch.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .. import _C
from .._measuring import (Measured, Signature, check_memory_budget, hold_budget_with, measure, signature, tensors,
                          warn_measuring_step)
from .._meter import SavedTensorMeter
from .._selective import context_fn, mode_costs
from ._budget import RankBudget
from ._costs import CHECKPOINT, KEEP, OFFLOAD, SELECTIVE, StageMeasured, stage_costs
from .actions import Action, planner_actions


_log = logging.getLogger("prefire")

PlanKey = Tuple[Tuple[int, Signature], ...]  # ((stage, signature), ...) for the rank's stages, in stage order


@dataclass
class RankPlan:
    """The plan of one key: the C++ planner's plan of the rank's items, and
    what it says per stage (``StagePlan``: a choice per micro-batch and
    block, what one pass of the stage holds)."""

    key: PlanKey
    costs: List[_C.BlockCost]  # per block, the stages in the key's order: what the measuring step found, with lifetimes
    plan: _C.Plan              # a choice per (stage, micro-batch, block) where the actions are known, else per block
    stages: Dict[int, _C.StagePlan]

    def choices(self, stage: int, micro_batch: int) -> List[_C.Choice]:
        """Per block, the choice of ``stage``'s forward of ``micro_batch``
        (a step of more micro-batches than planned: as many as a plan has)."""
        per_micro_batch = self.stages[stage].choices
        return list(per_micro_batch[micro_batch % len(per_micro_batch)])

    @property
    def checkpointed(self) -> Dict[int, List[List[bool]]]:
        """Per stage, micro-batch and block: checkpointed (whole, selectively or offloaded) rather than kept."""
        return {s: [[c != KEEP for c in blocks] for blocks in p.choices] for s, p in self.stages.items()}

    @property
    def session_bytes(self) -> int:
        """The least the budget leaves the rank's sessions beside the blocks
        (more where they hold less: ``plan.room_bytes``)."""
        return min(self.plan.room_bytes)


class _StageForward:
    """The planned calls of one stage forward."""

    def __init__(self, planner: "RankPlanner", stage: int, micro_batch: int) -> None:
        self.planner, self.stage, self.micro_batch = planner, stage, micro_batch
        self.choices: Optional[List[Any]] = None  # per call: a Choice; None: measuring
        self.signature: Optional[Signature] = None
        self.records: List[Measured] = []  # measuring, per call
        self.meters: List[Tuple[Any, SavedTensorMeter]] = []  # per call: its choice, and its meter
        self.calls = 0

    def _metered(self, choice: Any, run: Callable[[], Any]) -> Any:
        meter = SavedTensorMeter()
        self.meters.append((choice, meter))
        with meter:
            return run()

    def run(self, checkpointed: Callable[[], Any], plain: Callable[[], Any],
            selective: Optional[Callable[[Callable[[], Any]], Any]], offloaded: Optional[Callable[[Any], Any]],
            args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        if self.calls == 0:
            self.signature = signature(tensors(args, kwargs))
            self.choices = self.planner._choices(self.stage, self.micro_batch, self.signature)
        index, self.calls = self.calls, self.calls + 1
        if self.choices is None:
            return self._measure(checkpointed, selective is not None, tensors(args, kwargs))
        if index >= len(self.choices):
            raise RuntimeError(f"prefire.pipelining: stage {self.stage}'s forward made more checkpoint calls than the "
                               f"{len(self.choices)} its plan was measured with; memory_budget plans each call of a "
                               f"forward in order, and the forwards of one input signature must make the same calls")
        choice = self.choices[index]
        if choice in (SELECTIVE, OFFLOAD):  # a call that passes its own context_fn or tier cannot take the plan's
            run, own, planned, argument = ((selective, "has a context_fn", "checkpoints it selectively",
                                            self.planner.selective_context) if choice == SELECTIVE else
                                           (offloaded, "offloads to a tier", "offloads it", self.planner.offload_to))
            if run is None:
                raise RuntimeError(f"prefire.pipelining: stage {self.stage}'s checkpoint call {index} {own} of its "
                                   f"own where its plan, measured without one, {planned}; the forwards of one input "
                                   f"signature must make the same calls")
            return self._metered(choice, lambda: run(argument))
        return self._metered(choice, checkpointed if choice == CHECKPOINT else plain)

    def _measure(self, checkpointed: Callable[[], Any], selectable: bool, inputs: List[Any]) -> Any:
        """A measuring call (_measuring.py), and where a selective
        checkpoint is planned for, what that would hold and recompute."""
        out, measured = measure(lambda: self._metered(CHECKPOINT, checkpointed), inputs,
                                self.planner.selective_policy if selectable else None, self.planner.mode_costs,
                                any(t.is_cuda for t in inputs))
        self.records.append(measured)
        return out


class RankPlanner:
    """Chooses, per input signature, which of the rank's blocks keep their
    activations within ``memory_budget`` bytes (Note [A pipeline rank's
    memory plan])."""

    def __init__(self, memory_budget: int, budget: RankBudget, stages: List[int], micro_batches: int,
                 last_stage: Optional[int] = None, selective_policy: Optional[Callable[..., Any]] = None,
                 offload_to: Any = None, choices: Optional[GivenChoices] = None) -> None:
        """``memory_budget``: checked by the caller; ``last_stage``: the
        pipeline's last stage, if on this rank; ``selective_policy``: a SAC
        policy function, a third choice per block (None: keep or checkpoint);
        ``offload_to``: an OffloadTier, a fourth (None: none); ``choices``:
        the plan to run in place of the planner's (``check_choices``; rule 9)."""
        self.choices = check_choices(choices, stages, micro_batches) if choices is not None else None
        self.last_stage = last_stage
        self.offload_to = offload_to
        self.selective_policy = selective_policy
        self.selective_context = context_fn(selective_policy) if selective_policy is not None else None
        self.mode_costs = mode_costs(selective_policy) if selective_policy is not None else None
        self.memory_budget = memory_budget
        self.budget = budget
        self.stages = sorted(stages)
        self.micro_batches = micro_batches
        self.measuring_steps = 0
        self._measured: Dict[Tuple[int, Signature], StageMeasured] = {}
        self._latest: Dict[int, Signature] = {}   # each stage's signature in its latest forward
        self._plans: Dict[PlanKey, RankPlan] = {}
        self._current: Optional[RankPlan] = None
        self._measuring = False                    # this step measures
        self._actions: List[Action] = []           # the rank's actions in a step (empty: no order)
        self._open: Dict[Tuple[int, int], _StageForward] = {}  # (stage, micro-batch) -> its forward, until its W
        self._learnt = False                       # a block's bytes after W seen for the first time: plan again
        self._warned: set = set()                  # (key, budget) whose measuring step was said to hold more
        # the schedule keeps no graph of the last stage past its W (Note [The last stage lets go of its
        # graph after W] in _hook_points.py): its blocks are taken to hold nothing after W until seen
        self.last_stage_lets_go = False

    @property
    def plan(self) -> Optional[RankPlan]:
        """The plan the latest planned step ran or the next will (None before one was chosen)."""
        return self._current

    def set_memory_budget(self, memory_budget: int) -> None:
        """A new budget, planned from what was measured, from the next forward on."""
        check_memory_budget("prefire.pipelining", memory_budget)
        self.memory_budget = memory_budget
        current = self._current.key if self._current is not None else None
        for key in list(self._plans):  # every signature measured, planned anew
            self._choose(key)
        if current is not None:
            self._current = self._plans[current]
            self._use(self._current)

    def forward(self, stage: int, micro_batch: int) -> _StageForward:
        return _StageForward(self, stage, micro_batch)

    def _choices(self, stage: int, micro_batch: int, signature: Signature) -> Optional[List[Any]]:
        self._latest[stage] = signature
        current = self._current
        if current is not None and (stage, signature) in current.key:
            return current.choices(stage, micro_batch)
        for plan in self._plans.values():  # a signature planned before
            if (stage, signature) in plan.key:
                self._current = plan
                self._use(plan)
                return plan.choices(stage, micro_batch)
        if not self._measuring:
            self._measuring = True
            self.measuring_steps += 1
            self.budget.set(0, warn=False)  # sessions keep nothing for W while measuring
        return None

    def forward_done(self, forward: _StageForward, micro_batch: int, handles: List[Any]) -> None:
        if forward.calls:
            self._open[(forward.stage, micro_batch)] = forward
        if forward.choices is not None:
            if forward.calls != len(forward.choices):
                raise RuntimeError(f"prefire.pipelining: stage {forward.stage}'s forward made {forward.calls} checkpoint "
                                   f"calls where its plan was measured with {len(forward.choices)}; memory_budget "
                                   f"plans each call of a forward in order")
            return
        if forward.calls == 0:
            return
        if len(handles) != forward.calls:
            raise RuntimeError(f"prefire.pipelining: stage {forward.stage}'s forward made {forward.calls} checkpoint "
                               f"calls but {len(handles)} checkpoints (one without an input that requires grad?); "
                               f"memory_budget needs one checkpoint per call")
        measured = self._measured.setdefault((forward.stage, forward.signature), StageMeasured())
        if not measured.blocks:
            measured.blocks = [[] for _ in handles]
            measured.after = {choice: [None] * len(handles) for choice in (KEEP, CHECKPOINT, SELECTIVE, OFFLOAD)}
            measured.copies = [[] for _ in handles]
        if len(measured.blocks) != len(handles):
            raise RuntimeError(f"prefire.pipelining: stage {forward.stage}'s forwards of one signature made "
                               f"{len(measured.blocks)} and {len(handles)} checkpoint calls")
        for index, (block, handle, record) in enumerate(zip(measured.blocks, handles, forward.records)):
            kept = _C.kept_bytes(handle)
            block.append((kept, record))
            if self.offload_to is not None:  # an offload moves what keeping it holds, each way: the copies' time
                measured.copies[index].append((kept, self.offload_to.measure_copy_seconds(kept)))

    def last_pass_ran(self, stage: int, micro_batch: int) -> None:
        """The W (or full backward) of ``micro_batch`` on ``stage`` ran: what
        each of its blocks still holds stays until the step ends."""
        forward = self._open.pop((stage, micro_batch), None)
        measured = self._measured.get((stage, forward.signature)) if forward is not None else None
        if measured is None or len(forward.meters) != len(measured.blocks):
            return
        counted = self._counted_after(stage, forward.signature)
        for index, (choice, meter) in enumerate(forward.meters):
            after = measured.after[choice]
            held = meter.current_bytes
            if after[index] is None or held > after[index]:
                self._learnt = True
                after[index] = held
            if counted is not None and choice == KEEP and held > counted[index]:
                warnings.warn(f"prefire.pipelining: block {index} of stage {stage} held {held} bytes after its W, "
                              f"more than the {counted[index]} its plan counted from the stage's other blocks; the "
                              f"rank may have gone over memory_budget={self.memory_budget} this step, and plans "
                              f"again from what it saw", UserWarning, stacklevel=2)

    def _counted_after(self, stage: int, signature: Signature) -> Optional[List[int]]:
        """What the current plan counts each block of ``stage`` to hold after W, kept."""
        plan = self._current
        if plan is None or (stage, signature) not in plan.key:
            return None
        return [c.saved_after_bytes for c in plan.costs if c.group == stage]

    def step_ends(self, actions: List[Action]) -> None:
        """The rank's step ended (its last action ran, or the next step
        begins): a measuring step chooses its plan, and a step that saw what
        a block holds after W for the first time chooses again."""
        self._open.clear()
        learnt, self._learnt = self._learnt, False
        if self._measuring:
            self._measuring = False
            key = tuple((s, self._latest[s]) for s in self.stages if s in self._latest)
            self._actions = actions
            self._current = self._choose(key)
        elif learnt and self._current is not None:
            self._current = self._choose(self._current.key)

    def _items(self, key: PlanKey) -> Tuple[List[Any], List[Any]]:
        """The blocks of ``key`` with their stage's lifetimes, and the
        planner's items: per (stage, micro-batch, block) where the rank's
        actions say when each runs, else the blocks."""
        actions = planner_actions(self._actions)
        costs = [cost for stage, signature in key
                 for cost in stage_costs(self._measured[(stage, signature)], stage,
                                         last=stage == self.last_stage and not self.last_stage_lets_go)]
        blocks = _C.rank_blocks(costs, actions, self.micro_batches)
        return blocks, _C.rank_items(blocks, actions, self.micro_batches)

    def least_budget(self) -> int:
        """The least memory_budget the current plan's blocks take: the
        least any plan of them holds (Note [A pipeline rank's memory plan])."""
        assert self._current is not None, "no plan yet: the first step measures"
        _, items = self._items(self._current.key)
        return _C.least_plan_bytes(items, _C.Release.AT_STEP_END)

    def _choose(self, key: PlanKey) -> RankPlan:
        costs, items = self._items(key)
        least = _C.least_plan_bytes(items, _C.Release.AT_STEP_END)
        if self.memory_budget < least:
            raise ValueError(f"prefire.pipelining: memory_budget={self.memory_budget} bytes is below the least any "
                             f"plan of this rank's blocks holds: {least} bytes for inputs {list(key)} ({len(costs)} "
                             f"blocks, as the measuring step found them)")
        plan = (_C.plan_for_budget(items, self.memory_budget, _C.Release.AT_STEP_END) if self.choices is None
                else self._given(key, costs, items))
        measuring = _C.plan_bytes(items, [True] * len(items), 0, _C.Release.AT_STEP_END)
        if (key, self.memory_budget) not in self._warned:  # once, not per re-plan
            self._warned.add((key, self.memory_budget))
            warn_measuring_step("prefire.pipelining", measuring, self.memory_budget, plan.peak_bytes)
        stages = {p.stage: p for p in _C.stage_plans(plan, costs, self.micro_batches)}
        chosen = RankPlan(key, costs, plan, stages)
        self._plans[key] = chosen
        self._use(chosen)
        _log.info("%s", describe(chosen, self.memory_budget))
        return chosen

    def _given(self, key: PlanKey, costs: List[Any], items: List[Any]) -> Any:
        """The given choices as a plan of ``items`` (rule 9): ValueError
        naming a choice not offered or a peak over the memory budget."""
        assert self.choices is not None
        per_item = len(items) != len(costs)  # items per (stage, micro-batch, block), else per block
        chosen: List[Any] = []
        where: List[str] = []  # per item, what it is
        for stage, _ in key:
            blocks = sum(1 for c in costs if c.group == stage)
            given = self.choices[stage]
            if any(len(row) != blocks for row in given):
                raise ValueError(f"prefire.pipelining: choices for stage {stage} name {[len(r) for r in given]} "
                                 f"blocks per micro-batch; its forward makes {blocks} checkpoint calls")
            if not per_item and any(list(row) != list(given[0]) for row in given):
                raise ValueError(f"prefire.pipelining: choices for stage {stage} differ between micro-batches, "
                                 "but this schedule keeps no order of actions: one choice per block")
            for mb, row in enumerate(given if per_item else given[:1]):
                chosen += row
                where += [f"stage {stage}" + (f", micro-batch {mb}" if per_item else "") + f", block {b}"
                          for b in range(blocks)]
        for item, choice, what in zip(items, chosen, where):
            offered = list(_C.offered_choices(item))
            if choice not in offered:
                raise ValueError(f"prefire.pipelining: choices chooses {choice.name} for {what}, which is offered "
                                 f"{[c.name for c in offered]} (SELECTIVE needs selective=, OFFLOAD offload_to=)")
        plan = _C.describe_plan(items, chosen, self.memory_budget, 0, _C.Release.AT_STEP_END)
        if plan.peak_bytes > self.memory_budget:
            raise ValueError(f"prefire.pipelining: the given choices hold {plan.peak_bytes} bytes at their peak, "
                             f"over memory_budget={self.memory_budget} (as the measuring step found the blocks)")
        return plan

    def _use(self, plan: RankPlan) -> None:
        self.budget.expect({s: p.pass_bytes for s, p in plan.stages.items()},
                           [(s, m) for s, p in plan.stages.items()
                            for m, blocks in enumerate(p.choices) if all(c == KEEP for c in blocks)])
        # the sessions' budget: what the blocks leave of the memory budget, at each action where it is known
        self.budget.set(plan.session_bytes, room=list(plan.plan.room_bytes) if plan.plan.moment_bytes else None)
        if self.offload_to is not None:  # what offloaded items may still hold while their copies are queued
            _, items = self._items(plan.key)
            hold_budget_with(self.offload_to, "prefire.pipelining", self.memory_budget, plan.plan.peak_bytes,
                             _C.tier_bytes(items, plan.plan.choices, _C.Release.AT_STEP_END))


GivenChoices = Dict[int, Sequence[Sequence[Any]]]  # per stage, per micro-batch, per block: a Choice or its name


def check_choices(choices: Any, stages: List[int], micro_batches: int) -> Dict[int, List[List[Any]]]:
    """``choices`` (``enable(..., choices=)``) as Choices, after checking
    its form: a dict from each of the rank's stages to one list of choices
    per micro-batch (``micro_batches`` of them), each a prefire.Choice or
    its name. ValueError naming what does not fit."""
    where = "prefire.pipelining: choices"
    if not isinstance(choices, dict) or set(choices) != set(stages):
        got = list(choices) if isinstance(choices, dict) else type(choices).__name__
        raise ValueError(f"{where} must be a dict from each of this rank's stages {sorted(stages)} to its choices "
                         f"per micro-batch and block, got {got}")
    names = _C.Choice.__members__
    out: Dict[int, List[List[Any]]] = {}
    for stage, rows in choices.items():
        if not isinstance(rows, (list, tuple)) or len(rows) != micro_batches:
            raise ValueError(f"{where}[{stage}] must list {micro_batches} micro-batches' choices, got {rows!r}")
        out[stage] = []
        for row in rows:
            if not isinstance(row, (list, tuple)) or \
                    not all(isinstance(c, _C.Choice) or (isinstance(c, str) and c in names) for c in row):
                raise ValueError(f"{where}[{stage}] lists {row!r}; each micro-batch's is a list of prefire.Choice "
                                 f"or names {list(names)}, one per block")
            out[stage].append([c if isinstance(c, _C.Choice) else names[c] for c in row])
    return out


def describe(plan: RankPlan, memory_budget: int) -> str:
    names = {CHECKPOINT: "", SELECTIVE: " selectively", OFFLOAD: " offloaded"}

    def blocks(choices: List[Any]) -> str:
        checkpointed = [i for i, c in enumerate(choices) if c != KEEP]
        return f"{checkpointed}" + "".join(f" ({[i for i, c in enumerate(choices) if c == choice]}{name})"
                                           for choice, name in names.items()
                                           if name and any(c == choice for c in choices))

    def stage(s: int, stage_plan: Any) -> str:
        by_choice: Dict[str, List[int]] = {}
        for m, choices in enumerate(stage_plan.choices):
            by_choice.setdefault(blocks(list(choices)), []).append(m)
        n = len(stage_plan.choices[0])
        if len(by_choice) == 1:
            return f"stage {s}: checkpoints {next(iter(by_choice))} of {n} blocks"
        return f"stage {s}: checkpoints " + ", ".join(f"{b} in micro-batches {ms}" for b, ms in by_choice.items()) + \
            f" of {n} blocks"

    stages = "; ".join(stage(s, p) for s, p in plan.stages.items())
    where = " where they hold the most" if plan.plan.moment_bytes else ""
    return (f"prefire.pipelining: memory budget {memory_budget} bytes: {stages}; the blocks hold at most "
            f"{plan.plan.blocks_bytes} bytes, with the passes {plan.plan.peak_bytes}, the sessions may hold "
            f"{plan.session_bytes}{where}; recomputes {plan.plan.recompute_seconds * 1e3:.3f} ms per micro-batch")
