"""prefire for ``torch.distributed.pipelining``: one call on a schedule.

``prefire.pipelining.enable(schedule)`` makes every micro-batch's checkpoints
(blocks that use :func:`prefire.checkpoint`) join a session of their own:
opened when the stage runs the micro-batch's forward, bound to its
input-gradient pass B and its weight-gradient pass W, cleared after W (or
after the full backward, for schedules that do not split it). B and W then
share one recomputation where ``torch.utils.checkpoint`` recomputes in each.
The model does not change beyond using prefire's checkpoint.

With ``bubble=True``, while the schedule waits on a receive (activations or
gradients), the rank recomputes, last block first (the order B needs them):
at the receive of a micro-batch's gradient, that micro-batch's checkpoints,
which its backward, next, would recompute anyway; at any receive, those of
the micro-batches whose backward comes next on it, for as long as the wait
lasted when nothing was prefired. What is left is recomputed lazily by B.
See Note [Filling bubbles] in ``_bubbles.py``.

With ``memory_budget=N``, the rank's blocks hold at most N bytes of
activations: the first step measures them, the C++ planner chooses which
keep their activations and which are checkpointed, and what the plan leaves
is the sessions' byte budget. See Note [A pipeline rank's memory plan] in
``_pipeline_plan.py``.

With ``budget_bytes=N``, the rank's sessions hold at most N bytes of
recomputed activations at once: bubble prefires stop short of what the
actions up to their micro-batch's B will hold, and a micro-batch whose
recomputation B would keep for W over it lets go after B (W recomputes
it). See Note [A rank's byte budget] in ``_budget.py``.

Note [Where prefire hooks into a pipeline schedule]
The stages are the one place every schedule goes through: a schedule calls
``forward_one_chunk``, ``backward_one_chunk`` and
``backward_weight_one_chunk`` of its stages and nothing else computes. So
``enable`` wraps those three methods on each stage object (its own
attributes, shadowing the class's; ``disable`` removes them again), plus
``clear_runtime_states``, which every ``step`` calls first and where the
sessions a failed step left behind are cleared.

A bubble is where a schedule waits on a posted receive. The schedules built
on ``_PipelineScheduleRuntime`` (interleaved 1F1B, interleaved zero bubble,
ZBV, DualPipeV) post receives as actions of their own and keep the pending
ones in two tables keyed by (stage index, micro-batch), ``fwd_recv_ops`` and
``bwd_recv_ops``; a compute action pops its entry and waits on it right
away. :func:`on_receive_wait` replaces those tables with dicts whose ``pop``
first runs callbacks with the pending works (where the bubble prefire runs)
and hands the runtime a stand-in that times the wait (how the pipeline
program measures bubbles).
``Schedule1F1B`` and ``ScheduleGPipe`` post a receive and wait on it in the
same line of their own loop: there is no moment between the two to use, so
``bubble=True`` is refused for them (sessions work with every schedule).
Both hooks use private attributes of torch's pipelining (``_stages``,
``_stage``, the two tables and their ``pop``, ``backward_one_chunk``'s
argument order, ``pipeline_order_with_comms``); torch has no public API for
any of them. So nothing here may switch itself off quietly (see Note
[Hook points fail loudly]).

Note [Hook points fail loudly]
A torch that moved one of these points would leave training running without
prefire, or with bubble prefire off, and say nothing. So:
  * ``enable`` refuses a torch outside the tested range (2.11 to 2.14:
    2.14.1 runs the suite here, 2.11 is the GPU machine's, where
    scripts/gpu-check.sh runs it), naming it and how to try anyway
    (PREFIRE_PIPELINING_UNTESTED_TORCH=1), and checks that every hook point
    exists with the shape this module relies on;
  * after the first training step, it checks that they fired: every stage's
    forward went through the wrapper, and with ``bubble=True`` every receive
    the schedule posted in the tables was popped there (a torch that waits
    on them some other way would never reach the bubble prefire), and raises
    RuntimeError naming the point otherwise; a forward wrapper that sees
    many more forwards than a step has without a step starting
    (``clear_runtime_states``) raises too;
  * it warns once when that first step made no prefire checkpoint on the
    rank (blocks that use torch's checkpoint, or none).

Session ids are taken from a process-wide counter starting at 2**62, so they
do not meet ids a program chooses for its own sessions.

Note [The last stage lets go of its graph after W]
The last stage keeps each micro-batch's output until the step ends, to
merge them for the caller (``output_chunks``), and the schedule its loss
(``_internal_losses``, for ``step(losses=...)``); each holds its graph.
torch detaches the outputs after B for that reason, but in place, which a
view cannot be (a language model's head, a Linear over (batch, seq, dim),
returns one), so after B (``retain_graph=True``) and W, everything the last
stage's forward saved outside a checkpoint stayed until the next step:
measured, half of a kept block's saved bytes on the default GPT, what B
alone read. So after a micro-batch's last pass on the last stage (W, or
the full backward) ``enable`` puts detached copies of its output and loss
in their places: the same values for the caller, without a graph nobody
can run backward through again. A kept block of the last stage then holds
its activations from its F to its W, as on the other stages. ``enable``
checks that both lists exist (Note [Hook points fail loudly]).

Note [What a session keeps for W]
torch's B keeps the stage's whole graph for W (``retain_graph=True``), so a
session would hold all B recomputed until W, though W reads only what the
weight gradients need (Note [A session keeps what the next pass reads] in
src/session/keep_only.cpp: about half of it on the default GPT block). So each
stage learns, from its W's (``_C.pass_reads`` after W, the union over every
W of a forward that saves the same tensors), what a W reads, and after each
later B its session keeps only that (``_C.keep_only``). The first W of a
stage (or of a forward that saves otherwise) finds its session whole. What
a trimmed session keeps is what the rank's budget counts for it from then
on (``RankBudget.kept``). A W that reads a dropped tensor after all
recomputes that checkpoint for itself: the same gradients, counted in
``PipelineStats.trim_misses``, said once in a warning, and kept from then on.
"""

from __future__ import annotations

import inspect
import itertools
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from . import _C, _fsdp
from ._bubbles import BubbleFiller
from ._budget import RankBudget
from ._checkpoint import planned_calls
from ._order import rank_actions
from ._measuring import check_memory_budget
from ._pipeline_plan import RankPlan, RankPlanner, describe
from ._selective import policy
from ._schedule import collect, session

__all__ = ["PipelineStats", "Pipelining", "enable", "on_receive_wait"]

_session_ids = itertools.count(1 << 62)

#: ``before(kind, stage_index, micro_batch, works)``: kind is "forward"
#: (activations) or "backward" (gradients), works the pending dist.Work objects
BeforeWait = Callable[[str, int, int, Sequence[Any]], None]
#: ``after(kind, stage_index, micro_batch, begin, end)``: the wait's host
#: times on time.monotonic()'s clock
AfterWait = Callable[[str, int, int, float, float], None]


class _TimedWait:
    """Stands for the works of one receive in the list the runtime waits on:
    waits on all of them, then reports the wait. (A Gloo receive's ``wait``
    may not be called twice: the second waits for another message.)"""

    def __init__(self, table: "_ReceiveTable", key, works) -> None:
        self.table, self.key, self.works = table, key, works

    def wait(self, *args, **kwargs) -> bool:
        begin = time.monotonic()
        for work in self.works:
            work.wait(*args, **kwargs)
        end = time.monotonic()
        for after in list(self.table.after):
            after(self.table.kind, *self.key, begin, end)
        return True


class _ReceiveTable(dict):
    """A schedule's table of posted receives whose ``pop`` (the runtime pops
    an entry right before waiting on it) first runs the ``before`` callbacks,
    and hands out a :class:`_TimedWait` when there are ``after`` callbacks.
    Counts posts and pops (Note [Hook points fail loudly])."""

    def __init__(self, kind: str, entries: dict) -> None:
        super().__init__(entries)
        self.kind = kind
        self.before: List[BeforeWait] = []
        self.after: List[AfterWait] = []
        self.posts = 0
        self.pops = 0

    def __setitem__(self, key, value) -> None:
        self.posts += 1
        super().__setitem__(key, value)

    def pop(self, key, *default):
        self.pops += 1
        works = super().pop(key, *default)
        for before in list(self.before):
            before(self.kind, *key, works)
        return [_TimedWait(self, key, works)] if self.after else works


def _receive_tables(schedule) -> List[_ReceiveTable]:
    tables = []
    for kind, name in (("forward", "fwd_recv_ops"), ("backward", "bwd_recv_ops")):
        table = getattr(schedule, name, None)
        if not isinstance(table, dict):
            raise ValueError(
                f"{type(schedule).__name__} waits on a receive where it posts it (no table of pending "
                "receives): receive-wait callbacks and bubble prefire need a schedule built on "
                "_PipelineScheduleRuntime (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, "
                "ScheduleZBVZeroBubble, ScheduleDualPipeV)")
        if not isinstance(table, _ReceiveTable):
            table = _ReceiveTable(kind, table)
            setattr(schedule, name, table)
        tables.append(table)
    return tables


def on_receive_wait(schedule, before: Optional[BeforeWait] = None,
                    after: Optional[AfterWait] = None) -> Callable[[], None]:
    """Runs ``before(kind, stage_index, micro_batch, works)`` each time
    ``schedule`` is about to wait on a posted receive (``kind`` "forward":
    activations, "backward": gradients; ``works`` the pending ``dist.Work``
    objects; do not wait on them) and ``after(kind, stage_index, micro_batch,
    begin, end)`` once the wait is over. Callbacks run in the order they were
    added. Returns a function that removes them. Raises ``ValueError`` for
    schedules that wait where they post (``Schedule1F1B``, ``ScheduleGPipe``)."""
    tables = _receive_tables(schedule)
    for table in tables:
        if before is not None:
            table.before.append(before)
        if after is not None:
            table.after.append(after)

    def remove() -> None:
        for table in tables:
            if before in table.before:
                table.before.remove(before)
            if after in table.after:
                table.after.remove(after)

    return remove


def is_full_backward(args: tuple, kwargs: dict) -> bool:
    """``backward_one_chunk(bwd_chunk_id, loss=None, full_backward=True, ...)``'s
    ``full_backward``, from the arguments after ``bwd_chunk_id``."""
    return kwargs.get("full_backward", args[1] if len(args) > 1 else True)


@dataclass
class PipelineStats:
    """What :func:`enable`'s sessions did since it was called (or since
    :meth:`Pipelining.reset_stats`)."""

    sessions: int = 0             # micro-batch sessions opened (one per stage and micro-batch)
    bubble_prefires: int = 0      # checkpoints recomputed while waiting on a receive
    bubble_refused: int = 0       # bubble prefires the budget refused (left to B)
    bubble_seconds: float = 0.0   # host time spent on bubble prefires
    max_session_bytes: int = 0    # the most bytes one micro-batch's session held (its peak)
    released_after_b: int = 0     # micro-batches whose recomputation B let go for the budget (W recomputed it)
    trimmed_after_b: int = 0      # micro-batches whose session kept, after B, only what an earlier W read
    trim_misses: int = 0          # unpacks in W of a tensor the trim dropped (recomputed for that W alone)
    graphs_let_go: int = 0        # last-stage micro-batches whose output and loss lost their graph after W
    prefires_let_go: int = 0      # bubble-prefired micro-batches let go so that a B could keep its recomputation


@dataclass
class _MicroBatch:
    session: int
    handles: List[Any] = field(default_factory=list)
    prefired: int = 0   # handles prefired so far, from the last one back
    # None, or whether its prefires issue no collective now (an FSDP2 stage: all gathered)
    ready: Optional[Callable[[], bool]] = None
    w_recomputes: bool = False  # B let go of its recomputation for the budget: W recomputes into this session
    kept_for_w: bool = False    # B ran and kept its recomputation for W


def _holds_fsdp(module) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


class _StageSessions:
    """The sessions of one stage: micro-batch -> session, and the stage
    methods that open, bind and clear them (Note [Where prefire hooks into a
    pipeline schedule])."""

    _METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk", "clear_runtime_states")

    def __init__(self, owner: "Pipelining", stage) -> None:
        self.owner = owner
        self.stage = stage
        self.pending: Dict[int, _MicroBatch] = {}
        self.forwards = 0            # forwards through the wrapper since the last step began
        self.checkpoints = 0         # prefire checkpoints its forwards made, ever
        self.fsdp = _holds_fsdp(stage.submod)
        # What a W of this stage read of its session (_C.pass_reads): what
        # later sessions keep after B (Note [What a session keeps for W]).
        self.w_reads: Optional[List[List[bool]]] = None
        self.warned_miss = False
        if getattr(stage, "_prefire_sessions", None) is not None:
            raise RuntimeError(f"prefire.pipelining.enable: stage {stage.stage_index} already has prefire sessions "
                               "(enable was called twice for its schedule)")
        # The stage's own attributes under these names (a wrapper someone put
        # there before), given back by restore().
        self.shadowed = {name: vars(stage)[name] for name in self._METHODS if name in vars(stage)}
        original = {name: getattr(stage, name) for name in self._METHODS}

        def forward_one_chunk(fwd_chunk_id, *args, **kwargs):
            self.forwards += 1
            owner._check_steps_start(self)
            owner.budget.ran(("F", stage.stage_index, fwd_chunk_id))
            if not getattr(stage, "has_backward", True):  # schedule.eval(): no backward, nothing to recompute
                return original["forward_one_chunk"](fwd_chunk_id, *args, **kwargs)
            planner = owner.planner
            if planner is None:
                with collect() as handles:
                    out = original["forward_one_chunk"](fwd_chunk_id, *args, **kwargs)
            else:  # Note [A pipeline rank's memory plan]
                planned = planner.forward(stage.stage_index, fwd_chunk_id)
                with collect() as handles, planned_calls(planned.run):
                    out = original["forward_one_chunk"](fwd_chunk_id, *args, **kwargs)
                planner.forward_done(planned, fwd_chunk_id, handles)
            self.checkpoints += len(handles)
            self.open(fwd_chunk_id, handles)
            return out

        def backward_one_chunk(bwd_chunk_id, *args, **kwargs):
            full = is_full_backward(args, kwargs)
            owner.budget.ran(("BW" if full else "B", stage.stage_index, bwd_chunk_id))
            if owner.bubbles is not None:
                owner.bubbles.backward_started(stage.stage_index, bwd_chunk_id)
            # B keeps what it recomputed for W; a full backward is the last pass.
            self.run_pass(bwd_chunk_id, not full, lambda: original["backward_one_chunk"](bwd_chunk_id, *args, **kwargs))
            if not full:
                self.after_b(bwd_chunk_id)
            owner._action_done(stage.stage_index, bwd_chunk_id, released=full)

        def backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs):
            owner.budget.ran(("W", stage.stage_index, bwd_chunk_id))
            self.run_pass(bwd_chunk_id, False,
                          lambda: original["backward_weight_one_chunk"](bwd_chunk_id, *args, **kwargs), weight=True)
            owner._action_done(stage.stage_index, bwd_chunk_id, released=True)

        def clear_runtime_states():
            self.clear_all()
            if stage is owner.first_stage:  # once per step
                owner._step_begins(training=getattr(stage, "has_backward", True))
            original["clear_runtime_states"]()

        self.wrappers = {"forward_one_chunk": forward_one_chunk, "backward_one_chunk": backward_one_chunk,
                         "backward_weight_one_chunk": backward_weight_one_chunk,
                         "clear_runtime_states": clear_runtime_states}
        for name, fn in self.wrappers.items():
            setattr(stage, name, fn)
        stage._prefire_sessions = self

    def open(self, micro_batch: int, handles) -> None:
        if micro_batch in self.pending:  # a forward run again without its backward: the old graph is gone
            self.close(micro_batch, discard=True)
        if not handles:
            return
        self.pending[micro_batch] = self._new_session(handles)
        self.owner._stats.sessions += 1

    def _new_session(self, handles) -> _MicroBatch:
        ready = (lambda: _fsdp.all_gathered(self.stage.submod)) if self.fsdp else None
        mb = _MicroBatch(next(_session_ids), list(handles), ready=ready)
        for handle in mb.handles:
            _C.attach(handle, mb.session)
        return mb

    def after_b(self, micro_batch: int) -> None:
        """Lets go of what B recomputed when keeping it for W would break
        the rank's budget; W then recomputes into a session of its own
        (Note [A rank's byte budget])."""
        mb = self.pending.get(micro_batch)
        if mb is None:
            return
        if self.w_reads is not None and _C.keep_only(mb.session, self.w_reads):
            self.owner._stats.trimmed_after_b += 1
            self.owner.budget.kept(self.stage.stage_index, _C.session_stats(mb.session).current_bytes)
        keep, let_go = self.owner.budget.after_b((self.stage.stage_index, micro_batch))
        for stage_index, other in let_go:
            self.owner._stages[stage_index].let_go_of_prefires(other)
        if keep:
            mb.kept_for_w = True
            return
        self.close(micro_batch)
        w = self.pending[micro_batch] = self._new_session(mb.handles)
        w.w_recomputes = True
        w.prefired = len(w.handles)  # no bubble prefire for W: it recomputes lazily
        self.owner._stats.released_after_b += 1

    def let_go_of_prefires(self, micro_batch: int) -> None:
        """Lets go of what bubble prefires recomputed for ``micro_batch``
        (before its B): its checkpoints join a fresh session, which B
        recomputes into and bubbles may prefire into again."""
        mb = self.pending[micro_batch]
        self.close(micro_batch, discard=True)  # on purpose: counted in prefires_let_go, not as wasted
        self.pending[micro_batch] = self._new_session(mb.handles)
        self.owner._stats.prefires_let_go += 1

    def run_pass(self, micro_batch: int, retain: bool, run: Callable[[], Any], weight: bool = False) -> None:
        mb = self.pending.get(micro_batch)
        if mb is None:  # nothing checkpointed in this micro-batch
            run()
            return
        try:
            with session(mb.session, retain_on_unpack=retain):
                run()
        except BaseException:
            self.close(micro_batch, discard=True)  # the error is what the caller hears of
            raise
        if weight:
            self.learn_w_reads(mb)
        if not retain:
            self.close(micro_batch)

    def learn_w_reads(self, mb: _MicroBatch) -> None:
        """What this W read of its session, added to what earlier Ws read
        (Note [What a session keeps for W])."""
        reads = _C.pass_reads(mb.session)
        misses = _C.session_stats(mb.session).trim_misses
        if misses:
            self.owner._stats.trim_misses += misses
            if not self.warned_miss:
                self.warned_miss = True
                warnings.warn(
                    f"prefire.pipelining: a W of stage {self.stage.stage_index} read {misses} saved tensor(s) that an "
                    "earlier W of the same forward did not; they were recomputed for this W alone (the gradients are "
                    "the same) and later sessions keep them", UserWarning, stacklevel=3)
        known = self.w_reads
        if known is not None and [len(r) for r in known] == [len(r) for r in reads]:
            self.w_reads = [[a or b for a, b in zip(old, new)] for old, new in zip(known, reads)]
        else:  # the first W, or a forward that saves otherwise (new shapes): learnt afresh
            self.w_reads = reads

    def close(self, micro_batch: int, discard: bool = False) -> None:
        """Ends the micro-batch's session; ``discard``: what it prefired may
        go unused on purpose (``discard_session``), else an unused prefire
        warns (Note [A session shares what is registered to it])."""
        mb = self.pending.pop(micro_batch)
        stats = self.owner._stats
        info = _C.session_stats(mb.session)
        stats.max_session_bytes = max(stats.max_session_bytes, info.peak_bytes)
        (_C.discard_session if discard else _C.clear_session)(mb.session)
        if info.budget_bytes is not None:  # a bubble prefire's cap belongs to the id: removed with the session
            _C.set_session_budget(mb.session, None)
        self.owner.budget.closed(self.stage.stage_index, info.peak_bytes)

    def clear_all(self) -> None:
        for micro_batch in list(self.pending):  # sessions whose passes will not come (a new step, eval, an error)
            self.close(micro_batch, discard=True)

    def restore(self) -> None:
        self.clear_all()
        own = vars(self.stage)
        for name, fn in self.wrappers.items():
            if own.get(name) is not fn:
                raise RuntimeError(f"prefire.pipelining: stage {self.stage.stage_index}'s {name} was wrapped again "
                                   "after enable(); remove that wrapper before disable()")
        for name in self.wrappers:
            if name in self.shadowed:
                own[name] = self.shadowed[name]
            else:
                del own[name]
        del own["_prefire_sessions"]


#: torch releases the hook points were tested with (Note [Hook points fail loudly]).
TESTED_TORCH = ((2, 11), (2, 14))


def _check_torch_version(version: Optional[str] = None) -> None:
    version = version or torch.__version__
    release = tuple(int(p) for p in version.split("+")[0].split(".")[:2])
    if TESTED_TORCH[0] <= release <= TESTED_TORCH[1] or os.environ.get("PREFIRE_PIPELINING_UNTESTED_TORCH") == "1":
        return
    low, high = (".".join(map(str, v)) for v in TESTED_TORCH)
    raise RuntimeError(
        f"prefire.pipelining hooks into private parts of torch.distributed.pipelining, tested with torch {low} to "
        f"{high}; this is torch {version}. Set PREFIRE_PIPELINING_UNTESTED_TORCH=1 to try it anyway (enable() "
        "then checks every hook point, and the first step checks that each fired)")


def _stages_of(schedule) -> List[Any]:
    stages = getattr(schedule, "_stages", None)
    if stages is None:
        stage = getattr(schedule, "_stage", None)
        stages = [stage] if stage is not None else None
    if not stages or not all(hasattr(s, "backward_weight_one_chunk") for s in stages):
        raise TypeError(f"prefire.pipelining.enable: expected a torch.distributed.pipelining schedule, "
                        f"got {type(schedule).__name__}")
    return list(stages)


def _check_hook_points(stages: List[Any], schedule: Any = None) -> None:
    """The stage methods enable() wraps, with the arguments it reads, and
    where the last stage, when on this rank, keeps its outputs and losses."""
    if schedule is not None and any(s.is_last for s in stages) and \
            not isinstance(getattr(schedule, "_internal_losses", None), list):
        raise RuntimeError(f"prefire.pipelining: {type(schedule).__name__} keeps no _internal_losses list in torch "
                           f"{torch.__version__}; prefire lets go of each micro-batch's loss graph after its W there "
                           "(Note [The last stage lets go of its graph after W])")
    for stage in stages:
        for name in _StageSessions._METHODS:
            if not callable(getattr(stage, name, None)):
                raise RuntimeError(f"prefire.pipelining: {type(stage).__name__} has no method {name} in torch "
                                   f"{torch.__version__}; prefire cannot hook into this schedule's stages")
        if stage.is_last and not isinstance(getattr(stage, "output_chunks", None), list):
            raise RuntimeError(f"prefire.pipelining: {type(stage).__name__} keeps no output_chunks list in torch "
                               f"{torch.__version__}; prefire lets go of each micro-batch's output graph after its W "
                               "there (Note [The last stage lets go of its graph after W])")
        # the class's method: an instance may hold a wrapper (prefire's, or another library's)
        params = list(inspect.signature(type(stage).backward_one_chunk).parameters)[1:]
        if params[:3] != ["bwd_chunk_id", "loss", "full_backward"]:
            raise RuntimeError(
                f"prefire.pipelining: {type(stage).__name__}.backward_one_chunk takes ({', '.join(params)}) in torch "
                f"{torch.__version__}; prefire reads full_backward as its third argument")


def _check_budget(budget_bytes: Optional[int]) -> None:
    if budget_bytes is not None and (type(budget_bytes) is not int or budget_bytes < 0):
        raise ValueError(f"prefire.pipelining: budget_bytes must be a non-negative int or None, got {budget_bytes!r}")


class Pipelining:
    """The prefire sessions of one schedule (made by :func:`enable`)."""

    def __init__(self, schedule, bubble: bool, budget_bytes: Optional[int], bubble_warmup_steps: int = 3,
                 memory_budget: Optional[int] = None, selective: Any = None) -> None:
        _check_budget(budget_bytes)
        selective_policy = policy(selective)
        if selective_policy is not None and memory_budget is None:
            raise ValueError("prefire.pipelining: selective= is a choice of memory_budget's plan; pass "
                             "memory_budget=N with it")
        if memory_budget is not None:
            check_memory_budget("prefire.pipelining", memory_budget)
            if budget_bytes is not None:
                raise ValueError("prefire.pipelining: memory_budget and budget_bytes exclude each other; "
                                 "memory_budget sets the sessions' byte budget itself (what its plan leaves)")
        if type(bubble_warmup_steps) is not int or bubble_warmup_steps < 2:
            raise ValueError(f"prefire.pipelining: bubble_warmup_steps must be an int >= 2 (the first step only "
                             f"warms up), got {bubble_warmup_steps!r}")
        _check_torch_version()
        stages = _stages_of(schedule)
        _check_hook_points(stages, schedule)
        tables = _receive_tables(schedule) if bubble else []  # checks the schedule before anything is wrapped
        self.schedule = schedule
        self.first_stage = stages[0]
        self.budget = RankBudget(budget_bytes, self._open_sessions, lambda: rank_actions(schedule))
        self.planner: Optional[RankPlanner] = None
        if memory_budget is not None:
            self.planner = RankPlanner(memory_budget, self.budget, [s.stage_index for s in stages],
                                       getattr(schedule, "_n_microbatches", 1),
                                       next((s.stage_index for s in stages if s.is_last), None), selective_policy)
        self._tables = tables
        self._training_steps = 0   # steps begun with a backward (Note [Hook points fail loudly])
        self._checked = False
        self._stats = PipelineStats()
        self.bubbles: Optional[BubbleFiller] = None
        self._remove_callbacks: Optional[Callable[[], None]] = None
        self._stages: Dict[int, _StageSessions] = {}
        try:
            for stage in stages:
                self._stages[stage.stage_index] = _StageSessions(self, stage)
        except BaseException:
            self.disable()
            raise
        if bubble:
            self.bubbles = BubbleFiller(schedule, self._pending, self._stats, prefire=self._bubble_prefire,
                                        warmup_steps=bubble_warmup_steps)
            self._remove_callbacks = on_receive_wait(schedule, before=self.bubbles.before_wait,
                                                     after=self.bubbles.after_wait)

    def _step_begins(self, training: bool) -> None:
        """A step begins (the first stage's clear_runtime_states)."""
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

    def _action_done(self, stage_index: int, micro_batch: int, released: bool) -> None:
        """A backward action ran; ``released``: the micro-batch's last pass on the stage."""
        stage = self._stages[stage_index].stage
        if released and stage.is_last:
            self._let_go_of_graph(stage, micro_batch)
        if self.planner is None:
            return
        if released:
            self.planner.released(stage_index, micro_batch)
        if self.budget.step_ended:
            self.planner.step_ends(self.budget.actions())

    def _let_go_of_graph(self, stage: Any, micro_batch: int) -> None:
        """After the last pass of ``micro_batch`` on the last stage: its
        output and loss as values, without their graph (Note [The last
        stage lets go of its graph after W])."""
        let_go = False
        outputs = stage.output_chunks
        if 0 <= micro_batch < len(outputs) and any(isinstance(t, torch.Tensor) and t.grad_fn is not None
                                                     for t in tree_flatten(outputs[micro_batch])[0]):
            outputs[micro_batch] = tree_map_only(torch.Tensor, torch.Tensor.detach, outputs[micro_batch])
            let_go = True
        losses = getattr(self.schedule, "_internal_losses", None)
        if isinstance(losses, list) and 0 <= micro_batch < len(losses):
            loss = losses[micro_batch]
            if isinstance(loss, torch.Tensor) and loss.grad_fn is not None:
                losses[micro_batch] = loss.detach()
                let_go = True
        if let_go:
            self._stats.graphs_let_go += 1
            if self.planner is not None:
                self.planner.last_stage_lets_go = True

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
            warnings.warn(
                "prefire.pipelining: the first step made no prefire checkpoint on this rank's stages, so the sessions "
                "do nothing. Checkpoint the blocks with prefire.checkpoint or prefire.checkpoint_wrapper "
                "(torch.utils.checkpoint's are not prefire's)", UserWarning, stacklevel=2)

    def _check_steps_start(self, sessions: "_StageSessions") -> None:
        """A forward wrapper that sees far more forwards than a step has, with
        no step beginning, means clear_runtime_states no longer runs."""
        n = getattr(self.schedule, "_n_microbatches", None)
        if n is not None and sessions.forwards > 4 * n:
            raise RuntimeError(
                f"prefire.pipelining: stage {sessions.stage.stage_index} ran {sessions.forwards} forwards without a "
                f"step beginning through clear_runtime_states (torch {torch.__version__}): prefire could not clear "
                "the sessions of failed steps nor count steps. This torch begins steps another way")

    def _pending(self, stage_index: int, micro_batch: int) -> Optional[_MicroBatch]:
        sessions = self._stages.get(stage_index)
        return sessions.pending.get(micro_batch) if sessions is not None else None

    def _open_sessions(self) -> Dict[Tuple[int, int], _MicroBatch]:
        return {(index, micro_batch): mb for index, sessions in self._stages.items()
                for micro_batch, mb in sessions.pending.items()}

    def _bubble_prefire(self, handle, session: int):
        key = next(k for k, mb in self._open_sessions().items() if mb.session == session)
        room = self.budget.room_for_prefires(key)
        if room is not None:
            _C.set_session_budget(session, room)
        return _C.prefire(handle, session)

    @property
    def budget_bytes(self) -> Optional[int]:
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
    def memory_budget(self) -> Optional[int]:
        return self.planner.memory_budget if self.planner is not None else None

    def set_memory_budget(self, memory_budget: int) -> None:
        """A new memory budget for a schedule enabled with one, planned from
        what its measuring steps measured (Note [A pipeline rank's memory
        plan])."""
        if self.planner is None:
            raise ValueError("prefire.pipelining: set_memory_budget needs enable(schedule, memory_budget=...)")
        self.planner.set_memory_budget(memory_budget)

    @property
    def plan(self) -> Optional[RankPlan]:
        """The memory plan of the latest step's signature (None before one was chosen, or without memory_budget)."""
        return self.planner.plan if self.planner is not None else None

    def describe_plan(self) -> str:
        plan = self.plan
        if plan is None:
            return "prefire.pipelining: no memory plan yet (the first training step measures)"
        return describe(plan, self.planner.memory_budget)

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
           bubble_warmup_steps: int = 3, memory_budget: Optional[int] = None, selective: Any = None) -> Pipelining:
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
        selective: with ``memory_budget``, a third choice per block: a
            selective checkpoint (torch's SAC) that keeps the outputs of the
            ops a policy names and recomputes the rest. ``True``: matrix
            products and attention (``prefire.MATMUL_AND_ATTENTION``); a
            list of OpOverloads; or a SAC policy function (ctx, op, *args,
            **kwargs) -> CheckpointPolicy. The measuring step finds what
            each block's would hold and recompute (Note [Measuring a
            selective checkpoint] in ``_selective.py``); calls that pass a
            context_fn of their own keep it and get no third choice.
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
    return Pipelining(schedule, bubble, budget_bytes, bubble_warmup_steps, memory_budget, selective)
