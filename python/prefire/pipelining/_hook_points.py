"""Every private part of torch's pipelining that prefire.pipelining uses,
in one module with its checks: a torch upgrade edits this file.

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
argument order, ``pipeline_order_with_comms``), and so does W's taking of
what B computed (``backward_state``'s param groups, Note [Weight gradients a
custom Function computes in B]); torch has no public API for any of them.
So nothing here may switch itself off quietly (see Note [Hook points fail
loudly]).

Note [Hook points fail loudly]
A torch that moved one of these points would leave training running without
prefire, or with bubble prefire off, and say nothing. So:
  * ``enable`` refuses a torch outside the tested range (``_torch_range``:
    the releases CI runs the whole suite against), naming it and how to try
    anyway (PREFIRE_PIPELINING_UNTESTED_TORCH=1), and checks that every hook
    point exists with the shape this module relies on;
  * after the first training step, it checks that they fired: every stage's
    forward went through the wrapper, and with ``bubble=True`` every receive
    the schedule posted in the tables was popped there (a torch that waits
    on them some other way would never reach the bubble prefire), and raises
    RuntimeError naming the point otherwise; a forward wrapper that sees
    many more forwards than a step has without a step starting
    (``clear_runtime_states``) raises too;
  * it warns once when that first step made no prefire checkpoint on the
    rank (blocks that use torch's checkpoint, or none).

Note [The last stage lets go of its graph after W]
The last stage keeps each micro-batch's output until the step ends, to
merge them for the caller (``output_chunks``), and the schedule its loss
(``_internal_losses``, for ``step(losses=...)``); each holds its graph.
torch detaches the outputs after B for that reason, but in place, which a
view cannot be (a language model's head, a Linear over (batch, seq, dim),
returns one), so after B (``retain_graph=True``) and W, everything the last
stage's forward saved outside a checkpoint stayed until the next step
(torch 2.11 to 2.14; on 2.15 the output holds no graph by then):
measured, half of a kept block's saved bytes on the default GPT, what B
alone read. So after a micro-batch's last pass on the last stage (W, or
the full backward) ``enable`` puts detached copies of its output and loss
in their places: the same values for the caller, without a graph nobody
can run backward through again. A kept block of the last stage then holds
its activations from its F to its W, as on the other stages. ``enable``
checks that both lists exist (Note [Hook points fail loudly]).
"""

from __future__ import annotations

import inspect
import os
import time
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from .. import _torch_range

def rank_actions(schedule: Any) -> Optional[List[Tuple[str, int, int]]]:
    """The compute actions (``actions.Action``) of ``schedule``'s rank in
    one step, in order (an OVERLAP_F_B action as its parts); None for a
    schedule that keeps no order of actions (those not built on
    ``_PipelineScheduleRuntime``)."""
    order = getattr(schedule, "pipeline_order_with_comms", None)
    if order is None:
        return None
    return compute_actions(order[schedule.rank])


def compute_actions(actions: Iterable[Any]) -> List[Tuple[str, int, int]]:
    """The compute actions (``actions.Action``) among torch's ``_Action``s
    (None entries and communication left out, an OVERLAP_F_B action as its
    parts)."""
    from torch.distributed.pipelining.schedules import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD

    kinds = {FORWARD: "F", BACKWARD_INPUT: "B", BACKWARD_WEIGHT: "W", FULL_BACKWARD: "BW"}
    return [(kinds[a.computation_type], a.stage_index, a.microbatch_index)
            for action in actions if action is not None
            for a in (action.sub_actions or (action,)) if a.computation_type in kinds]


#: the stage methods enable() wraps (Note [Where prefire hooks into a pipeline schedule])
STAGE_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk", "clear_runtime_states")

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


_PARAM_GROUP_KEYS = {"params", "intermediates", "grads"}


def b_param_groups(stage: Any, micro_batch: int) -> List[dict]:
    """The param groups torch's B left for the W of ``micro_batch``
    (``backward_state``), each with its ``params`` (AccumulateGrad nodes),
    ``intermediates`` and their ``grads``; [] where B left none."""
    state = stage.backward_state.get(micro_batch)
    groups = state[1] if isinstance(state, tuple) and len(state) > 1 else None
    for group in groups or ():
        if not isinstance(group, dict) or not _PARAM_GROUP_KEYS <= group.keys():
            raise RuntimeError(
                f"prefire.pipelining: torch {torch.__version__}'s B left W a param group without "
                f"{', '.join(sorted(_PARAM_GROUP_KEYS))}; W cannot take the weight gradients B computed "
                "(Note [Weight gradients a custom Function computes in B])")
    return list(groups or ())


def leave_nothing_for_w(group: dict) -> None:
    """Makes torch's W skip ``group`` (no intermediate to run from) and
    lets go of its autograd nodes."""
    group["intermediates"] = []
    group["grads"] = []


def let_go_of_graph(stage: Any, schedule: Any, micro_batch: int) -> bool:
    """After the last pass of ``micro_batch`` on the last stage: its
    output and loss as values, without their graph (Note [The last
    stage lets go of its graph after W]). Returns whether neither holds a
    graph now: always, whether this let go of one or torch kept none (2.15
    keeps none); a test stands in for a schedule that keeps its graphs
    with a function that returns False."""
    outputs = stage.output_chunks
    if 0 <= micro_batch < len(outputs) and any(isinstance(t, torch.Tensor) and t.grad_fn is not None
                                                 for t in tree_flatten(outputs[micro_batch])[0]):
        outputs[micro_batch] = tree_map_only(torch.Tensor, torch.Tensor.detach, outputs[micro_batch])
    losses = getattr(schedule, "_internal_losses", None)
    if isinstance(losses, list) and 0 <= micro_batch < len(losses):
        loss = losses[micro_batch]
        if isinstance(loss, torch.Tensor) and loss.grad_fn is not None:
            losses[micro_batch] = loss.detach()
    return True


def _check_torch_version(version: Optional[str] = None) -> None:
    """Refuses a torch outside the tested range (Note [Hook points fail loudly])."""
    outside = _torch_range.outside_message(version or torch.__version__, "prefire.pipelining")
    if outside is None or os.environ.get("PREFIRE_PIPELINING_UNTESTED_TORCH") == "1":
        return
    raise RuntimeError(
        f"{outside}. It hooks into private parts of torch.distributed.pipelining; set "
        "PREFIRE_PIPELINING_UNTESTED_TORCH=1 to try it anyway (enable() then checks every hook point, and the "
        "first step checks that each fired)")


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
        for name in STAGE_METHODS:
            if not callable(getattr(stage, name, None)):
                raise RuntimeError(f"prefire.pipelining: {type(stage).__name__} has no method {name} in torch "
                                   f"{torch.__version__}; prefire cannot hook into this schedule's stages")
        if not isinstance(getattr(stage, "backward_state", None), dict):
            raise RuntimeError(f"prefire.pipelining: {type(stage).__name__} keeps no backward_state dict in torch "
                               f"{torch.__version__}; prefire's W takes from it what B computed (Note [Weight "
                               "gradients a custom Function computes in B])")
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
