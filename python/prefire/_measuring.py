"""What the plain planner (``_plan.py``) and the pipeline planner
(``pipelining/_plan.py``) measure of a block in a measuring step, and the
checks of the budget both take: one place for both.

A block's measuring forward runs checkpointed, timed (synchronised on CUDA:
the measuring step only), under a probe where a selective checkpoint is a
choice (Note [Measuring a selective checkpoint] in _selective.py); its
inputs' storages are what a checkpoint of it holds (``checkpoint_bytes``).
What keeping it would hold is the census of its checkpoint
(``_C.kept_bytes`` of its handle), read by the caller once the handle exists.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.utils import _pytree as pytree

from ._checkpoint import checkpoint_bytes
from ._selective import ModeCosts, probing, selective_cost

Signature = Tuple[Any, ...]  # the shapes, dtypes and devices of a step's (or stage's) first inputs

@dataclass(frozen=True)
class Measured:
    """One measuring forward of a block (bytes and seconds)."""

    input_bytes: int        # what a checkpoint of it holds: its inputs' storages
    seconds: float          # its forward, standing for one recomputation
    selective_bytes: int    # what a selective checkpoint of it would hold; -1: no such choice
    selective_seconds: float  # what that would add to a step over keeping it


def tensors(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> List[torch.Tensor]:
    return [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]


def signature(inputs: List[torch.Tensor]) -> Signature:
    return tuple((tuple(t.shape), t.dtype, t.device) for t in inputs)


def timed(run: Callable[[], Any], synchronize: bool) -> Tuple[Any, float]:
    """``run()`` and its seconds; ``synchronize``: on CUDA, the device's time too."""
    if synchronize:
        torch.cuda.synchronize()
    begin = time.perf_counter()
    out = run()
    if synchronize:
        torch.cuda.synchronize()
    return out, time.perf_counter() - begin


def measure(checkpointed: Callable[[], Any], inputs: List[torch.Tensor], policy: Optional[Callable[..., Any]],
            costs: Optional[ModeCosts], synchronize: bool) -> Tuple[Any, Measured]:
    """Runs a block's measuring forward (``checkpointed()``: its checkpoint)
    and says what it measured; ``policy``: a SAC policy function whose
    selective checkpoint is a choice for this block (None: none is), with
    its ``costs``."""
    with probing(policy) as probe:
        out, seconds = timed(checkpointed, synchronize)
    input_bytes = checkpoint_bytes(inputs)
    selective, selective_seconds, seconds = selective_cost(probe, costs, input_bytes, seconds)
    return out, Measured(input_bytes, seconds, selective, selective_seconds)


def warn_measuring_step(who: str, measuring_bytes: int, memory_budget: int, planned_bytes: int) -> None:
    """Warns where the measuring step, which checkpoints every block, held
    ``measuring_bytes``, more than ``memory_budget`` (which the plan, from
    the next step on, holds within: ``planned_bytes``). Both planners take
    any budget down to the least any plan holds."""
    if measuring_bytes > memory_budget:
        warnings.warn(f"{who}: the measuring step checkpointed every block and held up to {measuring_bytes} bytes, "
                      f"above memory_budget={memory_budget}; later steps hold at most {planned_bytes}", UserWarning,
                      stacklevel=4)


def check_memory_budget(who: str, memory_budget: Any) -> None:
    """Raises ValueError unless ``memory_budget`` is a number of bytes (an int >= 0)."""
    if type(memory_budget) is not int or memory_budget < 0:
        raise ValueError(f"{who}: memory_budget must be a number of bytes (an int >= 0), got {memory_budget!r}")


def hold_budget_with(tier: Any, who: str, memory_budget: int, peak_bytes: int, needed: int) -> None:
    """A plan with offloaded blocks on ``tier``: what the copies still
    queued may hold is the budget's headroom over the plan's peak (Note
    [Backpressure on copies into a tier] in src/offload/tier_store.cpp),
    and ValueError when what it keeps in the tier at once (``needed``,
    ``_C.tier_bytes``) does not fit the tier."""
    if needed > tier.capacity_bytes:
        raise ValueError(f"{who}: the plan offloads {needed} bytes at once and the offload tier holds "
                         f"{tier.capacity_bytes}; make the tier larger or the memory budget larger")
    tier.max_pending_bytes = max(0, memory_budget - peak_bytes)
