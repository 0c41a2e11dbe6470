"""prefire.checkpoint: torch.utils.checkpoint's non-reentrant calling convention
over prefire's C++ checkpoint."""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Optional, Tuple

import torch
from torch.utils import _pytree as pytree

from . import _C

#: Raised for checkpoint misuse; a torch.utils.checkpoint.CheckpointError.
CheckpointError = _C.CheckpointError


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    use_reentrant: Optional[bool] = None,
    context_fn: Optional[Callable[[], Tuple[ContextManager, ContextManager]]] = None,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    preserve_rng_state: bool = True,
    **kwargs: Any,
) -> Any:
    """Runs ``function(*args, **kwargs)`` without keeping the tensors autograd
    saves inside it; backward recomputes them.

    The calling convention of ``torch.utils.checkpoint.checkpoint(function,
    *args, use_reentrant=False, ...)``: positional and keyword arguments,
    tensors anywhere in nested lists, tuples and dicts of them, non-tensor
    arguments, and any nested structure of outputs (non-tensor outputs are
    returned as forward computed them). Gradients equal those of
    ``function`` run unchecked.

    Args:
        use_reentrant: ``None`` or ``False``; prefire has no reentrant variant.
        context_fn: returns two context managers; the first wraps the forward
            run, the second every recomputation.
        determinism_check: ``"default"`` (shape, dtype and device of every
            saved tensor), ``"none"``, ``"metadata"`` or ``"checksum"`` (also
            the bytes; a debugging mode).
        debug: must be ``False`` (torch's debug traces are not supported).
        early_stop: stop a recomputation once every saved tensor is back.
        preserve_rng_state: restore the CPU and CUDA generators of forward for
            the recomputation.

    Raises:
        CheckpointError: a recomputation that does not match forward, a saved
            tensor modified in place, and other misuse torch reports so.
    """
    if use_reentrant:
        raise ValueError("prefire.checkpoint is non-reentrant: pass use_reentrant=False (or leave it unset)")
    if debug:
        raise ValueError("prefire.checkpoint: debug=True is not supported")
    if not kwargs and all(type(a) is torch.Tensor for a in args):
        leaves, spec, where = list(args), None, range(len(args))
    else:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    # Forward's output structure. Cleared once read: the function below lives
    # as long as the checkpoint, and must not keep forward's outputs alive.
    forward: dict = {}

    def run(tensors):
        if spec is None:
            out = function(*tensors)
        else:
            values = list(leaves)
            for i, t in zip(where, tensors):
                values[i] = t
            call_args, call_kwargs = pytree.tree_unflatten(values, spec)
            out = function(*call_args, **call_kwargs)
        if type(out) is torch.Tensor:
            flat, out_spec = [out], None
        else:
            flat, out_spec = pytree.tree_flatten(out)
        if "done" not in forward:  # a recomputation's outputs are dropped
            forward.update(done=True, flat=flat, spec=out_spec)
        return [o for o in flat if isinstance(o, torch.Tensor)]

    tensors = _C.checkpoint(run, [leaves[i] for i in where], preserve_rng_state, determinism_check, early_stop,
                            context_fn)
    for i in where:  # recomputations get them from the checkpoint, which saved them through autograd
        leaves[i] = None
    flat, out_spec = forward.pop("flat"), forward.pop("spec")
    if out_spec is None:
        return tensors[0]
    returned = iter(tensors)
    flat = [next(returned) if isinstance(o, torch.Tensor) else o for o in flat]
    return pytree.tree_unflatten(flat, out_spec)


class CheckpointWrapper(torch.nn.Module):
    """Runs the wrapped module's forward under :func:`checkpoint`."""

    def __init__(self, module: torch.nn.Module, **checkpoint_kwargs: Any) -> None:
        super().__init__()
        self._checkpoint_wrapped_module = module
        self._checkpoint_kwargs = checkpoint_kwargs

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self._checkpoint_wrapped_module, *args, **self._checkpoint_kwargs, **kwargs)


def checkpoint_wrapper(module: torch.nn.Module, **checkpoint_kwargs: Any) -> CheckpointWrapper:
    """Wraps ``module`` so that its forward is checkpointed, like
    ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``;
    ``checkpoint_kwargs`` go to every :func:`checkpoint` call."""
    return CheckpointWrapper(module, **checkpoint_kwargs)
