"""prefire: scheduled activation recomputation for PyTorch programs.

The same C++ runtime as prefire's LibTorch API, reached through torch's
saved-tensor hooks (Python's autograd engine stays in charge):

* :func:`checkpoint` is a drop-in for
  ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``;
* :class:`collect` gathers the checkpoints a forward creates;
  :func:`prefire` recomputes one ahead of backward into a session, and
  :class:`session` makes the backward passes inside it (the input-gradient
  pass B and the weight-gradient pass W of a split backward) share that one
  recomputation; :func:`clear_session` ends it;
* :func:`plan_checkpoints` turns a memory budget into which blocks of a
  model to checkpoint (measured in its first step, planned in C++).
"""

from __future__ import annotations

import torch  # loads libtorch before the extension module

from . import _build

if torch.__version__ != _build.TORCH_VERSION:
    # Checked before the extension module loads: against another torch it
    # would fail to link, or link and crash.
    raise ImportError(
        f"prefire was built against torch {_build.TORCH_VERSION}, but this process imports torch "
        f"{torch.__version__} ({torch.__file__}). Rebuild prefire in this environment (pip install "
        f"--no-build-isolation <prefire>), or use the torch it was built for")

from . import _torch_range  # noqa: E402

_outside = _torch_range.outside_message(torch.__version__, "prefire")
if _outside:
    import warnings

    warnings.warn(_outside + ": it was built against this torch, but nothing checked that it works with it",
                  stacklevel=2)

from . import _C, cuda  # noqa: E402
from ._allocator import AllocatorBytes, AllocatorPeak, allocator_bytes, count_cpu_allocations, reset_allocator_peak
from ._checkpoint import CheckpointError, CheckpointWrapper, checkpoint, checkpoint_sequential, checkpoint_wrapper
from ._compile import compile
from ._meter import SavedTensorMeter

OffloadTier = _C.OffloadTier
from ._plan import (
    BlockCost,
    Choice,
    MemoryPlanner,
    Plan,
    PlannedBlock,
    Release,
    choice_seconds,
    copy_seconds,
    describe_plan,
    least_plan_bytes,
    offered_choices,
    plan_bytes,
    plan_for_budget,
    plan_checkpoints,
    reload_schedule,
    with_offload,
)
from ._selective import MATMUL_AND_ATTENTION
from ._schedule import (
    CheckpointHandle,
    PrefireStatus,
    RuntimeStats,
    SessionStats,
    attach,
    clear_session,
    collect,
    discard_session,
    fetch_ahead,
    prefire,
    reset_runtime_peak,
    runtime_stats,
    session,
    session_stats,
    set_recompute_observer,
    set_session_budget,
)

__all__ = [
    "AllocatorBytes",
    "AllocatorPeak",
    "BlockCost",
    "CheckpointError",
    "CheckpointHandle",
    "CheckpointWrapper",
    "Choice",
    "MATMUL_AND_ATTENTION",
    "MemoryPlanner",
    "OffloadTier",
    "Plan",
    "PlannedBlock",
    "Release",
    "PrefireStatus",
    "RuntimeStats",
    "SavedTensorMeter",
    "SessionStats",
    "allocator_bytes",
    "attach",
    "checkpoint",
    "checkpoint_sequential",
    "checkpoint_wrapper",
    "choice_seconds",
    "clear_session",
    "compile",
    "copy_seconds",
    "collect",
    "count_cpu_allocations",
    "describe_plan",
    "discard_session",
    "fetch_ahead",
    "least_plan_bytes",
    "offered_choices",
    "plan_bytes",
    "plan_checkpoints",
    "reload_schedule",
    "plan_for_budget",
    "prefire",
    "reset_allocator_peak",
    "reset_runtime_peak",
    "runtime_stats",
    "session",
    "session_stats",
    "set_recompute_observer",
    "set_session_budget",
    "with_offload",
    "cuda",
]
