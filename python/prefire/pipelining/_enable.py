"""``enable(schedule)`` and what it returns: the prefire sessions of one
schedule (the package's docstring says what each option does)."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from .. import _C
from .._measuring import check_memory_budget
from .._options import check_values
from .._selective import policy
from ._bubbles import BubbleFiller
from ._budget import RankBudget
from ._hook_points import (_check_hook_points, _check_torch_version, _receive_tables, _stages_of, let_go_of_graph,
                           on_receive_wait, rank_actions)
from ._plan import RankPlan, RankPlanner, describe
from ._sessions import StageMicroBatch, _MicroBatch, _StageSessions
from ._stats import PipelineStats
from .actions import Action
from .placement import check_placement


def _check_budget(budget_bytes: Optional[int]) -> None:
    if budget_bytes is not None and (type(budget_bytes) is not int or budget_bytes < 0):
        raise ValueError(f"prefire.pipelining: budget_bytes must be a non-negative int or None, got {budget_bytes!r}")


def _check_options(bubble: bool, budget_bytes: Optional[int], bubble_warmup_steps: int,
                   memory_budget: Optional[int], selective_policy: Any, placement: Any, offload_to: Any,
                   choices: Any) -> None:
    """ValueError for options of the wrong kind or that exclude each other."""
    _check_budget(budget_bytes)
    if choices is not None and memory_budget is None:
        raise ValueError("prefire.pipelining: choices= is a memory plan given in place of the planner's; pass "
                         "memory_budget=N with it (the budget it must hold)")
    if placement is not None and not bubble:
        raise ValueError("prefire.pipelining: placement= places bubble prefires; pass bubble=True with it")
    if selective_policy is not None and memory_budget is None:
        raise ValueError("prefire.pipelining: selective= is a choice of memory_budget's plan; pass "
                         "memory_budget=N with it")
    if offload_to is not None and memory_budget is None:
        raise ValueError("prefire.pipelining: offload_to= is a choice of memory_budget's plan; pass "
                         "memory_budget=N with it (or offload blocks by hand: prefire.checkpoint(..., "
                         "offload_to=tier) in the stages)")
    check_values("prefire.pipelining", offload_to=offload_to)
    if memory_budget is not None:
        check_memory_budget("prefire.pipelining", memory_budget)
        if budget_bytes is not None:
            raise ValueError("prefire.pipelining: memory_budget and budget_bytes exclude each other; "
                             "memory_budget sets the sessions' byte budget itself (what its plan leaves)")
    if type(bubble_warmup_steps) is not int or bubble_warmup_steps < 2:
        raise ValueError(f"prefire.pipelining: bubble_warmup_steps must be an int >= 2 (the first step only "
                         f"warms up), got {bubble_warmup_steps!r}")


class Pipelining:
    """The prefire sessions of one schedule (made by :func:`enable`). It
    hears what its stages' sessions do (``_sessions.StageListener``)."""

    def __init__(self, schedule, bubble: bool, budget_bytes: Optional[int], bubble_warmup_steps: int = 3,
                 memory_budget: Optional[int] = None, selective: Any = None, placement: Any = None,
                 offload_to: Any = None, choices: Any = None) -> None:
        selective_policy = policy(selective)
        _check_options(bubble, budget_bytes, bubble_warmup_steps, memory_budget, selective_policy, placement,
                       offload_to, choices)
        _check_torch_version()
        stages = _stages_of(schedule)
        _check_hook_points(stages, schedule)
        tables = _receive_tables(schedule) if bubble else []  # checks the schedule before anything is wrapped
        order = rank_actions(schedule) if bubble else None  # the bubble filler's (a placement needs bubble=True)
        if placement is not None:
            placement = check_placement(placement, order)
        self.schedule = schedule
        self.first_stage = stages[0]
        self.budget = RankBudget(budget_bytes, self._open_sessions, lambda: rank_actions(schedule))
        self.planner: Optional[RankPlanner] = None
        if memory_budget is not None:
            self.planner = RankPlanner(memory_budget, self.budget, [s.stage_index for s in stages],
                                       getattr(schedule, "_n_microbatches", 1),
                                       next((s.stage_index for s in stages if s.is_last), None), selective_policy,
                                       offload_to, choices)
        self._tables = tables
        self._training_steps = 0   # steps begun with a backward (Note [Hook points fail loudly])
        self._checked = False
        self._stats = PipelineStats()
        self.bubbles: Optional[BubbleFiller] = None
        self._remove_callbacks: Optional[Callable[[], None]] = None
        self._stages: Dict[int, _StageSessions] = {}
        try:
            for stage in stages:
                self._stages[stage.stage_index] = _StageSessions(
                    stage, self, self.budget, self._stats, self.planner, getattr(schedule, "_n_microbatches", None))
        except BaseException:
            self.disable()
            raise
        if bubble:
            self.bubbles = BubbleFiller(order, self._pending, self._stats, prefire=self._bubble_prefire,
                                        warmup_steps=bubble_warmup_steps, placement=placement)
            self._remove_callbacks = on_receive_wait(schedule, before=self.bubbles.before_wait,
                                                     after=self.bubbles.after_wait)

    # What the stages' sessions tell the rank (_sessions.StageListener).

    def action_begins(self, action: Action) -> None:
        """A stage method is about to run ``action`` (kind, stage, micro-batch)."""
        self.budget.ran(action)
        if self.bubbles is not None:
            self.bubbles.before_action(action)
            if action[0] in ("B", "BW"):
                self.bubbles.backward_started(action[1], action[2])

    def action_done(self, stage_index: int, micro_batch: int, last_pass: bool) -> None:
        """A backward action ran; ``last_pass``: the micro-batch's last pass on the stage."""
        stage = self._stages[stage_index].stage
        if last_pass and stage.is_last and let_go_of_graph(stage, self.schedule, micro_batch):
            self._stats.graphs_let_go += 1
            if self.planner is not None:
                self.planner.last_stage_lets_go = True
        if self.planner is None:
            return
        if last_pass:
            self.planner.last_pass_ran(stage_index, micro_batch)
        if self.budget.step_ended:
            self.planner.step_ends(self.budget.actions())

    def stage_cleared(self, stage_index: int, training: bool) -> None:
        """A stage's clear_runtime_states: the first stage's begins a step."""
        if self._stages[stage_index].stage is self.first_stage:
            self._step_begins(training)

    def let_go_of_prefires(self, key: StageMicroBatch) -> None:
        self._stages[key[0]].let_go_of_prefires(key[1])

    def _step_begins(self, training: bool) -> None:
        if self._training_steps == 1 and not self._checked:
            self._checked = True
            self._check_fired()
        if self.planner is not None:  # a schedule without an order of actions ends a measuring step here
            self.planner.step_ends(self.budget.actions())
        for sessions in self._stages.values():
            sessions.forwards = 0
        for table in self._tables:
            table.posts = table.pops = 0
        self.budget.step_begins()
        if training:
            self._training_steps += 1
        if self.bubbles is not None:
            self.bubbles.new_step(training)

    def _check_fired(self) -> None:
        """After the first training step: see Note [Hook points fail loudly]."""
        for sessions in self._stages.values():
            if sessions.forwards == 0:
                raise RuntimeError(
                    f"prefire.pipelining: a step ran without calling forward_one_chunk of stage "
                    f"{sessions.stage.stage_index} through prefire's wrapper (torch {torch.__version__}): prefire's "
                    "sessions are not in effect. This torch runs stages another way")
        for table in self._tables:
            if table.posts and not table.pops:
                raise RuntimeError(
                    f"prefire.pipelining: the schedule posted {table.posts} {table.kind} receives but never popped "
                    f"them from its table (torch {torch.__version__}): bubble prefire would never run. This torch "
                    "waits on its receives another way; enable without bubble=True")
        if not any(sessions.checkpoints for sessions in self._stages.values()):
            # Compiled blocks with torch's checkpoint inside (torchtitan's order): W takes their weight gradients
            # from B, and that is all enable() does for them; an option that acts on sessions would do nothing.
            taken = self._stats.w_groups_taken_in_b
            asked = [name for name, on in (("bubble=True", self.bubbles is not None),
                                           ("memory_budget", self.planner is not None),
                                           ("budget_bytes", self.budget.bytes is not None)) if on]
            if taken and not asked:
                return
            warnings.warn(
                "prefire.pipelining: the first step made no prefire checkpoint on this rank's stages, so the sessions "
                f"do nothing{' (nor ' + ', '.join(asked) + ')' if asked else ''}. Checkpoint the blocks with "
                "prefire.checkpoint or prefire.checkpoint_wrapper (torch.utils.checkpoint's are not prefire's, and "
                "inside torch.compile prefire's is torch's: compile inside it, prefire.checkpoint_wrapper("
                "torch.compile(block)))" + (f"; W took {taken} param groups' gradients from B's compiled backward"
                                            if taken else ""), UserWarning, stacklevel=2)

    def _pending(self, stage_index: int, micro_batch: int) -> Optional[_MicroBatch]:
        sessions = self._stages.get(stage_index)
        return sessions.pending.get(micro_batch) if sessions is not None else None

    def _open_sessions(self) -> Dict[StageMicroBatch, _MicroBatch]:
        return {(index, micro_batch): mb for index, sessions in self._stages.items()
                for micro_batch, mb in sessions.pending.items()}

    def _bubble_prefire(self, handle, session: int):
        key = next(k for k, mb in self._open_sessions().items() if mb.session == session)
        room = self.budget.room_for_prefires(key)
        if room is not None:
            _C.set_session_budget(session, room)
        return _C.prefire(handle, session)

    # The public surface.

    @property
    def budget_bytes(self) -> Optional[int]:
        """The sessions' byte budget (None: none; under a memory plan, what the plan leaves them)."""
        return self.budget.bytes

    def set_budget_bytes(self, budget_bytes: Optional[int]) -> None:
        """Sets the rank's byte budget (None: none), from the next prefire
        and the next B on (Note [A rank's byte budget])."""
        _check_budget(budget_bytes)
        if self.planner is not None:
            raise ValueError("prefire.pipelining: a schedule enabled with memory_budget sets its sessions' byte "
                             "budget from its plan; call set_memory_budget instead")
        self.budget.set(budget_bytes)

    @property
    def floor_bytes(self) -> int:
        """What one backward pass of a micro-batch holds while it recomputes,
        the most over the rank's stages seen so far: the least a byte budget
        can hold the sessions to (Note [A rank's byte budget])."""
        return self.budget.floor_bytes

    @property
    def memory_budget(self) -> Optional[int]:
        return self.planner.memory_budget if self.planner is not None else None

    def set_memory_budget(self, memory_budget: int) -> None:
        """A new memory budget for a schedule enabled with one, planned from
        what its measuring steps measured (Note [A pipeline rank's memory
        plan])."""
        if self.planner is None:
            raise ValueError("prefire.pipelining: set_memory_budget needs enable(schedule, memory_budget=...)")
        self.planner.set_memory_budget(memory_budget)

    def least_memory_budget(self) -> int:
        """The least memory budget the current plan's blocks take (the least
        any plan of them holds); ValueError before the first step measured."""
        if self.planner is None or self.planner.plan is None:
            raise ValueError("prefire.pipelining: least_memory_budget needs enable(schedule, memory_budget=...) "
                             "and a measuring step (the first training step)")
        return self.planner.least_budget()

    @property
    def plan(self) -> Optional[RankPlan]:
        """The memory plan of the latest step's signature (None before one was chosen, or without memory_budget)."""
        return self.planner.plan if self.planner is not None else None

    def describe_plan(self) -> str:
        plan = self.plan
        if plan is None:
            return "prefire.pipelining: no memory plan yet (the first training step measures)"
        return describe(plan, self.planner.memory_budget)

    def bubble_slack(self) -> Dict[Tuple[str, int, int], float]:
        """With ``bubble=True``: the seconds the bubble rules work to at each
        wait point, (kind, stage, micro-batch) (Note [Filling bubbles]);
        empty without bubble prefires or before the waits were measured."""
        return dict(self.bubbles.slack) if self.bubbles is not None else {}

    def wrap_placed_prefires(self, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        """Runs a placement's prefires (Note [Running a placement]) through
        ``wrap(run)``, a function that calls ``run`` with its arguments (a
        program that times stage methods tells them apart so). ValueError
        without ``placement=``."""
        if self.bubbles is None or self.bubbles.placement is None:
            raise ValueError("prefire.pipelining: wrap_placed_prefires needs enable(schedule, bubble=True, "
                             "placement=...)")
        self.bubbles.before_action = wrap(self.bubbles.before_action)

    def stats(self) -> PipelineStats:
        return PipelineStats(**vars(self._stats))

    def reset_stats(self) -> None:
        vars(self._stats).update(vars(PipelineStats()))

    def disable(self) -> None:
        """Clears the open sessions and gives the stages their own methods
        back. Idempotent."""
        if self._remove_callbacks is not None:
            self._remove_callbacks()
            self._remove_callbacks = None
        self.bubbles = None
        for sessions in self._stages.values():
            sessions.restore()
        self._stages.clear()


def enable(schedule, *, bubble: bool = False, budget_bytes: Optional[int] = None,
           bubble_warmup_steps: int = 3, memory_budget: Optional[int] = None, selective: Any = None,
           offload_to: Any = None,
           placement: Optional[Dict[Tuple[str, int, int], Any]] = None,
           choices: Optional[Dict[int, Any]] = None) -> Pipelining:
    """Gives each micro-batch's checkpoints a session shared by its backward
    passes, for every stage of ``schedule`` on this rank (see the module
    docstring). Call once, after building the schedule and before ``step``.

    Args:
        bubble: recompute the checkpoints of the micro-batches whose
            backward comes next while the rank waits on a receive (schedules
            built on ``_PipelineScheduleRuntime`` only; nothing in the first
            ``bubble_warmup_steps`` training steps, which measure the waits).
        budget_bytes: at most this many bytes of recomputed activations
            held by the rank's sessions at once: bubble prefires stop short
            of it, and a micro-batch whose recomputation B would keep for W
            over it lets go after B (W recomputes it). One pass's
            recomputation is the floor; a budget below it warns (Note [A
            rank's byte budget]).
        memory_budget: at most this many bytes of activations held by the
            rank's blocks at once (kept blocks' saved tensors, checkpointed
            blocks' inputs, recomputed tensors the sessions hold): the first
            training step of each input signature checkpoints every block
            and measures them, then the C++ planner chooses which blocks
            keep their activations, and what it leaves becomes the
            sessions' byte budget (Note [A pipeline rank's memory plan]).
            Raises ValueError at the end of the measuring step for a budget
            below the least any plan holds, naming it. Excludes
            ``budget_bytes``.
        placement: with ``bubble=True``, the rank's bubble prefires as
            recompute actions before named actions in place of the rules:
            ``{(kind, stage, micro_batch): [(stage, micro_batch, count),
            ...]}``, kind "F", "B", "W" or "BW"; the simulator's ``place``
            command writes one (Note [Running a placement] in
            ``_bubbles.py``). Raises ValueError for an entry outside the
            rank's order or a micro-batch prefired outside its forward and
            backward.
        selective: with ``memory_budget``, a third choice per block: a
            selective checkpoint (torch's SAC) that keeps the outputs of the
            ops a policy names and recomputes the rest. ``True``: matrix
            products and attention (``prefire.MATMUL_AND_ATTENTION``); a
            list of OpOverloads; or a SAC policy function (ctx, op, *args,
            **kwargs) -> CheckpointPolicy. The measuring step finds what
            each block's would hold and recompute (Note [Measuring a
            selective checkpoint] in ``_selective.py``); calls that pass a
            context_fn of their own keep it and get no third choice.
        offload_to: with ``memory_budget``, a :class:`prefire.OffloadTier`:
            a fourth choice per block and micro-batch, offloaded (what it
            saves copied to the tier in forward, fetched for
            its B; a bubble prefire of it is a prefetch). The measuring step
            times each block's copies on the tier (Note [Offloaded blocks in
            a plan] in src/plan/plan_bytes.cpp; Note [A pipeline rank's
            memory plan]).
        choices: with ``memory_budget``, the plan to run in place of the
            C++ planner's: ``{stage: [[choice per block] per micro-batch]}``
            for each of the rank's stages, a choice a ``prefire.Choice`` or
            its name (KEEP, CHECKPOINT, SELECTIVE with ``selective``,
            OFFLOAD with ``offload_to``), as the pipeline simulator's joint
            plan writes them (``prefire.pipelining.plans.rank_choices``).
            Raises ValueError for a form that does not fit the rank here,
            and at the end of the measuring step for a choice not offered or
            a plan over ``memory_budget`` (Note [A pipeline rank's memory
            plan], rule 9).
        bubble_warmup_steps: training steps (``schedule.eval()`` steps do
            not count) before bubble prefires begin: the first warms up, the
            others measure each wait's length (Note [Filling bubbles]). At
            least 2.

    Raises:
        RuntimeError: a torch outside the tested range, or a hook point this
            module relies on missing (see Note [Hook points fail loudly]);
            also from the second step on, if the first one shows a hook
            point did not fire.

    Returns:
        A :class:`Pipelining`: ``stats()``, ``set_budget_bytes()``,
        ``disable()``.
    """
    return Pipelining(schedule, bubble, budget_bytes, bubble_warmup_steps, memory_budget, selective, placement,
                      offload_to, choices)
