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
its forward saved), its inputs' storages and its forward's time, which
stands for one recomputation (synchronised on CUDA; the measuring step
only). When the rank's last action of the step has run (or the next step
begins, for a schedule without an order of actions), the C++ planner
chooses (``plan_for_budget``, Release::kAtStepEnd, Note [What a plan holds]
in src/memory/plan.cpp): after each of the rank's actions, each block of the
rank counted once per micro-batch of its stage between their F and their W
(or full backward), every micro-batch from its F on for the last stage (the
schedule keeps its outputs, and with them their graphs, until the next step
begins), the most over those moments; a stage's checkpointed blocks are one
group, since its B recomputes them into one session. What the plan leaves
of the budget is the rank's byte budget for sessions (Note [A rank's byte
budget] in _budget.py): it decides which B keeps its recomputation for W
and how far bubble prefires may go. The plan counts one pass; so the
budget holds at every step, the measuring one included, for any budget at
or above what checkpointing everything holds; a budget below the least
plan raises at the end of its measuring step, naming that least.

A later step whose signature was measured runs that plan; one whose
signature is new measures again (a shape change re-plans; shapes that
alternate each keep their plan). A stage forward that makes another number
of checkpoint calls than its measurement raises: the plan is per call.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from . import _C
from ._budget import RankBudget
from ._meter import SavedTensorMeter
from ._order import Action
from ._plan import _input_bytes, _signature, _tensors

_log = logging.getLogger("prefire")

Signature = Tuple[Any, ...]
Key = Tuple[Tuple[int, Signature], ...]  # ((stage, signature), ...) for the rank's stages, in stage order


def alive(actions: List[Action], stage: int, last: bool = False) -> List[int]:
    """The micro-batches of ``stage`` whose forward the rank holds after
    each of its ``actions``: from their F to their W (or full backward); on
    the last stage (``last``) to the step's end, since the schedule keeps its
    outputs, and with them their graphs (with what B alone needed), until
    the next step begins."""
    held, out = 0, []
    for kind, s, _ in actions:
        if s == stage:
            if kind == "F":
                held += 1
            elif kind in ("W", "BW") and not last:
                held -= 1
        out.append(held)
    return out


@dataclass
class _Measured:
    """What the forwards of one stage and signature measured, per block:
    (kept bytes, input bytes, seconds) of each micro-batch."""

    blocks: List[List[Tuple[int, int, float]]] = field(default_factory=list)


@dataclass
class RankPlan:
    """The plan of one key: per stage, which of its blocks are checkpointed."""

    key: Key
    costs: List[_C.BlockCost]
    plan: _C.Plan
    checkpointed: Dict[int, List[bool]]
    blocks_bytes: int    # what the blocks hold, the plan's recomputation left out
    session_bytes: int   # the rest of the budget: the rank's sessions'


class _StageForward:
    """The planned calls of one stage forward."""

    def __init__(self, planner: "RankPlanner", stage: int) -> None:
        self.planner, self.stage = planner, stage
        self.choices: Optional[List[bool]] = None  # None: measuring
        self.signature: Optional[Signature] = None
        self.records: List[Tuple[int, float]] = []  # measuring: (input bytes, seconds) per call
        self.calls = 0

    def run(self, checkpointed: Callable[[], Any], plain: Callable[[], Any], args: Tuple[Any, ...],
            kwargs: Dict[str, Any]) -> Any:
        tensors = _tensors(args, kwargs)
        if self.calls == 0:
            self.signature = _signature(tensors)
            self.choices = self.planner._choices(self.stage, self.signature)
        index, self.calls = self.calls, self.calls + 1
        if self.choices is None:
            synchronize = any(t.is_cuda for t in tensors)
            if synchronize:
                torch.cuda.synchronize()
            begin = time.perf_counter()
            with SavedTensorMeter():
                out = checkpointed()
            if synchronize:
                torch.cuda.synchronize()
            self.records.append((_input_bytes(tensors), time.perf_counter() - begin))
            return out
        if index >= len(self.choices):
            raise RuntimeError(f"prefire.pipelining: stage {self.stage}'s forward made more checkpoint calls than the "
                               f"{len(self.choices)} its plan was measured with; memory_budget plans each call of a "
                               f"forward in order, and the forwards of one input signature must make the same calls")
        with SavedTensorMeter():
            return checkpointed() if self.choices[index] else plain()


class RankPlanner:
    """Chooses, per input signature, which of the rank's blocks keep their
    activations within ``memory_budget`` bytes (Note [A pipeline rank's
    memory plan])."""

    def __init__(self, memory_budget: int, budget: RankBudget, stages: List[int], micro_batches: int,
                 last_stage: Optional[int] = None) -> None:
        """``last_stage``: the pipeline's last stage, if on this rank."""
        check_memory_budget(memory_budget)
        self.last_stage = last_stage
        self.memory_budget = memory_budget
        self.budget = budget
        self.stages = sorted(stages)
        self.micro_batches = micro_batches
        self.measuring_steps = 0
        self._measured: Dict[Tuple[int, Signature], _Measured] = {}
        self._latest: Dict[int, Signature] = {}   # each stage's signature in its latest forward
        self._plans: Dict[Key, RankPlan] = {}
        self._current: Optional[RankPlan] = None
        self._measuring = False                    # this step measures
        self._actions: List[Action] = []           # the rank's actions in a step (empty: no order)

    @property
    def plan(self) -> Optional[RankPlan]:
        """The plan the latest planned step ran or the next will (None before one was chosen)."""
        return self._current

    def set_memory_budget(self, memory_budget: int) -> None:
        """A new budget, planned from what was measured, from the next forward on."""
        check_memory_budget(memory_budget)
        self.memory_budget = memory_budget
        self._plans.clear()
        if self._current is not None:
            self._current = self._choose(self._current.key)

    def forward(self, stage: int) -> _StageForward:
        return _StageForward(self, stage)

    def _choices(self, stage: int, signature: Signature) -> Optional[List[bool]]:
        self._latest[stage] = signature
        current = self._current
        if current is not None and (stage, signature) in current.key:
            return current.checkpointed[stage]
        for plan in self._plans.values():  # a signature planned before
            if (stage, signature) in plan.key:
                self._current = plan
                self._use(plan)
                return plan.checkpointed[stage]
        if not self._measuring:
            self._measuring = True
            self.measuring_steps += 1
            self.budget.set(0, warn=False)  # sessions keep nothing for W while measuring
        return None

    def forward_done(self, forward: _StageForward, handles: List[Any]) -> None:
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
        measured = self._measured.setdefault((forward.stage, forward.signature), _Measured())
        if not measured.blocks:
            measured.blocks = [[] for _ in handles]
        if len(measured.blocks) != len(handles):
            raise RuntimeError(f"prefire.pipelining: stage {forward.stage}'s forwards of one signature made "
                               f"{len(measured.blocks)} and {len(handles)} checkpoint calls")
        for block, handle, (inputs, seconds) in zip(measured.blocks, handles, forward.records):
            block.append((_C.kept_bytes(handle), inputs, seconds))

    def step_ends(self, actions: List[Action]) -> None:
        """The rank's step ended (its last action ran, or the next step
        begins): a measuring step chooses its plan."""
        if not self._measuring:
            return
        self._measuring = False
        key = tuple((s, self._latest[s]) for s in self.stages if s in self._latest)
        self._actions = actions
        self._current = self._choose(key)

    def _choose(self, key: Key) -> RankPlan:
        costs: List[_C.BlockCost] = []
        for stage, signature in key:
            # without an order of actions: every micro-batch at once
            moments = alive(self._actions, stage, stage == self.last_stage)
            flight = max(moments, default=self.micro_batches) or 1
            for runs in self._measured[(stage, signature)].blocks:
                costs.append(_C.BlockCost(max(r[0] for r in runs), max(r[1] for r in runs),
                                          statistics.median(r[2] for r in runs), flight, stage, moments))
        try:
            plan = _C.plan_for_budget(costs, self.memory_budget, _C.Release.AT_STEP_END)
        except ValueError:
            least = _C.least_plan_bytes(costs, _C.Release.AT_STEP_END)
            raise ValueError(f"prefire.pipelining: memory_budget={self.memory_budget} bytes is below the least any "
                             f"plan of this rank's blocks holds: {least} bytes for inputs {list(key)} (their inputs "
                             f"and saved tensors, {len(costs)} blocks, as the measuring step found them)") from None
        checkpointed: Dict[int, List[bool]] = {}
        at = 0
        for stage, signature in key:
            n = len(self._measured[(stage, signature)].blocks)
            checkpointed[stage] = list(plan.checkpointed[at:at + n])
            at += n
        one_pass = max(_passes(costs, plan.checkpointed).values(), default=0)
        blocks = _C.plan_bytes(costs, plan.checkpointed, 0, _C.Release.AT_STEP_END) - one_pass
        chosen = RankPlan(key, costs, plan, checkpointed, blocks, self.memory_budget - blocks)
        self._plans[key] = chosen
        self._use(chosen)
        _log.info("%s", describe(chosen, self.memory_budget))
        return chosen

    def _use(self, plan: RankPlan) -> None:
        self.budget.expect(_passes(plan.costs, plan.plan.checkpointed))
        self.budget.set(plan.session_bytes)


def _passes(costs: List[_C.BlockCost], checkpointed: List[bool]) -> Dict[int, int]:
    """Per stage, what one pass recomputes of a micro-batch: its checkpointed blocks' saved bytes."""
    passes: Dict[int, int] = {}
    for cost, c in zip(costs, checkpointed):
        passes[cost.group] = passes.get(cost.group, 0) + (cost.saved_bytes if c else 0)
    return passes


def describe(plan: RankPlan, memory_budget: int) -> str:
    stages = "; ".join(f"stage {s}: checkpoints {[i for i, c in enumerate(ck) if c]} of {len(ck)} blocks"
                       for s, ck in plan.checkpointed.items())
    return (f"prefire.pipelining: memory budget {memory_budget} bytes: {stages}; the blocks hold at most "
            f"{plan.blocks_bytes} bytes, one pass's recomputation and prefires {plan.plan.peak_bytes - plan.blocks_bytes}, the "
            f"sessions may hold {plan.session_bytes}; recomputes {plan.plan.recompute_seconds * 1e3:.3f} ms per "
            f"micro-batch")


def check_memory_budget(memory_budget: Any) -> None:
    if type(memory_budget) is not int or memory_budget < 0:
        raise ValueError(f"prefire.pipelining: memory_budget must be a number of bytes (an int >= 0), got "
                         f"{memory_budget!r}")
