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
See Note [Filling bubbles] in ``_bubbles.py``; ``placement=`` runs a
placement (``prefire.pipelining.placement``: the pipeline simulator writes
one) in place of these rules (Note [Running a placement]).

With ``memory_budget=N``, the rank's blocks hold at most N bytes of
activations: the first step measures them, the C++ planner chooses which
keep their activations and which are checkpointed, and what the plan leaves
is the sessions' byte budget. See Note [A pipeline rank's memory plan] in
``_plan.py``.

With ``budget_bytes=N``, the rank's sessions hold at most N bytes of
recomputed activations at once: bubble prefires stop short of what the
actions up to their micro-batch's B will hold, and a micro-batch whose
recomputation B would keep for W over it lets go after B (W recomputes
it). See Note [A rank's byte budget] in ``_budget.py``.

Where it hooks into torch (the stages' methods, the schedule's tables of
pending receives, its order of actions) and how a torch that moved one of
those points is refused: ``_hook_points.py`` (Note [Where prefire hooks into
a pipeline schedule], Note [Hook points fail loudly]); the sessions of one
stage: ``_sessions.py``; ``enable`` and the object it returns:
``_enable.py``. Public beside ``enable``: ``actions`` (a rank's actions and
their lifetimes), ``plans`` (a rank's plans as the C++ planner counts them),
``placement`` (a placement's type, check and file format),
``on_receive_wait`` and ``is_full_backward`` (hook points a program that
times a schedule uses).
"""

from ._enable import Pipelining, enable
from ._hook_points import is_full_backward, on_receive_wait
from ._stats import PipelineStats
from . import actions, placement, plans

__all__ = ["PipelineStats", "Pipelining", "actions", "enable", "is_full_backward", "on_receive_wait", "placement",
           "plans"]
