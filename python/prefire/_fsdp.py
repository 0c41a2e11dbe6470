"""Recomputing FSDP2-sharded blocks ahead of backward (used by
:mod:`prefire._checkpoint` and :mod:`prefire.pipelining`).

Note [Prefire of FSDP2-sharded blocks]
FSDP2 (``fully_shard``) keeps a block's parameters sharded (DTensors) outside
its forward and backward: its forward pre-hook all-gathers them, its
post-forward hook reshards, and in backward a pre-backward hook (on the
block's outputs) all-gathers again before any recomputation runs. A lazy
recomputation therefore finds the parameters gathered; a recomputation run
ahead of backward (``prefire``, a pipeline's bubble) does not, whichever
way the two are stacked:
  * checkpoint inside ``fully_shard`` (torchtitan's order:
    ``fully_shard(checkpoint_wrapper(block))``): the recomputation runs the
    inner block on the sharded DTensors and fails (mixed Tensor and
    DTensor);
  * ``fully_shard`` inside the checkpoint (``checkpoint(fsdp_block, x)``):
    the recomputation runs FSDP's forward hooks, which gather, record the
    block in FSDP's forward order a second time (backward prefetch then
    gathers blocks again) and, with early stop, never reach the hook that
    reshards: the block stays gathered until its backward.
So a recomputation outside FSDP's backward does FSDP's part itself, for
each FSDP state that manages parameters of the checkpointed module:
  1. gathers its parameters (``FSDPModule.unshard()``: one all-gather, the
     one the recomputation needs; none when they are gathered already);
  2. runs the recomputation with the state marked as in backward
     (``_training_state = PRE_BACKWARD``), the state a lazy recomputation
     sees: FSDP's forward hooks, where the checkpoint contains them, then
     record nothing, register nothing and reshard nothing (they cast inputs
     under mixed precision as in a lazy recomputation);
  3. gives the state back and, when it found the parameters sharded,
     reshards them (``FSDPModule.reshard()``), as FSDP would have them until
     backward; backward's pre-backward hook gathers again, the all-gather
     backward does anyway. The recomputed tensors that alias the gathered
     parameters are valid again from then on, exactly as forward's saved
     tensors are under ``reshard_after_forward``. Leaving them gathered for
     the backward that follows would save that all-gather and hold the
     gathered parameters from the prefire to the backward; FSDP's state is
     given back as it was, always, so FSDP's own hooks find what they
     expect.
The checkpointed module is the function's module (an ``nn.Module``, its
bound method, or a ``functools.partial`` of either); a checkpoint of some
other callable gets no help, and a recomputation of it on sharded
parameters fails loudly (DTensor's mixed-types error), never silently.
On CUDA the gathered parameters are recorded on the recomputation's stream
before they are resharded, so the allocator does not hand their memory out
while the recomputation's kernels may still read it.
The all-gather is a collective: every rank of the FSDP group must prefire
the same blocks in the same order. ``prefire()`` called the same way on each
rank does; a pipeline's bubble filling, whose choices follow each rank's
waits, prefires on a stage that holds FSDP modules only while all of them
are gathered (:func:`all_gathered`), so it never issues a collective
(Note [Filling bubbles]).
FSDP's state is private (the composable states registry,
``_fsdp_param_groups``, ``_training_state``, each parameter's module); a
torch whose FSDP state lacks them raises naming what is missing (without
the registry, nothing is found and the DTensor error above stays loud).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, List, Optional, Tuple

import torch


def _module_of(function: Any) -> Optional[torch.nn.Module]:
    while isinstance(function, functools.partial):
        function = function.func
    if isinstance(function, torch.nn.Module):
        return function
    owner = getattr(function, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None


def _registry():
    """FSDP's (and other composable APIs') module -> state map, or None when
    torch.distributed is not built in or no composable API is in use."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed import _composable_state

    return getattr(_composable_state, "_module_state_mapping", None)


def states_of(function: Any) -> Tuple[Tuple[torch.nn.Module, Any], ...]:
    """The (FSDP module, FSDP state) pairs that manage parameters of
    ``function``'s module; empty when it has none (or is no module)."""
    mapping = _registry()
    if not mapping:
        return ()
    module = _module_of(function)
    if module is None:
        return ()
    from torch.distributed.fsdp import FSDPModule

    inside = set(module.modules())
    found = []
    seen = set()
    for owner, ref in list(mapping.items()):
        state = ref()
        if not isinstance(owner, FSDPModule) or state is None or id(state) in seen:
            continue
        seen.add(id(state))
        if not hasattr(state, "_training_state"):
            raise RuntimeError(f"prefire: FSDP's state has no _training_state in torch {torch.__version__}; prefire "
                               "cannot recompute FSDP2-sharded blocks ahead of backward (Note [Prefire of "
                               "FSDP2-sharded blocks])")
        groups = _groups(state)
        if any(p._module_info.module in inside for g in groups for p in g.fsdp_params):
            found.append((owner, state))
    return tuple(found)


def _groups(state) -> List[Any]:
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch before the per-mesh groups: one optional group
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return groups


def _sharded(module: torch.nn.Module) -> List[torch.nn.Module]:
    """The FSDP modules in ``module`` whose parameters are not all gathered."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)
            and not all(g.is_unsharded for g in _groups(m._get_fsdp_state()))]


def gather_sharded(module: torch.nn.Module) -> int:
    """Gathers every FSDP module in ``module`` whose parameters are sharded
    (``FSDPModule.unshard()``, one all-gather each); returns how many.
    Used before a pipeline stage's split backward passes (Note [Parameters
    torch's W gives no gradient] in pipelining/_weight_grads_in_b.py)."""
    sharded = _sharded(module)
    for m in sharded:
        m.unshard()
    return len(sharded)


def all_gathered(module: torch.nn.Module) -> bool:
    """Whether every FSDP module in ``module`` has its parameters gathered:
    a recomputation inside it then issues no collective."""
    return not _sharded(module)


@contextlib.contextmanager
def gathered(states) -> Any:
    """Around a recomputation: Note [Prefire of FSDP2-sharded blocks],
    steps 1 to 3, for the states not in backward already."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    ahead = [(m, s) for m, s in states if s._training_state != TrainingState.PRE_BACKWARD]
    if not ahead:
        yield
        return
    resharded = []
    for module, state in ahead:
        if not all(g.is_unsharded for g in _groups(state)):
            module.unshard()
            resharded.append(module)
    before = [s._training_state for _, s in ahead]
    for _, state in ahead:
        state._training_state = TrainingState.PRE_BACKWARD
    try:
        yield
    finally:
        for (_, state), was in zip(ahead, before):
            state._training_state = was
        for module in resharded:
            _record_on_current_stream(module)
            module.reshard()


def _record_on_current_stream(module: torch.nn.Module) -> None:
    if not torch.cuda.is_available():
        return
    for p in module.parameters():
        if p.is_cuda:
            stream = torch.cuda.current_stream(p.device)
            if stream != torch.cuda.default_stream(p.device):
                p.record_stream(stream)
