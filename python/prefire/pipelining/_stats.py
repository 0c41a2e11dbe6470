"""What ``enable``'s sessions did (``Pipelining.stats()``)."""

from __future__ import annotations

from dataclasses import dataclass


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
    trim_misses: int = 0          # unpacks in B or W of a tensor the trim dropped (recomputed for that pass alone)
    graphs_let_go: int = 0        # last-stage micro-batches whose output and loss hold no graph after W
    prefires_let_go: int = 0      # bubble-prefired micro-batches let go so that a B could keep its recomputation
    w_groups_taken_in_b: int = 0  # param groups whose weight gradients B's custom-Function nodes gave (W skipped them)
    gathered_for_split: int = 0   # FSDP modules found resharded before a split B or W and gathered for it
