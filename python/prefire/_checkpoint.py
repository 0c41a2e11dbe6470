"""prefire.checkpoint: torch.utils.checkpoint's non-reentrant calling convention
over prefire's C++ checkpoint, and torch's checkpoint_wrapper over it."""

from __future__ import annotations

import contextlib
import copy
import sys
import threading
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_wrapper
from torch.overrides import _get_current_function_mode_stack
from torch.utils import _pytree as pytree
from torch.utils._device import DeviceContext

from . import _C, _compile, _fsdp, _schedule
from ._options import check_options, check_values
from ._thread_state import set_in_block
from ._warn_once import warn_once as _warn_once

#: Raised for checkpoint misuse; a torch.utils.checkpoint.CheckpointError.
CheckpointError = _C.CheckpointError

# Note [prefire.checkpoint inside torch.compile]
# Dynamo cannot trace into prefire's C++ runtime: it would break the graph
# there and run the checkpoint eagerly, with `function` compiled by the
# enclosing torch.compile in forward but run eagerly by the recomputation in
# backward (outside any compiled region). The two save different tensors
# (AOTAutograd's compiled forward saves what its partitioner chose), and the
# recomputation would fail or, without the determinism check, hand backward
# the wrong tensors. So inside a region dynamo traces, prefire.checkpoint is
# torch.utils.checkpoint(use_reentrant=False): dynamo turns that into its
# checkpoint higher-order op, and the partitioner recomputes the region
# inside the compiled backward (fused, and exactly what torch's checkpoint
# gives under compile). prefire's sessions and prefire() do not reach into a
# compiled graph: the compiled backward is one autograd node that recomputes
# what it needs itself. A warning says so once per process, at trace time
# (torch.compiler.assume_constant_result runs the warning while dynamo
# traces, so it costs no graph break).
#
# To keep prefire's scheduling for a compiled block, compile inside the
# checkpoint: prefire.checkpoint(prefire.compile(block), x), or
# prefire.checkpoint_wrapper(prefire.compile(block)). Forward is
# torch.compile's (inductor) and the recomputation runs the part of it that
# computes what the compiled backward reads (Note [A compiled block's
# recomputation program] in _compile.py); around torch.compile(block) it
# runs the whole compiled forward again. Either way the recomputation saves
# the tensors forward saved (tested bit-equal, inductor and aot_eager). A
# prefire.compile'd block whose forward no prefire.collect() sees, which
# nothing can schedule, runs as torch's compiled checkpoint instead (Note [A
# block no collector sees runs torch's compiled checkpoint] in _compile.py).
#
# Under a pipeline's B/W split the compiled backward, one node, computes
# every gradient whenever it runs: prefire.pipelining.enable lets W take the
# weight gradients B computed (Note [Weight gradients a custom Function
# computes in B] in pipelining/_weight_grads_in_b.py), so a block compiled
# around torch's checkpoint (this order, torchtitan's) recomputes once per
# micro-batch there, inside B's compiled backward.

# Note [Planned checkpoints]
# A planner that decides per block whether to keep its activations (the
# pipeline integration's memory_budget) needs every outermost
# prefire.checkpoint call of a forward, in order, whatever made it: a block
# runner, torch's checkpoint_wrapper with checkpoint_fn=prefire.checkpoint,
# prefire.checkpoint_wrapper. Inside `planned_calls(run)`, checkpoint(fn,
# ...) returns run(checkpointed, plain, selective, offloaded, args, kwargs),
# where checkpointed() is the checkpoint, plain() is fn(*args, **kwargs)
# unchecked, selective(context_fn) the checkpoint with that context_fn
# (a selective one's, Note [Measuring a selective checkpoint] in
# _selective.py), None where the call has a context_fn of its own (a plan
# never replaces what the user chose) or checkpoints a compiled function
# (a selective policy sees no op inside one: compiled()), and
# offloaded(tier) the checkpoint
# offloaded to that tier (Note [Offloaded blocks in a plan]), None where
# the call offloads by itself; while run runs, calls go through
# unplanned (a block's nested checkpoints are the block's). Recomputations
# run outside any planned forward.
_planned = threading.local()

#: run(checkpointed, plain, selective, offloaded, args, kwargs) -> output
PlannedRun = Callable[[Callable[[], Any], Callable[[], Any], Optional[Callable[[Callable[[], Any]], Any]],
                       Optional[Callable[[Any], Any]], Tuple[Any, ...], Dict[str, Any]], Any]


def planned_calls(run: PlannedRun) -> ContextManager[None]:
    """Hands this thread's outermost checkpoint() calls to ``run`` inside
    the block (Note [Planned checkpoints])."""
    return set_in_block(_planned, "run", run)


def _run_planned(run: PlannedRun, checkpointed: Callable[[], Any], plain: Callable[[], Any],
                 selective: Optional[Callable[[Callable[[], Any]], Any]], offloaded: Optional[Callable[[Any], Any]],
                 args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    _planned.run = None
    try:
        return run(checkpointed, plain, selective, offloaded, args, kwargs)
    finally:
        _planned.run = run


def compiled(function: Any) -> bool:
    """Whether ``function`` is one torch.compile made (a compiled module,
    one compiled in place by ``.compile()``, a compiled function, or
    prefire's wrapper of a compiled module)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing was compiled
    if eval_frame is None:
        return False
    if isinstance(function, CheckpointWrapper):
        return function.__dict__["_prefire_compiled"] is not None
    return (isinstance(function, eval_frame.OptimizedModule) or hasattr(function, "_torchdynamo_orig_callable")
            or getattr(function, "_compiled_call_impl", None) is not None)


@torch.compiler.assume_constant_result
def _warn_compiled_region() -> bool:
    _warn_once(
        "compile",
        "prefire.checkpoint inside torch.compile runs torch.utils.checkpoint(use_reentrant=False): the compiled "
        "backward recomputes the region itself, and prefire's sessions and prefire() do not apply to it. To keep "
        "them, compile inside the checkpoint (prefire.checkpoint(prefire.compile(block), ...)). See Note "
        "[prefire.checkpoint inside torch.compile]",
    )
    return True


_TORCH_DETERMINISM = {"default": "default", "metadata": "default", "checksum": "default", "none": "none"}


def _torch_options(determinism_check: str, early_stop: bool, preserve_rng_state: bool) -> Dict[str, Any]:
    """prefire.checkpoint's options as torch.utils.checkpoint's."""
    if determinism_check not in _TORCH_DETERMINISM:
        raise ValueError(f"prefire.checkpoint: determinism_check must be 'default', 'none', 'metadata' or "
                         f"'checksum', got {determinism_check!r}")
    return dict(determinism_check=_TORCH_DETERMINISM[determinism_check], early_stop=early_stop,
                preserve_rng_state=preserve_rng_state)


def _checkpoint_in_compiled_region(function, args, kwargs, context_fn, determinism_check, debug, early_stop,
                                   preserve_rng_state):
    _warn_compiled_region()
    options = _torch_options(determinism_check, early_stop, preserve_rng_state)
    if context_fn is not None:  # dynamo takes context_fn only as given (selective checkpointing's), never as None
        kwargs = dict(kwargs, context_fn=context_fn)
    return torch_checkpoint.checkpoint(function, *args, use_reentrant=False, debug=debug, **options, **kwargs)


def _device_context() -> Optional[torch.device]:
    """The device of the innermost ``with torch.device(...)`` around this
    call, which the recomputation re-enters, as torch's checkpoint does (the
    device, not the mode: a mode entered twice would leave wrongly)."""
    stack = _get_current_function_mode_stack()
    for mode in reversed(stack):
        if isinstance(mode, DeviceContext):
            return mode.device
    return None


def _has_dispatch(cls: type) -> bool:
    return getattr(cls, "__torch_dispatch__", None) is not torch._C._disabled_torch_dispatch_impl


def _as_forward_type(t: torch.Tensor, cls: type) -> torch.Tensor:
    """The recomputation's input `t` with the type forward saw. A top-level
    checkpoint recomputes from forward's own tensors (Note [Recomputation
    inputs are forward's tensors] in src/checkpoint/frame_inputs.cpp); a nested one from its
    parent's recomputation, whose saved tensors are plain aliases: a
    __torch_function__ subclass gets its type back (as torch.utils.checkpoint
    gives it: the type, not the instance's attributes)."""
    if type(t) is cls or not isinstance(t, torch.Tensor) or issubclass(cls, torch.nn.Parameter):
        return t
    if _has_dispatch(cls):  # a wrapper subclass (DTensor) keeps its type through aliases; never rebuilt here
        raise CheckpointError(
            f"prefire.checkpoint: an input was a {cls.__name__} in forward and is a {type(t).__name__} in the "
            f"recomputation; prefire cannot rebuild a __torch_dispatch__ subclass")
    return t.as_subclass(cls)


# Note [Selective checkpointing inside prefire]
# torch's selective activation checkpointing (SAC: a context_fn from
# create_selective_checkpoint_contexts) caches the outputs of the ops its
# policy saves during forward, in a store its two context managers share,
# outside saved-tensor hooks; its recomputation context hands each entry
# out once and marks it consumed, so a second recomputation raises ("backward
# an extra time"). Three things prefire does about it:
#  * The hooks on top of torch's stack inside a checkpoint are prefire's
#    own, so SAC is told to keep its cache out of them (a tensor it keeps
#    must not become a slot prefire drops); torch's checkpoint sets the same
#    attribute from its respect_saved_tensors_hooks argument.
#  * prefire recomputes a checkpoint more than once where B and W do not
#    share one recomputation (a budget that lets go after B, the pipeline
#    planner's measuring step, two backwards without a session), so each
#    recomputation runs with the store as forward left it, and leaves it so.
#    The cache then lives as long as the checkpoint (whose recomputation
#    context holds it), not until the first backward.
#  * That cache is memory the checkpoint holds, like its inputs: after
#    forward its tensors are counted in the SavedTensorMeter around the
#    checkpoint (_C._count_in_meter, each storage once with the rest the
#    meter counts) until the checkpoint goes, and the planners count its
#    bytes with the block's inputs (checkpoint_bytes). Inside another
#    checkpoint's forward nothing is counted: the outer frame's saves are its
#    own, and the outer checkpoint's recomputation makes the inner one again.
_inside = threading.local()  # .function: inside a prefire checkpoint's function, its forward or a recomputation
_held = threading.local()  # .storages: what the last checkpoint on this thread holds beyond its inputs


def checkpoint_bytes(tensors: List[torch.Tensor]) -> int:
    """Bytes the last prefire.checkpoint call on this thread holds, its
    inputs being ``tensors``: their storages and those it holds beyond them
    (the SAC cache, Note [Selective checkpointing inside prefire]), once
    each, leaves that require grad (parameters) not counted."""
    return sum({**_storages(tensors), **getattr(_held, "storages", {})}.values())


def _storages(tensors: List[torch.Tensor]) -> Dict[Tuple[Any, int], int]:
    """(device, address) -> bytes of the storages of ``tensors``; leaves
    that require grad (parameters) and views of them live anyway and are
    left out."""
    seen = {}
    for t in tensors:
        base = t if t._base is None else t._base
        if base.is_leaf and base.requires_grad:
            continue
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a subclass without storage
            continue
        seen[(t.device, storage.data_ptr())] = storage.nbytes()
    return seen


def _cached_tensors(store: Dict[Any, Any]) -> List[torch.Tensor]:
    """The tensors a SAC store holds (each entry an op's outputs, wrapped)."""
    out = []
    for entries in store.values():
        for entry in (entries.values() if isinstance(entries, dict) else entries):
            for leaf in pytree.tree_leaves(entry):
                tensor = getattr(leaf, "val", leaf)
                if isinstance(tensor, torch.Tensor):
                    out.append(tensor)
    return out


class _EveryRecomputation:
    """SAC's recomputation context, entered by every recomputation with the
    store as forward left it (Note [Selective checkpointing inside prefire])."""

    def __init__(self, context: ContextManager, store: Dict[Any, Any]) -> None:
        self.context, self.store = context, store
        self.counted: Any = None  # the store's tensors counted in a meter, released with the checkpoint
        self._as_forward_left: Optional[Dict[Any, Any]] = None

    def count(self) -> Dict[Tuple[Any, int], int]:
        """After forward: counts the cache in the meter around the
        checkpoint; returns its storages (``_storages``)."""
        tensors = _cached_tensors(self.store)
        self.counted = _C._count_in_meter(tensors)
        return _storages(tensors)

    def __enter__(self):
        self._as_forward_left = {key: copy.copy(entries) for key, entries in self.store.items()}
        return self.context.__enter__()

    def __exit__(self, *exc):
        try:
            return self.context.__exit__(*exc)
        finally:
            self.store.clear()
            self.store.update(self._as_forward_left)
            self._as_forward_left = None


def _for_prefire(context_fn, made: List[_EveryRecomputation]):
    """`context_fn` as prefire runs it (Note [Selective checkpointing
    inside prefire]); SAC's recomputation contexts it makes go to `made`."""
    if context_fn is None:
        return None

    def contexts():
        forward, recompute = context_fn()
        if getattr(forward, "respect_saved_tensors_hooks", False) is None:
            forward.respect_saved_tensors_hooks = False
        store = getattr(forward, "storage", None)
        if isinstance(store, dict) and getattr(recompute, "storage", None) is store:
            recompute = _EveryRecomputation(recompute, store)
            made.append(recompute)
        return forward, recompute

    return contexts


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    use_reentrant: Optional[bool] = None,
    context_fn: Optional[Callable[[], Tuple[ContextManager, ContextManager]]] = None,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    preserve_rng_state: bool = True,
    offload_to: Optional[_C.OffloadTier] = None,
    offload_inputs_only: bool = False,
    **kwargs: Any,
) -> Any:
    """Runs ``function(*args, **kwargs)`` without keeping the tensors autograd
    saves inside it; backward recomputes them (or, with ``offload_to``, reads
    them back from an offload tier).

    The calling convention of ``torch.utils.checkpoint.checkpoint(function,
    *args, use_reentrant=False, ...)``: positional and keyword arguments,
    tensors anywhere in nested lists, tuples and dicts of them, non-tensor
    arguments, and any nested structure of outputs (non-tensor outputs are
    returned as forward computed them). Gradients equal those of
    ``function`` run unchecked. The recomputation sees the input objects
    forward saw (their tensor subclass, their attributes).

    Inside a region ``torch.compile`` traces, this is
    ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` (a warning says
    so once; see Note [prefire.checkpoint inside torch.compile]).

    Args:
        use_reentrant: ``None`` or ``False``. prefire has no reentrant variant:
            ``True`` runs prefire's non-reentrant checkpoint and warns once
            (its gradients are those of torch's ``use_reentrant=False``).
        context_fn: returns two context managers; the first wraps the forward
            run, the second every recomputation.
        determinism_check: ``"default"`` (shape, dtype and device of every
            saved tensor), ``"none"``, ``"metadata"`` or ``"checksum"`` (also
            the bytes; a debugging mode).
        debug: must be ``False`` (torch's debug traces are not supported).
        early_stop: stop a recomputation once every saved tensor is back;
            ``torch.utils.checkpoint.set_checkpoint_early_stop`` around the
            forward overrides it, as it does torch's.
        preserve_rng_state: restore the CPU and CUDA generators of forward for
            the recomputation.
        offload_to: a :class:`prefire.OffloadTier`: the tensors forward saves
            are copied there as they are saved and read back for backward
            instead of being recomputed (``function`` runs once); a prefire of
            the checkpoint's handle prefetches them. ``None``: recompute.
        offload_inputs_only: with ``offload_to``, offload only the
            checkpoint's inputs (what a checkpoint keeps until backward) and
            recompute the rest; the recomputation reads its inputs back first.

    Raises:
        CheckpointError: a recomputation that does not match forward, a saved
            tensor modified in place, and other misuse torch reports so.
    """
    if torch.compiler.is_compiling():
        if offload_to is not None:  # torch's checkpoint would recompute: never offload silently
            raise ValueError("prefire.checkpoint: offload_to is not supported inside a region torch.compile traces; "
                             "call the offloaded checkpoint outside it (prefire.checkpoint(prefire.compile(block), "
                             "...))")
        return _checkpoint_in_compiled_region(function, args, kwargs, context_fn, determinism_check, debug,
                                              early_stop, preserve_rng_state)
    check_values("prefire.checkpoint", offload_to=offload_to, offload_inputs_only=offload_inputs_only,
                 early_stop=early_stop, preserve_rng_state=preserve_rng_state, debug=debug)
    if use_reentrant:
        _warn_once(
            "reentrant",
            "prefire.checkpoint(use_reentrant=True): prefire has no reentrant checkpoint; running its non-reentrant "
            "one (the gradients of torch's use_reentrant=False). Pass use_reentrant=False, or leave it unset, to "
            "silence this")
    if debug:
        raise ValueError("prefire.checkpoint: debug=True is not supported")
    if context_fn is not None and compiled(function):
        raise ValueError(
            "prefire.checkpoint: a context_fn (a selective checkpoint's) around a torch.compile'd function: its "
            "policy sees the ops eager code dispatches, and under its dispatch mode the compiled function runs "
            "eagerly in forward and compiled elsewhere, so forward and recomputation save different tensors. Put "
            "the selective checkpoint inside the compiled region (torch.compile(lambda x: "
            "torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False, context_fn=...))), or checkpoint the "
            "compiled block whole")
    planned = getattr(_planned, "run", None)
    if planned is not None:
        def with_context(context: Optional[Callable[[], Tuple[ContextManager, ContextManager]]],
                         tier: Optional[_C.OffloadTier] = offload_to) -> Any:
            return checkpoint(function, *args, context_fn=context, determinism_check=determinism_check,
                              early_stop=early_stop, preserve_rng_state=preserve_rng_state, offload_to=tier,
                              offload_inputs_only=offload_inputs_only, **kwargs)
        return _run_planned(planned, lambda: with_context(context_fn), lambda: function(*args, **kwargs),
                            with_context if context_fn is None and not compiled(function) else None,
                            (lambda tier: with_context(context_fn, tier)) if offload_to is None else None, args, kwargs)
    forced = torch_checkpoint._enable_checkpoint_early_stop  # set_checkpoint_early_stop wins, as in torch
    if forced is not None:
        early_stop = forced
    if offload_to is None and not _schedule._collecting() and not getattr(_inside, "function", False):
        # Note [A block no collector sees runs torch's compiled checkpoint] in _compile.py
        as_torch = _compile.torch_checkpoint_of(function)
        if as_torch is not None:
            _held.storages = {}
            return as_torch(_torch_options(determinism_check, early_stop, preserve_rng_state), args, kwargs)
    call = _FunctionCall(function, args, kwargs)
    selective: List[_EveryRecomputation] = []
    tensors = _C.checkpoint(call.run, call.tensors(), preserve_rng_state, determinism_check, early_stop,
                            _for_prefire(context_fn, selective), offload_to, offload_inputs_only)
    _held.storages = {key: nbytes for recompute in selective for key, nbytes in recompute.count().items()}
    return call.outputs(tensors)


class _FunctionCall:
    """``function(*args, **kwargs)`` as the C++ checkpoint runs it: its
    tensors as a flat list (handed back with forward's types for a
    recomputation), and forward's output structure, to give the tensors the
    checkpoint returns forward's shape. It lives as long as the checkpoint,
    so it lets go of forward's inputs and outputs once the forward is done."""

    def __init__(self, function: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        self.function = function
        self.types: Optional[List[type]] = None  # forward's input types, when some input is not a plain tensor
        if not kwargs and all(type(a) is torch.Tensor for a in args):
            self.leaves, self.spec, self.where = list(args), None, range(len(args))
        else:
            self.leaves, self.spec = pytree.tree_flatten((args, kwargs))
            self.where = [i for i, leaf in enumerate(self.leaves) if isinstance(leaf, torch.Tensor)]
            if any(type(self.leaves[i]) is not torch.Tensor for i in self.where):
                self.types = [type(self.leaves[i]) for i in self.where]
        self.forward: Dict[str, Any] = {}  # forward's output structure, cleared once read
        self.device = _device_context()

    def tensors(self) -> List[torch.Tensor]:
        return [self.leaves[i] for i in self.where]

    def run(self, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        if self.types is not None:
            tensors = [_as_forward_type(t, cls) for t, cls in zip(tensors, self.types)]
        if "done" not in self.forward:
            if not _compile.in_use():
                return self._call(tensors)
            with _compile.forward_of(self._forward_tensors) as graph:
                out = self._call(tensors)
            self.forward["graph"] = graph[0]
            return out
        # A recomputation: forward's torch.device(...) context, FSDP2's
        # parameters gathered (Note [Prefire of FSDP2-sharded blocks]), a
        # compiled block's program (Note [A compiled block's recomputation
        # program] in _compile.py).
        if "fsdp" not in self.forward:
            self.forward["fsdp"] = _fsdp.states_of(self.function)
        graph = self.forward.get("graph")
        if self.device is None and not self.forward["fsdp"] and graph is None:
            return self._call(tensors)
        with contextlib.ExitStack() as contexts:
            contexts.enter_context(_compile.recomputing(graph))
            if self.device is not None:
                contexts.enter_context(DeviceContext(self.device))
            if self.forward["fsdp"]:
                contexts.enter_context(_fsdp.gathered(self.forward["fsdp"]))
            return self._call(tensors)

    def _forward_tensors(self) -> List[torch.Tensor]:
        return [o for o in self.forward["flat"] if isinstance(o, torch.Tensor)]

    def _call(self, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        with set_in_block(_inside, "function", True):
            if self.spec is None:
                out = self.function(*tensors)
            else:
                values = list(self.leaves)
                for i, t in zip(self.where, tensors):
                    values[i] = t
                call_args, call_kwargs = pytree.tree_unflatten(values, self.spec)
                out = self.function(*call_args, **call_kwargs)
        if type(out) is torch.Tensor:
            flat, out_spec = [out], None
        else:
            flat, out_spec = pytree.tree_flatten(out)
        if "done" not in self.forward:  # a recomputation's outputs are dropped
            self.forward.update(done=True, flat=flat, spec=out_spec)
        return [o for o in flat if isinstance(o, torch.Tensor)]

    def outputs(self, tensors: List[torch.Tensor]) -> Any:
        """What ``function`` returned in forward, with the checkpoint's
        ``tensors`` in place of its tensors."""
        for i in self.where:  # recomputations get them from the checkpoint, which saved them through autograd
            self.leaves[i] = None
        flat, out_spec = self.forward.pop("flat"), self.forward.pop("spec")
        if out_spec is None:
            return tensors[0]
        returned = iter(tensors)
        flat = [next(returned) if isinstance(o, torch.Tensor) else o for o in flat]
        return pytree.tree_unflatten(flat, out_spec)


def checkpoint_sequential(functions, segments: int, input: torch.Tensor, use_reentrant: Optional[bool] = None,
                          **kwargs: Any) -> torch.Tensor:
    """``torch.utils.checkpoint.checkpoint_sequential`` over :func:`checkpoint`:
    runs ``functions`` (an ``nn.Sequential`` or a list of modules or
    functions, each taking and returning one tensor) on ``input`` in
    ``segments`` chunks, checkpointing every chunk but the last (which backward
    needs at once). ``kwargs`` go to every :func:`checkpoint` call."""
    if isinstance(functions, torch.nn.Sequential):
        functions = list(functions.children())
    check_options("prefire.checkpoint_sequential", dict(kwargs, use_reentrant=use_reentrant))
    if segments < 1:
        raise ValueError(f"prefire.checkpoint_sequential: segments must be >= 1, got {segments}")

    def run(chunk):
        def forward(x):
            for f in chunk:
                x = f(x)
            return x
        return forward

    size = len(functions) // segments
    starts = range(0, size * (segments - 1), size) if size > 0 else range(0)
    for start in starts:
        input = checkpoint(run(functions[start:start + size]), input, use_reentrant=use_reentrant, **kwargs)
    return run(functions[size * (segments - 1) if size > 0 else 0:])(input)


class CheckpointWrapper(torch_wrapper.CheckpointWrapper):
    """torch's ``CheckpointWrapper`` with :func:`checkpoint` as its
    checkpoint function: ``state_dict`` keys without the wrapper's prefix
    (a checkpoint saved with or without the wrapper loads into either),
    attribute lookups forwarded to the wrapped module, and recognised as a
    checkpoint wrapper by distributed checkpointing and FSDP.

    A module ``torch.compile`` made (``checkpoint_wrapper(torch.compile(layer))``)
    is run compiled, and the wrapper holds the module it compiled: keys,
    parameter names and attributes are the bare layer's, without
    ``_orig_mod.``, so checkpoints load into the unwrapped, uncompiled model
    and back."""

    def __init__(self, module: torch.nn.Module, **checkpoint_kwargs: Any) -> None:
        check_options("prefire.checkpoint_wrapper", checkpoint_kwargs)  # Note [Options that cannot be ignored]
        self._wrap(module, checkpoint, checkpoint_kwargs)

    def _wrap(self, module: torch.nn.Module, checkpoint_fn: Callable[..., Any], kwargs: Dict[str, Any]) -> None:
        compiled = None
        eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing was compiled
        if eval_frame is not None and isinstance(module, eval_frame.OptimizedModule):
            compiled, module = module, module._orig_mod
        torch_wrapper.CheckpointWrapper.__init__(self, module, torch_wrapper.CheckpointImpl.NO_REENTRANT,
                                                 checkpoint_fn, **kwargs)
        # Not a submodule (no keys of its own): it runs the wrapped module's parameters.
        self.__dict__["_prefire_compiled"] = compiled

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        compiled = self.__dict__["_prefire_compiled"]
        run = compiled if compiled is not None else self._checkpoint_wrapped_module
        return self.checkpoint_fn(run, *args, **kwargs)


def checkpoint_wrapper(module: torch.nn.Module, **checkpoint_kwargs: Any) -> CheckpointWrapper:
    """Wraps ``module`` so that its forward is checkpointed, like
    ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``;
    ``checkpoint_kwargs`` go to every :func:`checkpoint` call. Also usable as
    ``apply_activation_checkpointing``'s ``checkpoint_wrapper_fn``."""
    return CheckpointWrapper(module, **checkpoint_kwargs)
