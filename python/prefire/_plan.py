"""A memory budget in, a plan out, for a model that runs a list of blocks:
``prefire.plan_checkpoints(model.layers, memory_budget=...)``.

Note [Planning a plain model's blocks]
The planner wraps every block in a :class:`PlannedBlock` (a
:class:`prefire.CheckpointWrapper`, torch's ``CheckpointWrapper``, so
``state_dict`` keys stay those of the bare block, a compiled block's
included, and FSDP and distributed checkpointing recognise it). Block 0's forward
begins a step; its inputs' shapes, dtypes and devices are the step's
signature. The first step of a signature measures: every block is
checkpointed (the least memory a plan can hold, up to blocks that save less
than their inputs), and for each the runtime's census says what keeping it
would hold (``kept_bytes``: the storages its forward saved, as a
SavedTensorMeter counts them unchecked: parameters not counted), its inputs'
storages, with what the checkpoint holds beyond them (a selective
checkpoint's cache, Note [Selective checkpointing inside prefire] in
_checkpoint.py), say what the checkpoint holds instead, and its forward
time stands for one recomputation (on CUDA synchronised: the measuring step
only; both measured as the pipeline planner measures, _measuring.py).
After the last block's forward the C++ planner (``plan_for_budget``
with ``Release.IN_BACKWARD``: one backward pass, a block's backward finds
only the blocks below it held; Note [Choosing a plan] in
src/plan/plan_search.cpp) chooses which blocks keep their activations, the plan
is logged, and every later step of that signature runs it; a new signature
measures again, so a shape change re-plans and alternating shapes each keep
their plan.

With ``selective=`` a block has a third choice, a selective checkpoint
(Note [Selective checkpoints in a plan] in src/plan/plan_bytes.cpp), whose
bytes and recomputation time the measuring forward finds under a probe
(Note [Measuring a selective checkpoint] in _selective.py); a block chosen
so runs prefire.checkpoint with the policy's context_fn.

With ``offload_to=`` (a :class:`prefire.OffloadTier`) a block has a fourth
choice, offloaded (Note [Offloaded blocks in a plan] in
src/plan/plan_bytes.cpp): the measuring forward also measures, on the
tier, one copy each way of what keeping the block would hold (the storages
its forward saves, the inputs it saves among them); it holds nothing
on the device meanwhile (offload_bytes 0), and half the copies' time counts
as hidden: the copy into the tier runs on the tier's worker beside the
next blocks' forward; the fetch is counted exposed, though the plan's
reload schedule (Note [A reload schedule for a plain backward] in
src/plan/reload_schedule.cpp) starts it at the backward of a block above,
as far ahead as the budget's headroom allows, through a hook on that
block's output gradient. A block chosen so runs prefire.checkpoint with
``offload_to``; the tier's backpressure is the plan's headroom (Note
[Backpressure on copies into a tier] in src/offload/tier_store.cpp).

A budget below what the least plan holds raises at the end of the measuring
forward, naming that minimum. What the measuring step itself held is
checked against the budget too (a warning when above it: only a budget
between the least plan and checkpointing everything can see one).

The budget covers the blocks' activations: what the runtime counts as saved
by the blocks (kept blocks' saved tensors, checkpointed blocks' inputs, one
recomputation at a time). The plan's prefire_ahead is for schedules that
prefire (the pipeline integration); a plain model's backward recomputes
each checkpointed block as it reaches it, which holds no more than planned.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_wrapper

from . import _C, _schedule
from ._checkpoint import CheckpointWrapper, checkpoint, compiled
from ._measuring import check_memory_budget, hold_budget_with, measure, signature, tensors, warn_measuring_step
from ._options import check_options, check_values
from ._schedule import CheckpointHandle, fetch_ahead
from ._selective import Policy, context_fn, mode_costs, policy

BlockCost = _C.BlockCost
Choice = _C.Choice
Plan = _C.Plan
Release = _C.Release
_ONE_PASS = Release.IN_BACKWARD  # a plain model's step: Note [Planning a plain model's blocks]

_log = logging.getLogger("prefire")


def plan_for_budget(blocks: Sequence[BlockCost], memory_budget: int, release: Release = Release.AT_STEP_END) -> Plan:
    """The plan that recomputes least within ``memory_budget`` bytes (the C++
    planner; ``release``: when a block lets go, Note [What a plan holds] in
    src/plan/plan_bytes.cpp: ``IN_BACKWARD`` for a plain model's one backward pass,
    ``AT_STEP_END``, the default as in C++, for a pipeline's). Raises ValueError below
    :func:`least_plan_bytes`, naming it."""
    return _C.plan_for_budget(list(blocks), int(memory_budget), release)


def least_plan_bytes(blocks: Sequence[BlockCost], release: Release = Release.AT_STEP_END) -> int:
    """The least any plan of ``blocks`` holds."""
    return _C.least_plan_bytes(list(blocks), release)


def plan_bytes(blocks: Sequence[BlockCost], checkpointed: Sequence[bool], prefire_ahead: int = 0,
               release: Release = Release.AT_STEP_END, selective: Sequence[bool] = ()) -> int:
    """What the plan ``checkpointed`` holds at most; ``selective``: per
    block, whether its checkpoint is the selective one (empty: none is)."""
    return _C.plan_bytes(list(blocks), list(checkpointed), prefire_ahead, release, list(selective))


def choice_seconds(block: BlockCost, choice: Choice) -> float:
    """Seconds ``choice`` adds to a step over keeping ``block`` (its
    recomputation; offloaded, its copies' time the compute does not hide)."""
    return _C.choice_seconds(block, choice)


def offered_choices(block: BlockCost) -> List[Choice]:
    """The choices ``block`` offers: keep and checkpoint, and selective and
    offload where its costs have them."""
    return _C.offered_choices(block)


def with_offload(block: BlockCost, *, moved_bytes: int, copy_seconds: float) -> BlockCost:
    """``block`` with offloading offered: its copies move ``moved_bytes``
    each way in ``copy_seconds`` (both copies), as a plan counts an
    offloaded block (Note [Offloaded blocks in a plan] in
    src/plan/plan_bytes.cpp)."""
    return _C.with_offload(block, moved_bytes=moved_bytes, copy_seconds=copy_seconds)


def copy_seconds(moved_bytes: int, to_tier: float, back: float) -> float:
    """Seconds to copy ``moved_bytes`` to a tier at ``to_tier`` bytes per
    second and back at ``back``."""
    return _C.copy_seconds(moved_bytes, to_tier, back)


def describe_plan(blocks: Sequence[BlockCost], choices: Sequence[Choice], memory_budget: int, prefire_ahead: int = 0,
                  release: Release = Release.AT_STEP_END) -> Plan:
    """The plan ``choices`` (one :class:`Choice` per block) as
    :func:`plan_for_budget` counts its own: peak, moments, each block's pass
    and the room ``memory_budget`` leaves beside the blocks."""
    return _C.describe_plan(list(blocks), list(choices), int(memory_budget), prefire_ahead, release)


def reload_schedule(blocks: Sequence[BlockCost], choices: Sequence[Choice], memory_budget: int) -> List[List[int]]:
    """For a plan of one backward pass (``Release.IN_BACKWARD``): per block
    j, the offloaded blocks whose fetch begins (:func:`prefire.fetch_ahead`)
    when j's backward begins, nearest first, as far ahead as
    ``memory_budget`` allows (Note [A reload schedule for a plain backward]
    in src/plan/reload_schedule.cpp)."""
    return _C.reload_schedule(list(blocks), list(choices), int(memory_budget))


class _Measuring:
    """The census of one measuring step."""

    def __init__(self, blocks: int) -> None:
        self.costs: List[Optional[BlockCost]] = [None] * blocks
        self.synchronize = False


class MemoryPlanner:
    """Chooses, per input signature, which of a list of blocks keep their
    activations within ``memory_budget`` bytes (Note [Planning a plain
    model's blocks]). Made by :func:`plan_checkpoints`."""

    def __init__(self, blocks: int, memory_budget: int, checkpoint_kwargs: Dict[str, Any],
                 selective: Policy = None, offload_to: Optional[_C.OffloadTier] = None) -> None:
        check_memory_budget("prefire.plan_checkpoints", memory_budget)
        self.memory_budget = memory_budget
        self.blocks = blocks
        self._checkpoint_kwargs = checkpoint_kwargs
        self._selective = policy(selective)  # a third choice per block (Note [Selective checkpoints in a plan])
        if self._selective is not None and checkpoint_kwargs.get("context_fn") is not None:
            raise ValueError("prefire.plan_checkpoints: selective= and a context_fn exclude each other (the "
                             "selective checkpoint is a context_fn); pass one of them")
        self._selective_kwargs = (dict(checkpoint_kwargs, context_fn=context_fn(self._selective))
                                  if self._selective is not None else None)
        self._mode_costs = mode_costs(self._selective) if self._selective is not None else None
        if "offload_to" in checkpoint_kwargs or "offload_inputs_only" in checkpoint_kwargs:
            raise ValueError("prefire.plan_checkpoints: offloading is a choice of the plan; pass offload_to= to "
                             "plan_checkpoints itself")
        check_options("prefire.plan_checkpoints", checkpoint_kwargs)  # Note [Options that cannot be ignored]
        check_values("prefire.plan_checkpoints", offload_to=offload_to)
        self._offload_to = offload_to  # a fourth choice per block (Note [Offloaded blocks in a plan])
        self._offload_kwargs = dict(checkpoint_kwargs, offload_to=offload_to)
        self._plans: Dict[Tuple[Any, ...], Plan] = {}
        self._costs: Dict[Tuple[Any, ...], List[BlockCost]] = {}
        self._reloads: Dict[Tuple[Any, ...], Optional[List[List[int]]]] = {}  # per signature, with offloaded blocks
        self._reload: Optional[List[List[int]]] = None  # this step's
        self._step_handles: List[Optional[CheckpointHandle]] = []  # this step's offloaded blocks'
        self._step: Optional[Plan] = None  # the plan this step runs; None while measuring
        self._measuring: Optional[_Measuring] = None
        self._signature: Optional[Tuple[Any, ...]] = None
        self.measuring_steps = 0

    @property
    def plan(self) -> Optional[Plan]:
        """The plan of the latest step's signature (None before it was measured)."""
        return self._plans.get(self._signature) if self._signature is not None else None

    @property
    def costs(self) -> Optional[List[BlockCost]]:
        """What the measuring step of the latest signature measured per block."""
        return self._costs.get(self._signature) if self._signature is not None else None

    def describe(self) -> str:
        plan, costs = self.plan, self.costs
        if plan is None or costs is None:
            return "prefire: no plan yet (the first step with gradients measures)"
        chosen = [i for i, c in enumerate(plan.checkpointed) if c]
        selective = [i for i, s in enumerate(plan.selective) if s]
        offloaded = [i for i, o in enumerate(plan.offloaded) if o]
        kept = sum(c.saved_bytes for c, ck in zip(costs, plan.checkpointed) if not ck)
        return (f"prefire: memory budget {self.memory_budget} bytes for inputs {self._signature}: "
                f"checkpointing {len(chosen)} of {self.blocks} blocks {chosen}"
                + (f" ({selective} selectively)" if selective else "")
                + (f" ({offloaded} offloaded)" if offloaded else "") + f", keeping {kept} bytes of activations; "
                f"holds at most {plan.peak_bytes} bytes, recomputes {plan.recompute_seconds * 1e3:.3f} ms per step "
                f"(least any plan holds: {least_plan_bytes(costs, _ONE_PASS)} bytes)")

    def run(self, index: int, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if _under_compile():
            raise RuntimeError("prefire.plan_checkpoints: plans eager steps and cannot run inside torch.compile; "
                               "compile inside the blocks instead (blocks[i] = torch.compile(blocks[i]) before "
                               "planning)")
        if not torch.is_grad_enabled():
            return module(*args, **kwargs)  # nothing is saved: nothing to plan
        inputs = tensors(args, kwargs)
        if index == 0:
            self._begin_step(inputs)
        if self._measuring is None:
            if self._step is None:
                raise RuntimeError(f"prefire.plan_checkpoints: block {index} ran before block 0 of its step; the "
                                   f"planned blocks must run in order, block 0 first")
            if self._step.offloaded[index]:
                return self._offloaded(index, module, args, kwargs)
            if self._step.selective[index]:
                return self._fetching_ahead(index, checkpoint(module, *args, **self._selective_kwargs, **kwargs))
            if self._step.checkpointed[index]:
                return self._fetching_ahead(index, checkpoint(module, *args, **self._checkpoint_kwargs, **kwargs))
            return self._fetching_ahead(index, module(*args, **kwargs))
        return self._measure(index, module, inputs, args, kwargs)

    def _offloaded(self, index: int, module: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        if _schedule._collecting():  # the caller schedules what it collects: its reload too
            return checkpoint(module, *args, **self._offload_kwargs, **kwargs)
        with _schedule.collect() as handles:
            out = checkpoint(module, *args, **self._offload_kwargs, **kwargs)
        self._step_handles[index] = handles[0] if handles else None
        return self._fetching_ahead(index, out)

    def _fetching_ahead(self, index: int, out: Any) -> Any:
        """The reload schedule's fetches that begin with this block's backward:
        a hook on its output's gradient (Note [A reload schedule for a plain
        backward] in src/plan/reload_schedule.cpp)."""
        below = self._reload[index] if self._reload else ()
        grad = next((t for t in tensors((out,), {}) if t.requires_grad), None) if below else None
        if grad is not None:
            handles = self._step_handles  # this step's: a later step has its own

            def fetch(_: torch.Tensor) -> None:
                for i in below:
                    if handles[i] is not None:
                        fetch_ahead(handles[i])
            grad.register_hook(fetch)
        return out

    def _begin_step(self, inputs: List[torch.Tensor]) -> None:
        self._signature = signature(inputs)
        self._step = self._plans.get(self._signature)
        self._measuring = None
        self._step_handles = [None] * self.blocks
        self._reload = self._reloads.get(self._signature)
        if self._step is not None:
            self._hold_budget(self._step)
        if self._step is None:
            self._measuring = _Measuring(self.blocks)
            self._measuring.synchronize = any(t.is_cuda for t in inputs)
            self.measuring_steps += 1

    def _measure(self, index: int, module: torch.nn.Module, inputs: List[torch.Tensor], args: Tuple[Any, ...],
                 kwargs: Dict[str, Any]) -> Any:
        measuring = self._measuring
        assert measuring is not None
        if _schedule._collecting():
            raise RuntimeError("prefire.plan_checkpoints: a planned block measured inside prefire.collect(); plan "
                               "outside it (a pipeline plans with enable(schedule, memory_budget=...))")
        with _schedule.collect() as handles:
            out, measured = measure(lambda: checkpoint(module, *args, **self._checkpoint_kwargs, **kwargs), inputs,
                                    None if compiled(module) else self._selective, self._mode_costs,
                                    measuring.synchronize)
        if len(handles) != 1:
            raise RuntimeError(f"prefire.plan_checkpoints: block {index} made {len(handles)} outermost checkpoints "
                               f"where its checkpoint should be the one (is it inside another checkpoint?)")
        saved_bytes = _C.kept_bytes(handles[0])
        cost = BlockCost(saved_bytes=saved_bytes, input_bytes=measured.input_bytes,
                         recompute_seconds=measured.seconds, selective_bytes=measured.selective_bytes,
                         selective_seconds=measured.selective_seconds)
        if self._offload_to is not None:  # an offload moves what keeping it holds, each way
            cost = _C.with_offload(cost, moved_bytes=saved_bytes,
                                   copy_seconds=self._offload_to.measure_copy_seconds(saved_bytes))
        measuring.costs[index] = cost
        if index == self.blocks - 1:
            self._choose(measuring)
        return out

    def _choose(self, measuring: _Measuring) -> None:
        self._measuring = None
        missing = [i for i, c in enumerate(measuring.costs) if c is None]
        if missing:
            raise RuntimeError(f"prefire.plan_checkpoints: blocks {missing} did not run between block 0 and the "
                               f"last block; the planned blocks must each run once per step, in order")
        costs = [c for c in measuring.costs if c is not None]
        try:
            plan = plan_for_budget(costs, self.memory_budget, _ONE_PASS)
        except ValueError as error:
            raise ValueError(f"prefire.plan_checkpoints: memory_budget={self.memory_budget} bytes is below the "
                             f"least any plan of these blocks holds, {least_plan_bytes(costs, _ONE_PASS)} bytes, for inputs "
                             f"{self._signature} ({error})") from None
        warn_measuring_step("prefire.plan_checkpoints", plan_bytes(costs, [True] * len(costs), 0, _ONE_PASS),
                            self.memory_budget, plan.peak_bytes)
        self._plans[self._signature] = plan
        self._costs[self._signature] = costs
        self._step = plan
        self._hold_budget(plan)
        self._reloads[self._signature] = self._reload = (
            reload_schedule(costs, plan.choices, self.memory_budget) if any(plan.offloaded) else None)
        _log.info("%s", self.describe())

    def _hold_budget(self, plan: Plan) -> None:
        """The tier's backpressure for this plan: every offloaded block is held at the end of forward."""
        if self._offload_to is not None and any(plan.offloaded):
            costs = self._costs[self._signature]
            hold_budget_with(self._offload_to, "prefire.plan_checkpoints", self.memory_budget, plan.peak_bytes,
                             _C.tier_bytes(costs, plan.choices, _ONE_PASS))


def _under_compile() -> bool:
    """Whether this runs inside torch.compile: traced, or run eagerly by
    dynamo inside a compiled region (a frame it fell back on, as it does for
    the planner's own raise below, runs with dynamo's frame callback still
    set, and is_compiling() is False there)."""
    if torch.compiler.is_compiling():
        return True
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback
    except ImportError:  # another torch: is_compiling() alone
        return False
    return get_eval_frame_callback() not in (None, False)


class PlannedBlock(CheckpointWrapper):
    """One block of a :class:`MemoryPlanner`: checkpointed or not, as the
    plan of the step's signature says. ``state_dict`` keys are those of the
    bare block (as :class:`prefire.CheckpointWrapper`'s, a compiled block's
    included)."""

    def __init__(self, module: torch.nn.Module, planner: MemoryPlanner, index: int) -> None:
        self._wrap(module, functools.partial(planner.run, index), {})
        self.index = index


def plan_checkpoints(blocks: torch.nn.Module, memory_budget: int, selective: Policy = None,
                     offload_to: Optional[_C.OffloadTier] = None, **checkpoint_kwargs: Any) -> MemoryPlanner:
    """Plans activation checkpointing for the blocks of ``blocks`` (an
    ``nn.ModuleList`` or ``nn.Sequential`` the model runs in order, such as a
    transformer's layers) within ``memory_budget`` bytes of activations per
    step: each block is replaced, in place, by a :class:`PlannedBlock`; the
    first step of each input shape measures the blocks (all checkpointed)
    and chooses which keep their activations so that the step recomputes as
    little as the budget allows. ``checkpoint_kwargs`` go to every
    :func:`prefire.checkpoint` call. ``selective``: a third choice per
    block, a selective checkpoint (``True``: matmul and attention outputs
    kept; a list of OpOverloads; a SAC policy function; not with a
    ``context_fn`` in ``checkpoint_kwargs``), as for
    ``prefire.pipelining.enable``. ``offload_to``: a
    :class:`prefire.OffloadTier`, offloading as a fourth choice per block.
    Returns the planner: ``plan``,
    ``costs`` and ``describe()`` say what it chose.

    Raises ValueError for a negative budget, an empty list or blocks that
    are already checkpoint wrappers; the measuring step raises ValueError
    for a budget below the least any plan holds, naming it."""
    if not isinstance(blocks, (torch.nn.ModuleList, torch.nn.Sequential)):
        raise ValueError(f"prefire.plan_checkpoints: blocks must be an nn.ModuleList or nn.Sequential, got "
                         f"{type(blocks).__name__}")
    if len(blocks) == 0:
        raise ValueError("prefire.plan_checkpoints: no blocks to plan")
    for i, block in enumerate(blocks):
        if isinstance(block, torch_wrapper.ActivationWrapper):
            raise ValueError(f"prefire.plan_checkpoints: block {i} is already wrapped ({type(block).__name__}); "
                             f"the planner decides which blocks to checkpoint: pass the bare blocks")
    planner = MemoryPlanner(len(blocks), memory_budget, checkpoint_kwargs, selective, offload_to)
    for i in range(len(blocks)):
        blocks[i] = PlannedBlock(blocks[i], planner, i)
    return planner
