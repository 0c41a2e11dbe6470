"""Selective checkpoints a memory plan may choose for a block: torch's SAC
policy (``create_selective_checkpoint_contexts``) in place of a whole
checkpoint, and what one costs, measured while the block runs as a whole
checkpoint.

Note [Measuring a selective checkpoint]
A plan with a third choice per block (Note [Selective checkpoints in a
plan] in src/memory/plan.cpp) needs, for each block, what its selective
checkpoint would hold and how long its recomputation would take, from the
measuring step, which checkpoints every block whole (the least a plan
holds; running them selectively there would hold their caches and could
pass the budget). So the measuring forward runs under a dispatch mode that
asks the policy about every op as SAC's own caching mode does (the same
context, the ops SAC ignores left out) and, for the ops it would keep,
adds up their outputs' storages (each op's once; across ops they are
summed, never merged: a freed output's address may come back, so merging
could count less than SAC keeps) and the time every op and the kept ones
took. The block's selective checkpoint then holds its inputs and those
bytes (high where outputs share a storage: counted for each op), and
recomputes in the share of its forward's time that the ops it does not
keep took (the mode's own time, which the forward's includes, is left out
of both sums, so the share is that of the ops, and the full and selective
recomputations are both timed with it). On CUDA the ops' times are the
host's (the measuring step synchronises only around the forward), so there
the share is that of the launches, not the kernels: a plan there should be
checked against its step time.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from typing import Any, Callable, Iterator, List, Optional, Tuple, Union

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils import _pytree as pytree

from ._checkpoint import _storages

aten = torch.ops.aten

#: ``selective=True``'s policy: keep the outputs of matrix products and
#: attention (most of a transformer block's forward time, about two thirds
#: of what it saves), recompute the rest (norms, activations, residuals).
MATMUL_AND_ATTENTION = [op for op in (
    getattr(aten.mm, "default", None), getattr(aten.addmm, "default", None), getattr(aten.bmm, "default", None),
    getattr(aten.baddbmm, "default", None),
    getattr(getattr(aten, "_scaled_dot_product_flash_attention", None), "default", None),
    getattr(getattr(aten, "_scaled_dot_product_efficient_attention", None), "default", None),
    getattr(getattr(aten, "_scaled_dot_product_cudnn_attention", None), "default", None),
    getattr(getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None), "default", None),
) if op is not None]

Policy = Union[bool, List[Any], Callable[..., Any]]

_SAVE = (torch_checkpoint.CheckpointPolicy.MUST_SAVE, torch_checkpoint.CheckpointPolicy.PREFER_SAVE)


def policy(selective: Policy) -> Optional[Callable[..., Any]]:
    """``selective`` as a SAC policy function (ctx, op, *args, **kwargs) ->
    CheckpointPolicy or bool: True for MATMUL_AND_ATTENTION, a list of
    OpOverloads kept, a callable as it is; None for False or None."""
    if selective is None or selective is False:
        return None
    if selective is True:
        selective = MATMUL_AND_ATTENTION
    if isinstance(selective, (list, tuple, set, frozenset)):
        ops = list(selective)
        for op in ops:
            if not isinstance(op, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
                raise ValueError(f"prefire: selective= takes OpOverloads (torch.ops.aten.mm.default, not "
                                 f"torch.ops.aten.mm), True, or a SAC policy function; got {op!r} in the list")
        kept = frozenset(ops)
        return lambda ctx, op, *args, **kwargs: op in kept
    if callable(selective):
        return selective
    raise TypeError(f"prefire: selective= must be True, a list of OpOverloads or a SAC policy function "
                    f"(ctx, op, *args, **kwargs) -> CheckpointPolicy; got {type(selective).__name__}")


def context_fn(policy_fn: Callable[..., Any]) -> Callable[[], Any]:
    """A checkpoint's context_fn that checkpoints selectively by ``policy_fn``."""
    return functools.partial(torch_checkpoint.create_selective_checkpoint_contexts, policy_fn)


_CONTEXT_TAKES_OUTPUT = "op_output" in inspect.signature(torch_checkpoint.SelectiveCheckpointContext).parameters


class SelectiveProbe(TorchDispatchMode):
    """Around a block's forward: what its selective checkpoint by
    ``policy_fn`` would keep, ``bytes``, and the share of the ops' time
    that the others took, ``recomputed_share`` (Note [Measuring a selective
    checkpoint])."""

    def __init__(self, policy_fn: Callable[..., Any]) -> None:
        super().__init__()
        self.policy_fn = policy_fn
        self.bytes = 0
        self.op_seconds = 0.0    # every op's
        self.kept_seconds = 0.0  # the kept ops'

    @property
    def recomputed_share(self) -> float:
        return 1.0 - self.kept_seconds / self.op_seconds if self.op_seconds > 0 else 1.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in torch_checkpoint.SAC_IGNORED_OPS:
            return func(*args, **kwargs)
        begin = time.perf_counter()
        out = func(*args, **kwargs)
        took = time.perf_counter() - begin
        self.op_seconds += took
        ctx = (torch_checkpoint.SelectiveCheckpointContext(is_recompute=False, op_output=out) if _CONTEXT_TAKES_OUTPUT
               else torch_checkpoint.SelectiveCheckpointContext(is_recompute=False))
        decision = self.policy_fn(ctx, func, *args, **kwargs)
        if decision is True or decision in _SAVE:
            outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            self.bytes += sum(_storages(outputs).values())
            self.kept_seconds += took
        return out


@contextlib.contextmanager
def probing(policy_fn: Optional[Callable[..., Any]]) -> Iterator[Optional[SelectiveProbe]]:
    """A SelectiveProbe by ``policy_fn`` around the block's measuring
    forward; None (nothing probed) without a policy."""
    if policy_fn is None:
        yield None
        return
    with SelectiveProbe(policy_fn) as probe:
        yield probe


def selective_cost(probe: Optional[SelectiveProbe], input_bytes: int, seconds: float) -> Tuple[int, float]:
    """(selective bytes, selective seconds) of a block a probe measured
    (its inputs' bytes, its forward's seconds); (-1, 0): none to choose."""
    if probe is None:
        return -1, 0.0
    return input_bytes + probe.bytes, seconds * probe.recomputed_share
