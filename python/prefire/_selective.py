"""Selective checkpoints a memory plan may choose for a block: torch's SAC
policy (``create_selective_checkpoint_contexts``) in place of a whole
checkpoint, and what one costs, measured while the block runs as a whole
checkpoint.

Note [Measuring a selective checkpoint]
A plan with a third choice per block (Note [Selective checkpoints in a
plan] in src/plan/plan_bytes.cpp) needs, for each block, what its selective
checkpoint would hold and how long its recomputation would take, from the
measuring step, which checkpoints every block whole (the least a plan
holds; running them selectively there would hold their caches and could
pass the budget). So the measuring forward runs under a dispatch mode that
asks the policy about every op as SAC's own caching mode does (the same
context, the ops SAC ignores left out) and, for the ops it would keep,
adds up their outputs' storages (each op's once; across ops they are
summed, never merged: a freed output's address may come back, so merging
could count less than SAC keeps), the time the kept ones took, and how
many ops went through it. The block's selective checkpoint then holds its
inputs and those bytes (high where outputs share a storage: counted for
each op).

Its time is where a dispatch mode in Python shows: SAC runs one over every
op of the forward (caching) and of the recomputation (handing back), and
on CPU that costs as much as the small ops it saves recomputing (GPT block,
dim 256, 2x128 tokens, one thread, benchmarks/python_selective_benchmark.py:
forward 5.7 ms checkpointed, 7.6 selective; forward and backward 16.8 kept,
21.2 checkpointed, 21.3 selective). So when a planner is made it measures
what a mode adds per op (mode_costs, on a transformer block's kinds of op
on tiny CPU tensors, the least of five batches each way): the probe's, a
forward with and without it; and a selective checkpoint's over a whole
one, forward and backward, per op and pass (SAC's costs per call spread
over the few ops there; these checkpoints count in runtime_stats'
recomputations). The measuring forward's time less the probe's part (its
ops x its cost) stands for a whole recomputation, and a selective
checkpoint costs that less the kept ops' time plus twice SAC's part: what
choosing it adds to a step over keeping the block, as recompute_seconds is
for a whole checkpoint. Still optimistic on that block (told 0.58 of a
whole checkpoint, measured 1.03): a whole recomputation costs less than
the measuring forward (early stop, no frame to build), and SAC's caching
costs more per op on real tensors than on tiny ones. On CUDA the ops'
times are the host's (the measuring step synchronises only around the
forward), so there the kept ops' share is that of the launches, not the
kernels: a plan there should be checked against its step time.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from dataclasses import dataclass
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
    ``policy_fn`` would keep, ``bytes``, the seconds the kept ops took,
    ``kept_seconds``, and the ops it saw, ``ops`` (Note [Measuring a
    selective checkpoint])."""

    def __init__(self, policy_fn: Callable[..., Any]) -> None:
        super().__init__()
        self.policy_fn = policy_fn
        self.bytes = 0
        self.kept_seconds = 0.0
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        if func in torch_checkpoint.SAC_IGNORED_OPS:
            return func(*args, **kwargs)
        begin = time.perf_counter()
        out = func(*args, **kwargs)
        took = time.perf_counter() - begin
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


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A transformer block's kinds of op on tiny tensors (norm, product,
    activation, attention, views, residual add)."""
    w = torch.ones(4, 4, device=x.device)
    h = torch.nn.functional.gelu(torch.nn.functional.linear(torch.nn.functional.layer_norm(x, (4,)), w))
    a = torch.nn.functional.scaled_dot_product_attention(h, h, h, is_causal=True)
    return a.transpose(1, 2).reshape(1, 2, 4) + h.view(1, 2, 4)


@dataclass(frozen=True)
class ModeCosts:
    """Seconds a dispatch mode in Python adds per op (Note [Measuring a
    selective checkpoint])."""

    probe: float  # a SelectiveProbe's, in a forward
    sac: float    # a selective checkpoint's over a whole one, per op and pass (forward, recomputation)


def mode_costs(policy_fn: Callable[..., Any]) -> ModeCosts:
    """Measures ModeCosts for ``policy_fn`` now, on ``_mix`` on the CPU
    (host time is what a mode adds), with gradients on: the least of five
    batches each way. Outside any checkpoint, collect() or meter."""
    with torch.enable_grad():
        return _mode_costs(policy_fn)


def _one() -> torch.Tensor:
    return torch.ones(1, 1, 2, 4, device="cpu", requires_grad=True)


def _mode_costs(policy_fn: Callable[..., Any]) -> ModeCosts:
    from ._checkpoint import checkpoint

    def forward_backward(context: Optional[Callable[[], Any]]) -> None:
        checkpoint(_mix, _one(), context_fn=context).sum().backward()

    def least(run: Callable[[], Any], n: int = 20) -> float:
        times = []
        for _ in range(5):
            begin = time.perf_counter()
            for _ in range(n):
                run()
            times.append((time.perf_counter() - begin) / n)
        return min(times)

    counter = SelectiveProbe(lambda ctx, op, *args, **kwargs: False)
    with counter:
        _mix(_one())
    ops = max(1, counter.ops)

    def probed() -> None:
        with SelectiveProbe(policy_fn):
            _mix(_one())

    plain = least(lambda: _mix(_one()))
    selective = context_fn(policy_fn)
    return ModeCosts(probe=max(0.0, least(probed) - plain) / ops,
                     sac=max(0.0, least(lambda: forward_backward(selective)) - least(lambda: forward_backward(None)))
                     / (2 * ops))


_LEAST_SECONDS = 1e-6  # what a (selective) recomputation is taken to cost at least


def selective_cost(probe: Optional[SelectiveProbe], costs: Optional[ModeCosts], input_bytes: int,
                   seconds: float) -> Tuple[int, float, float]:
    """(selective bytes, selective seconds, a whole recomputation's
    seconds) of a block whose measuring forward took ``seconds`` under
    ``probe`` (Note [Measuring a selective checkpoint]); without a probe,
    (-1, 0, seconds): no selective checkpoint to choose."""
    if probe is None or costs is None:
        return -1, 0.0, seconds
    # a recomputation is never free: where the differences of noisy timings say so (a loaded machine), a
    # least time keeps a plan from taking a checkpoint over keeping the block for nothing
    whole = max(_LEAST_SECONDS, seconds - probe.ops * costs.probe)
    return (input_bytes + probe.bytes,
            max(_LEAST_SECONDS, max(0.0, whole - probe.kept_seconds) + 2 * probe.ops * costs.sac), whole)
