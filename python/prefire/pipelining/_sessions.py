"""The sessions of one pipeline stage: the wrappers of its methods that
open a session per micro-batch at its forward, bind it to B and W, and clear
it after the last pass (used by :mod:`prefire.pipelining`).

Session ids are taken from a process-wide counter starting at 2**62, so they
do not meet ids a program chooses for its own sessions.

Note [What a session keeps for W]
torch's B keeps the stage's whole graph for W (``retain_graph=True``), so a
session would hold all B recomputed until W, though W reads only what the
weight gradients need (Note [A session keeps what the next pass reads] in
src/session/keep_only.cpp: about half of it on the default GPT block; none of
a compiled block whose weight gradients W takes from B). So each stage
learns, from its W's (``_C.pass_reads`` after W, the union over every W of a
forward that saves the same tensors; nothing of a checkpoint whose graph
went after B), what a W reads, and each later B's scope gets that mask
(``next_pass_reads``): B lets go of every other tensor at its unpack and
ends holding only what W reads (Note [A pass lets go of what the next pass
will not read]). A B that unpacks a tensor twice finds it gone and
recomputes it for itself (a trim miss, said once); the stage's later Bs
then keep all until they end and are trimmed after (``_C.keep_only``). The
first W of a stage (or of a forward that saves otherwise) finds its session
whole. What a trimmed session keeps is what the rank's budget counts for it
from then on (``RankBudget.kept``). A W that reads a dropped tensor after all
recomputes that checkpoint for itself: the same gradients, counted in
``PipelineStats.trim_misses``, said once in a warning, and kept from then on.
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

import torch

from .. import _C, _fsdp
from .._checkpoint import planned_calls
from .._schedule import collect, session
from ._budget import RankBudget
from ._hook_points import STAGE_METHODS, is_full_backward
from ._stats import PipelineStats
from ._weight_grads_in_b import WeightGradsInB
from .actions import Action

StageMicroBatch = Tuple[int, int]  # (stage index, micro-batch)

_session_ids = itertools.count(1 << 62)


@dataclass
class _MicroBatch:
    session: int
    handles: List[Any] = field(default_factory=list)
    prefired: int = 0   # handles prefired so far, from the last one back
    # None, or whether its prefires issue no collective now (an FSDP2 stage: all gathered)
    ready: Optional[Callable[[], bool]] = None
    w_recomputes: bool = False  # B let go of its recomputation for the budget: W recomputes into this session
    kept_for_w: bool = False    # B ran and kept its recomputation for W
    trimmed_in_b: bool = False  # B let go of what W does not read as it went (Note [What a session keeps for W])
    b_trim_misses: int = 0      # unpacks in B of what B had let go of already
    saved_counts: Optional[List[int]] = None  # after a B that W takes from: tensors each checkpoint saved


def _holds_fsdp(module) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def _donated_buffers(error: BaseException) -> bool:
    """Whether ``error`` or one of its causes is AOTAutograd refusing
    retain_graph for a compiled backward that donates its buffers."""
    while error is not None:
        if "donated buffer" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


class StageListener(Protocol):
    """What the sessions of a stage tell the rank's (``Pipelining``)."""

    def action_begins(self, action: Action) -> None:
        """A stage method is about to run ``action``."""

    def action_done(self, stage: int, micro_batch: int, last_pass: bool) -> None:
        """A backward action ran; ``last_pass``: the micro-batch's last pass on the stage."""

    def stage_cleared(self, stage: int, training: bool) -> None:
        """A stage's ``clear_runtime_states`` ran (every step begins so);
        ``training``: the step has a backward (not ``schedule.eval()``)."""

    def let_go_of_prefires(self, key: StageMicroBatch) -> None:
        """Let go of what bubble prefires recomputed for ``key``, a
        micro-batch of any of the rank's stages (Note [A rank's byte budget])."""


class _StageSessions:
    """The sessions of one stage: micro-batch -> session, and the stage
    methods that open, bind and clear them (Note [Where prefire hooks into a
    pipeline schedule])."""

    def __init__(self, stage, listener: StageListener, budget: RankBudget, stats: PipelineStats,
                 planner: Any = None, micro_batches: Optional[int] = None) -> None:
        """``planner``: the rank's ``RankPlanner`` under a memory budget;
        ``micro_batches``: how many a step has (None: unknown)."""
        self.listener = listener
        self.budget = budget
        self.stats = stats
        self.planner = planner
        self.micro_batches = micro_batches
        self.stage = stage
        self.pending: Dict[int, _MicroBatch] = {}
        self.forwards = 0            # forwards through the wrapper since the last step began
        self.checkpoints = 0         # prefire checkpoints its forwards made, ever
        self.fsdp = _holds_fsdp(stage.submod)
        self.grads_in_b = WeightGradsInB(stage)
        # What a W of this stage read of its session (_C.pass_reads): what
        # later sessions keep after B (Note [What a session keeps for W]).
        self.w_reads: Optional[List[List[bool]]] = None
        self.warned_miss = False
        self.b_lets_go = True  # B gets w_reads (until a B unpacks a tensor twice)
        if getattr(stage, "_prefire_sessions", None) is not None:
            raise RuntimeError(f"prefire.pipelining.enable: stage {stage.stage_index} already has prefire sessions "
                               "(enable was called twice for its schedule)")
        # The stage's own attributes under these names (a wrapper someone put
        # there before), given back by restore().
        self.shadowed = {name: vars(stage)[name] for name in STAGE_METHODS if name in vars(stage)}
        self.original = {name: getattr(stage, name) for name in STAGE_METHODS}
        self.wrappers = {"forward_one_chunk": self.forward_one_chunk, "backward_one_chunk": self.backward_one_chunk,
                         "backward_weight_one_chunk": self.backward_weight_one_chunk,
                         "clear_runtime_states": self.clear_runtime_states}
        for name, fn in self.wrappers.items():
            setattr(stage, name, fn)
        stage._prefire_sessions = self

    # The stage's methods, wrapped (Note [Where prefire hooks into a pipeline schedule]).

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        stage, forward = self.stage, self.original["forward_one_chunk"]
        self.forwards += 1
        self._check_steps_begin()
        self.listener.action_begins(("F", stage.stage_index, fwd_chunk_id))
        if not getattr(stage, "has_backward", True):  # schedule.eval(): no backward, nothing to recompute
            return forward(fwd_chunk_id, *args, **kwargs)
        if self.planner is None:
            with collect() as handles:
                out = forward(fwd_chunk_id, *args, **kwargs)
        else:  # Note [A pipeline rank's memory plan]
            planned = self.planner.forward(stage.stage_index, fwd_chunk_id)
            with collect() as handles, planned_calls(planned.run):
                out = forward(fwd_chunk_id, *args, **kwargs)
            self.planner.forward_done(planned, fwd_chunk_id, handles)
        self.checkpoints += len(handles)
        self.open(fwd_chunk_id, handles)
        self.grads_in_b.forward_done(fwd_chunk_id, out)
        return out

    def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        index, backward = self.stage.stage_index, self.original["backward_one_chunk"]
        full = is_full_backward(args, kwargs)
        self.listener.action_begins(("BW" if full else "B", index, bwd_chunk_id))
        if not full:
            self.gather_for_split_pass()
        # W takes what B computed of the weight gradients (Note [Weight gradients a custom Function computes in B])
        capture = self.grads_in_b.before_b(bwd_chunk_id, full)
        # B keeps what it recomputed for W, or only what W reads; a full backward is the last pass.
        w_reads = self.w_reads if not full and self.b_lets_go else None
        try:
            self.run_pass(bwd_chunk_id, not full, lambda: backward(bwd_chunk_id, *args, **kwargs), w_reads=w_reads)
        except RuntimeError as error:
            if not full and _donated_buffers(error):
                raise RuntimeError(
                    f"prefire.pipelining: stage {index}'s B ran a compiled backward that donates its saved buffers, "
                    "which B cannot run: it keeps the graph for W (retain_graph=True), as torch's own B does, so "
                    "torch's compiled blocks fail the same under a B/W split. Set "
                    "torch._functorch.config.donated_buffer = False before the compiled blocks first run") from error
            raise
        finally:
            if capture is not None:
                capture.remove_hooks()
        if not full:
            taken = self.grads_in_b.after_b(bwd_chunk_id, capture)
            self.stats.w_groups_taken_in_b += taken
            self.after_b(bwd_chunk_id, took_w=taken > 0)
        self.listener.action_done(index, bwd_chunk_id, last_pass=full)

    def backward_weight_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        index, weight = self.stage.stage_index, self.original["backward_weight_one_chunk"]
        self.listener.action_begins(("W", index, bwd_chunk_id))
        self.gather_for_split_pass()
        self.run_pass(bwd_chunk_id, False, lambda: weight(bwd_chunk_id, *args, **kwargs), weight=True)
        self.listener.action_done(index, bwd_chunk_id, last_pass=True)

    def gather_for_split_pass(self) -> None:
        """Note [Parameters torch's W gives no gradient]: torch's B and W
        find the parameters the graph holds only where FSDP has them
        gathered."""
        if self.fsdp:
            self.stats.gathered_for_split += _fsdp.gather_sharded(self.stage.submod)

    def clear_runtime_states(self):
        self.clear_all()
        self.grads_in_b.clear()
        self.listener.stage_cleared(self.stage.stage_index, training=getattr(self.stage, "has_backward", True))
        self.original["clear_runtime_states"]()

    def open(self, micro_batch: int, handles) -> None:
        if micro_batch in self.pending:  # a forward run again without its backward: the old graph is gone
            self.close(micro_batch, discard=True)
        if not handles:
            return
        self.pending[micro_batch] = self._new_session(handles)
        self.stats.sessions += 1

    def _new_session(self, handles) -> _MicroBatch:
        ready = (lambda: _fsdp.all_gathered(self.stage.submod)) if self.fsdp else None
        mb = _MicroBatch(next(_session_ids), list(handles), ready=ready)
        for handle in mb.handles:
            _C.attach(handle, mb.session)
        return mb

    def after_b(self, micro_batch: int, took_w: bool = False) -> None:
        """Lets go of what B recomputed when keeping it for W would break
        the rank's budget; W then recomputes into a session of its own
        (Note [A rank's byte budget]). ``took_w``: W takes weight gradients
        B computed (Note [Weight gradients a custom Function computes in B])."""
        mb = self.pending.get(micro_batch)
        if mb is None:
            return
        self.check_b_misses(mb)
        if took_w:
            mb.saved_counts = [len(r) for r in _C.pass_reads(mb.session)]
        if mb.trimmed_in_b or (self.w_reads is not None and _C.keep_only(mb.session, self.w_reads)):
            self.stats.trimmed_after_b += 1
            self.budget.kept(self.stage.stage_index, _C.session_stats(mb.session).current_bytes)
        keep, let_go = self.budget.after_b((self.stage.stage_index, micro_batch))
        for key in let_go:
            self.listener.let_go_of_prefires(key)
        if keep:
            mb.kept_for_w = True
            return
        self.close(micro_batch)
        w = self.pending[micro_batch] = self._new_session(mb.handles)
        w.w_recomputes = True
        w.prefired = len(w.handles)  # no bubble prefire for W: it recomputes lazily
        self.stats.released_after_b += 1

    def let_go_of_prefires(self, micro_batch: int) -> None:
        """Lets go of what bubble prefires recomputed for ``micro_batch``
        (before its B): its checkpoints join a fresh session, which B
        recomputes into and bubbles may prefire into again."""
        mb = self.pending[micro_batch]
        self.close(micro_batch, discard=True)  # on purpose: counted in prefires_let_go, not as wasted
        self.pending[micro_batch] = self._new_session(mb.handles)
        self.stats.prefires_let_go += 1

    def run_pass(self, micro_batch: int, retain: bool, run: Callable[[], Any], weight: bool = False,
                 w_reads: Optional[List[List[bool]]] = None) -> None:
        """Runs a pass in the micro-batch's session; ``w_reads`` (B): what W
        will read, the rest let go as B unpacks it."""
        mb = self.pending.get(micro_batch)
        if mb is None:  # nothing checkpointed in this micro-batch
            run()
            return
        try:
            with session(mb.session, retain_on_unpack=retain, next_pass_reads=w_reads) as scope:
                if retain:  # B
                    mb.trimmed_in_b = scope.lets_go
                run()
        except BaseException:
            self.close(micro_batch, discard=True)  # the error is what the caller hears of
            raise
        if weight:
            self.learn_w_reads(mb)
        if not retain:
            self.close(micro_batch)

    def check_b_misses(self, mb: _MicroBatch) -> None:
        """A B that unpacked a tensor it had let go of (read twice in one
        pass) recomputed it for itself: counted, said once, and later Bs of
        the stage keep everything until they end."""
        mb.b_trim_misses = _C.session_stats(mb.session).trim_misses
        if not mb.b_trim_misses:
            return
        self.stats.trim_misses += mb.b_trim_misses
        self.b_lets_go = False
        warnings.warn(
            f"prefire.pipelining: a B of stage {self.stage.stage_index} unpacked {mb.b_trim_misses} saved tensor(s) "
            "twice that W does not read, after letting go of them at their first unpack; they were recomputed for "
            "that B alone (the gradients are the same) and later Bs of the stage keep what they recompute until "
            "they end", UserWarning, stacklevel=4)

    def learn_w_reads(self, mb: _MicroBatch) -> None:
        """What this W read of its session, added to what earlier Ws read
        (Note [What a session keeps for W])."""
        reads = _C.pass_reads(mb.session)
        if not reads and mb.saved_counts:
            # W took the weight gradients B computed and every checkpoint's graph went after B (Note [Weight
            # gradients a custom Function computes in B]): W read none of them
            reads = [[False] * n for n in mb.saved_counts]
        misses = _C.session_stats(mb.session).trim_misses - mb.b_trim_misses
        if misses:
            self.stats.trim_misses += misses
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
        info = _C.session_stats(mb.session)
        self.stats.max_session_bytes = max(self.stats.max_session_bytes, info.peak_bytes)
        (_C.discard_session if discard else _C.clear_session)(mb.session)
        if info.budget_bytes is not None:  # a bubble prefire's cap belongs to the id: removed with the session
            _C.set_session_budget(mb.session, None)
        self.budget.closed(self.stage.stage_index, info.peak_bytes, b_let_go=mb.trimmed_in_b)

    def _check_steps_begin(self) -> None:
        """A forward wrapper that sees far more forwards than a step has, with
        no step beginning, means clear_runtime_states no longer runs (Note
        [Hook points fail loudly])."""
        n = self.micro_batches
        if n is not None and self.forwards > 4 * n:
            raise RuntimeError(
                f"prefire.pipelining: stage {self.stage.stage_index} ran {self.forwards} forwards without a step "
                f"beginning through clear_runtime_states (torch {torch.__version__}): prefire could not clear the "
                "sessions of failed steps nor count steps. This torch begins steps another way")

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
