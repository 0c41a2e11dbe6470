"""A pipeline rank's plan from a memory budget (used by
:mod:`prefire.pipelining`): ``enable(schedule, memory_budget=N)``.

Note [A pipeline rank's memory plan]
The budget covers what the rank's blocks hold for backward: the saved
tensors of the blocks that keep their activations, the inputs of the
checkpointed ones, and what the sessions hold recomputed. The blocks are a
stage forward's outermost prefire.checkpoint calls, in order, whatever makes
them (Note [Planned checkpoints] in _checkpoint.py); each runs inside a
SavedTensorMeter, so ``runtime_stats().peak_held_bytes`` is the census of
exactly that: what the step held, measured.

The first step of a signature (the shapes, dtypes and devices of a stage's
first block's inputs) measures: every block is checkpointed (the least a
plan holds, but for blocks that save less than their inputs), and the
sessions keep nothing for W (their budget is 0: W recomputes), so the step
holds every block's inputs and one pass's recomputation. Per block it reads
what keeping it would hold (``kept_bytes`` of its checkpoint: the storages
its forward saved), its inputs' storages with what the checkpoint holds
beyond them (a selective checkpoint's cache, Note [Selective checkpointing
inside prefire] in _checkpoint.py) and its forward's time, which
stands for one recomputation (synchronised on CUDA; the measuring step
only). When the rank's last action of the step has run (or the next step
begins, for a schedule without an order of actions), the C++ planner
chooses (``plan_for_budget``, Release::kAtStepEnd, Note [What a plan holds]
in src/plan/plan_bytes.cpp) for each block and micro-batch apart, where the
rank's actions say when each micro-batch runs: one item per (stage,
micro-batch, block), held from that micro-batch's F to its W (or full
backward), recomputed by its B and W, and past its W holding what the
block still holds then; the most over the moments after each action,
each pass counted where it runs. A micro-batch whose lifetime misses the
rank's peak (the first and last of a stage, often) may keep blocks that
the others recompute (docs/benchmarks.md, "A plan per micro-batch").
Without an order of actions the choice is per block, each counted once
per micro-batch of its stage at every moment. A block's meter says what
it holds after each W. A schedule may keep the last stage's graphs until the next
step begins (torch's keeps its outputs and losses: ``enable`` lets go of
their graphs after W, Note [The last stage lets go of its graph after W]
in _hook_points.py; another schedule may keep them otherwise); so until a
last-stage block was seen kept (or checkpointed), it is taken to hold the
largest share its stage's other blocks were seen to hold (blocks of a
stage are alike), or all of it when none was; other stages' blocks
nothing (their W lets go of the graph), and so the last stage's too once
``enable`` let go of a loss (``last_stage_lets_go``). A step that sees a
block's bytes after W for the first time plans again at its end; a block
that holds more than its share
says so in a warning (the rank may have gone over the budget that step)
before the plan that counts it; a stage's checkpointed blocks of one
micro-batch are recomputed together, since its B recomputes them into one
session (a pass: a stage's most is what the budget expects a session of
it to hold, ``RankBudget.expect``). What the plan leaves
of the budget is the rank's byte budget for sessions (Note [A rank's byte
budget] in _budget.py): it decides which B keeps its recomputation for W
and how far bubble prefires may go, action by action: the plan counts
each stage's pass where the rank runs it (its B, W or full backward:
Note [What a plan holds] in src/plan/plan_bytes.cpp), and leaves the
sessions what the blocks do not hold at each action (``Plan.room_bytes``,
from the planner, as is what each pass holds, ``Plan.pass_bytes``).
So the budget holds at every step, the measuring one included, for any
budget at or above what checkpointing everything holds; a budget below
that raises at the end of its measuring step, naming it (a plan that keeps
some blocks may hold less still, but the measuring step checkpoints them).

With ``selective=`` a block has a third choice, a selective checkpoint
(torch's SAC by a policy: Note [Selective checkpoints in a plan] in
src/plan/plan_bytes.cpp): the measuring forward of each block whose call has
no context_fn of its own runs under a probe that finds what that would
hold beyond the inputs and what share of the forward's time it would
recompute (Note [Measuring a selective checkpoint] in _selective.py),
without holding it, so the measuring step holds what it holds without
the choice. A block chosen so runs ``prefire.checkpoint`` with the
policy's context_fn, in its own meter like the others; what it holds
after W is learnt as for the other two choices.

With ``offload_to=`` (an OffloadTier) a block has a fourth choice per
micro-batch, offloaded (Note [Offloaded blocks in a plan] in
src/plan/plan_bytes.cpp): after each measuring forward the tier times one
copy each way of what an offload of the block moves (what keeping it
holds: its saved storages, the inputs it saves among them), and the plan counts half of it hidden: the copy into the
tier runs on the tier's worker during the rank's other work, while the
fetch runs when the micro-batch's B needs it (a bubble prefire of an
offloaded block is a prefetch in a wait, so with bubble=True more is hidden
than the plan counts). An offloaded block holds nothing on the device until
its fetch, which its pass holds as it would a recomputation. A block chosen
so runs ``prefire.checkpoint`` with ``offload_to``. With offloading a plan
may hold less than the measuring step (which checkpoints every block), so
a budget down to the least any plan holds is taken, with a warning that the
measuring step held more; without it such a budget raises as above.

A later step whose signature was measured runs that plan; one whose
signature is new measures again (a shape change re-plans; shapes that
alternate each keep their plan). A stage forward that makes another number
of checkpoint calls than its measurement raises: the plan is per call.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from .. import _C
from .._measuring import Measured, Signature, check_memory_budget, measure, signature, tensors
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
        if choice == SELECTIVE:
            if selective is None:
                raise RuntimeError(f"prefire.pipelining: stage {self.stage}'s checkpoint call {index} has a "
                                   f"context_fn of its own where its plan, measured without one, checkpoints it "
                                   f"selectively; the forwards of one input signature must make the same calls")
            return self._metered(choice, lambda: selective(self.planner.selective_context))
        if choice == OFFLOAD:
            if offloaded is None:
                raise RuntimeError(f"prefire.pipelining: stage {self.stage}'s checkpoint call {index} offloads to a "
                                   f"tier of its own where its plan, measured without one, offloads it; the "
                                   f"forwards of one input signature must make the same calls")
            return self._metered(choice, lambda: offloaded(self.planner.offload_to))
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
                 offload_to: Any = None) -> None:
        """``memory_budget``: checked by the caller; ``last_stage``: the
        pipeline's last stage, if on this rank; ``selective_policy``: a SAC
        policy function, a third choice per block (None: keep or checkpoint);
        ``offload_to``: an OffloadTier, a fourth (None: none)."""
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
        plan = _C.plan_for_budget(items, self.memory_budget, _C.Release.AT_STEP_END)
        measuring = _C.plan_bytes(items, [True] * len(items), 0, _C.Release.AT_STEP_END)
        if self.memory_budget < measuring and (key, self.memory_budget) not in self._warned:  # once, not per re-plan
            self._warned.add((key, self.memory_budget))
            warnings.warn(f"prefire.pipelining: the measuring step checkpointed every block and held up to "
                          f"{measuring} bytes, above memory_budget={self.memory_budget}; later steps hold at most "
                          f"{plan.peak_bytes}", UserWarning, stacklevel=3)
        stages = {p.stage: p for p in _C.stage_plans(plan, costs, self.micro_batches)}
        chosen = RankPlan(key, costs, plan, stages)
        self._plans[key] = chosen
        self._use(chosen)
        _log.info("%s", describe(chosen, self.memory_budget))
        return chosen

    def _use(self, plan: RankPlan) -> None:
        self.budget.expect({s: p.pass_bytes for s, p in plan.stages.items()},
                           [(s, m) for s, p in plan.stages.items()
                            for m, blocks in enumerate(p.choices) if all(c == KEEP for c in blocks)])
        # the sessions' budget: what the blocks leave of the memory budget, at each action where it is known
        self.budget.set(plan.session_bytes, room=list(plan.plan.room_bytes) if plan.plan.moment_bytes else None)


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
