"""prefire.compile: torch.compile (inductor) for a block prefire checkpoints,
whose recomputation runs only what the block's compiled backward reads."""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import tree_flatten

from . import _C
from ._thread_state import set_in_block
from ._warn_once import warn_once

# Note [A compiled block's recomputation program]
# prefire.checkpoint(torch.compile(block), x) drops what the compiled forward
# saves (AOTAutograd's forward graph returns the block's outputs, then the
# tensors its partitioner saved for the compiled backward, which
# CompiledFunction saves through save_for_backward, so through prefire's
# hooks) and recomputes them by running that forward again: all of it,
# outputs included, where torch's compiled checkpoint recomputes inside its
# backward only what the backward reads. On a GPT block the output path
# (the second MLP matmul) is a third of the block's matmul work, and early
# stop cannot stop inside one compiled graph.
#
# prefire.compile compiles with inductor as torch.compile does and, for each
# training forward graph, a second program: the same graph with the
# forward's returns removed, so that it returns the saved tensors only and
# dead-code elimination drops the output path, its outputs held to the
# strides the compiled forward gave them (the compiled backward was compiled
# for those). The compiled forward callable becomes _Forward, which runs the
# forward as before, except inside prefire's recomputation of a checkpoint
# whose function is that one graph: there it runs the program and hands
# AOTAutograd empty tensors of the forward returns' shapes in their place,
# so CompiledFunction saves the program's tensors, in forward's order,
# through the same hooks (prefire's recomputation reads them there), and
# the empty returns are never read: early stop ends the recomputation at
# the last save, and without it the recomputation's outputs are dropped.
# A recomputation runs with autocast's cast cache off (Note [Autocast's cast
# cache in recomputation] in src/checkpoint/state_capture.h), global state
# dynamo guards, so there the same code runs another cache entry, compiled
# alike: the graph that runs there uses its own program when that
# program's code and input layouts equal those of forward's graph
# (_fingerprint).
#
# That is exact only where nothing reads those returns during the
# recomputation, so a checkpoint uses the program only when, in its
# forward, exactly one prefire.compile graph ran and every tensor the
# checkpointed function returned is one of that graph's returns, as the
# graph's node returned it (a graph break after the graph, or eager code on
# its outputs, an in-place op included, fails this: the whole forward runs,
# as for torch.compile). Eager code that reads a return and whose result is
# dropped may save it; nothing unpacks what it saved. A graph gets no
# program (the whole forward runs) when it draws random numbers (the
# program would draw them differently), mutates an input outside the graph
# (AOTAutograd copies a forward return into it; updates inductor keeps in
# the graph, a BatchNorm's running statistics, are kept by dead-code
# elimination, so the program makes them as the whole forward does), has
# effect tokens or symbolic shapes. Each reason, a graph's or a
# checkpoint's, warns once. A program whose tensors differ in shape, stride
# or dtype from forward's raises a CheckpointError.
#
# Private torch parts read (checked by _check_torch at prefire.compile, and
# by tests/python/test_compile.py): inductor's compile_fx / compile_fx_inner
# and their boxed calling convention, TracingContext's fw_metadata
# (num_forward_returns, num_mutated_inp_runtime_indices, tokens) and
# output_strides, the output node's user_visible_output_idxs /
# original_output_strides, and functorch's autograd cache switches (off
# for these graphs: a cached forward would come back without its program).

# Note [A block no collector sees runs torch's compiled checkpoint]
# A checkpoint is shared by a session, or recomputed ahead, only through its
# handle, and a handle comes only from a prefire.collect() scope open around
# the checkpoint's forward (prefire.pipelining.enable and the plans open
# one). A prefire.compile'd block checkpointed with no collector open and
# inside no other prefire checkpoint can be neither: its backward recomputes
# it, once, as torch's compiled checkpoint does. There prefire's
# recomputation (Note [A compiled block's recomputation program]) costs
# more than torch's: it runs before the compiled backward and materializes
# every tensor that backward reads, where torch's partitioner recomputes
# inside the compiled backward, fused with the gradient kernels, each value
# when the backward reaches it (four GPT blocks on CPU inductor: 1.07x the
# step, 1.08x the step peak; docs/benchmarks.md). So there prefire.checkpoint
# runs torch's compiled checkpoint of the block: torch.compile of
# torch.utils.checkpoint(block, use_reentrant=False) with the checkpoint's
# options, under the block's inductor config and partitioner budget, compiled
# on first use (_TorchCheckpoint). Its gradients are torch's compiled
# checkpoint's, and prefire counts no recomputation (runtime_stats, the
# recompute observer): the compiled backward recomputes. Inside a collector
# the same block takes prefire's path, so a block collected in one step and
# not in the next is compiled both ways. A nested checkpoint always takes
# prefire's path, so that its forward and its recomputation inside the
# outer one's (where no collector is open) run the same program. An offloaded
# checkpoint (offload_to) always takes prefire's path: offloading is prefire's.
# A session scope around backward passes shares none of these blocks, and the
# runtime, which sees no recomputation, cannot say so as it does for
# checkpoints recomputed outside any session (Note [A session shares what is
# registered to it], src/session/session.h). So each such block's output
# counts the times backward reaches it (torch_path_backwards, a pre-hook on
# its grad_fn), and a prefire.session scope during which the count grew warns
# once, naming prefire.collect().

_state = threading.local()
_in_use = False  # no prefire.compile call yet: checkpoints skip all of this
program_runs = 0  # recomputations a program ran (tests and benchmarks read it)
torch_path_backwards = 0  # backward passes through a block run as torch's compiled checkpoint


def _count_torch_path_backward(grad_outputs: Any) -> None:
    global torch_path_backwards
    torch_path_backwards += 1


def in_use() -> bool:
    """Whether prefire.compile was called in this process (before, no
    checkpoint's forward looks for a compiled graph)."""
    return _in_use


def _without_program(why: str) -> None:
    warn_once(why, f"prefire.compile: {why}, so a prefire recomputation of it runs the whole compiled forward "
                   "(Note [A compiled block's recomputation program])")


def _check_torch() -> None:
    missing = []
    try:
        from torch._inductor import compile_fx as compile_fx_module
    except ImportError as error:
        raise RuntimeError(f"prefire.compile: torch {torch.__version__} has no torch._inductor.compile_fx "
                           f"({error}); use torch.compile(block) with prefire.checkpoint around it") from None
    for name in ("compile_fx", "compile_fx_inner"):
        if not hasattr(compile_fx_module, name):
            missing.append(f"torch._inductor.compile_fx.{name}")
    guards = torch._guards.TracingContext
    for name in ("try_get", "report_output_strides"):
        if not hasattr(guards, name):
            missing.append(f"torch._guards.TracingContext.{name}")
    from torch._functorch import config as functorch_config
    for name in ("enable_autograd_cache", "bundled_autograd_cache", "activation_memory_budget"):
        if not hasattr(functorch_config, name):
            missing.append(f"torch._functorch.config.{name}")
    if missing:
        raise RuntimeError(f"prefire.compile: torch {torch.__version__} lacks what it reads ({', '.join(missing)}); "
                           "use torch.compile(block) with prefire.checkpoint around it (Note [A compiled block's "
                           "recomputation program] in prefire/_compile.py)")


def _draws(node: torch.fx.Node) -> bool:
    """Whether ``node`` draws random numbers: an op tagged so, except an
    attention whose dropout_p is 0 (SDPA's kernels carry the tag)."""
    target = node.target
    if (node.op != "call_function" or not isinstance(target, torch._ops.OpOverload)
            or torch.Tag.nondeterministic_seeded not in target.tags):
        return False
    arguments = target._schema.arguments
    where = [i for i, a in enumerate(arguments) if a.name == "dropout_p"]
    if not where:
        return True
    i = where[0]
    p = node.kwargs["dropout_p"] if "dropout_p" in node.kwargs else (
        node.args[i] if i < len(node.args) else arguments[i].default_value)
    return p != 0


def _random(gm: torch.fx.GraphModule) -> bool:
    return any(_draws(node) for module in gm.modules() if isinstance(module, torch.fx.GraphModule)
               for node in module.graph.nodes)


def _returns(gm: torch.fx.GraphModule) -> Optional[int]:
    """How many of the forward graph's outputs are its returns (the rest are
    saved for backward), or None where no program can stand in for it."""
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None)
    if meta is None:
        _without_program("AOTAutograd compiled a forward graph with no forward metadata in reach")
        return None
    for name in ("num_forward_returns", "num_mutated_inp_runtime_indices", "tokens"):
        if not hasattr(meta, name):
            raise RuntimeError(f"prefire.compile: AOTAutograd's forward metadata has no {name} in torch "
                               f"{torch.__version__} (Note [A compiled block's recomputation program])")
    if meta.num_mutated_inp_runtime_indices or meta.tokens:
        _without_program("a forward graph mutates an input outside the graph or has effect tokens")
        return None
    outputs = gm.graph.find_nodes(op="output")[0].args[0]
    returns = meta.num_forward_returns
    if returns >= len(outputs):
        return None
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or any(not isinstance(s, int) for s in (*val.shape, *val.stride())):
            _without_program("a forward graph has symbolic shapes")
            return None
    if _random(gm):
        _without_program("a forward graph draws random numbers (dropout)")
        return None
    return returns


def _program_graph(gm: torch.fx.GraphModule, returns: int) -> torch.fx.GraphModule:
    """A copy of the forward graph that returns its saved values only."""
    graph = torch.fx.Graph()
    values: Dict[torch.fx.Node, torch.fx.Node] = {}
    outputs = graph.graph_copy(gm.graph, values)
    graph.output(tuple(outputs[returns:]))
    graph.eliminate_dead_code()
    return torch.fx.GraphModule(gm, graph)


def _fingerprint(gm: torch.fx.GraphModule, returns: int) -> str:
    """The program's code, its inputs' layouts and the forward's count of
    returns: two graphs with the same fingerprint compute the same saved
    tensors from the same inputs, behind as many returns."""
    inputs = [(tuple(v.shape), v.stride(), v.dtype, v.device) for v in
              (node.meta["val"] for node in gm.graph.find_nodes(op="placeholder"))]
    return f"{returns}\n{gm.code}\n{inputs}"


def _inner_compile(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
    from torch._inductor.compile_fx import compile_fx_inner
    if kwargs.get("is_backward") or kwargs.get("is_inference"):
        return compile_fx_inner(gm, example_inputs, **kwargs)
    returns = _returns(gm)
    program_gm = _program_graph(gm, returns) if returns is not None else None  # before inductor's passes change gm
    forward = compile_fx_inner(gm, example_inputs, **kwargs)
    if program_gm is None:
        return forward
    context = torch._guards.TracingContext.try_get()
    strides = list(context.output_strides or [])[returns:]
    output = program_gm.graph.find_nodes(op="output")[0]
    saved = output.args[0]
    if len(strides) != len(saved) or any(s is None for s in strides):
        _without_program("inductor reported no strides for a forward graph's saved tensors")
        return forward
    output.meta["original_output_strides"] = [tuple(int(x) for x in s) for s in strides]
    output.meta["user_visible_output_idxs"] = list(range(len(saved)))
    fingerprint = _fingerprint(program_gm, returns)  # before inductor's passes change program_gm
    with torch._guards.TracingContext.report_output_strides():
        program = compile_fx_inner(program_gm, example_inputs, **kwargs)
    return _Forward(forward, program, returns, fingerprint)


class _Forward:
    """A compiled training forward that runs its recomputation program in
    place of itself inside the recomputation of a checkpoint that chose it
    (Note [A compiled block's recomputation program]). Boxed: called with
    the list of its inputs, which it empties."""

    _boxed_call = True

    def __init__(self, forward: Callable[[List[Any]], Any], program: Callable[[List[Any]], Any], returns: int,
                 fingerprint: str) -> None:
        self.forward, self.program, self.returns, self.fingerprint = forward, program, returns, fingerprint
        self.layouts: Optional[List[Tuple[torch.Size, Tuple[int, ...], torch.dtype, torch.device]]] = None

    def __call__(self, args: List[Any]) -> Any:
        chosen = getattr(_state, "recompute", None)
        if chosen is not None and (chosen is self or chosen.fingerprint == self.fingerprint):
            _state.recompute = None
            return self._recompute(args, chosen)
        outputs = self.forward(args)
        if self.layouts is None:
            self.layouts = [(o.shape, o.stride(), o.dtype, o.device) if isinstance(o, torch.Tensor) else None
                            for o in outputs]
        calls = getattr(_state, "calls", None)
        if calls is not None:
            calls.append((self, {o.untyped_storage().data_ptr() for o in outputs[:self.returns]
                                 if isinstance(o, torch.Tensor)}))
        return outputs

    def _recompute(self, args: List[Any], chosen: "_Forward") -> List[Any]:
        saved = list(self.program(args))
        layouts = chosen.layouts
        assert layouts is not None  # a recomputation follows a forward
        for i, t in enumerate(saved):
            expect = layouts[self.returns + i]
            got = (t.shape, t.stride(), t.dtype, t.device) if isinstance(t, torch.Tensor) else None
            if got != expect:
                raise _C.CheckpointError(f"prefire.compile: the recomputation program's saved tensor {i} is {got}, the "
                                      f"compiled forward's was {expect} (Note [A compiled block's recomputation "
                                      "program])")
        global program_runs
        program_runs += 1
        # with forward's strides: AOTAutograd may take views of them (an output that aliases another)
        empty = [None if layout is None else torch.empty_strided(layout[0], layout[1], dtype=layout[2],
                                                                  device=layout[3])
                 for layout in layouts[:self.returns]]
        return empty + saved


class _Checkpointed(torch.nn.Module):
    """torch.utils.checkpoint(block, use_reentrant=False, **options), the
    module torch.compile traces for _TorchCheckpoint (one forward code for
    every block: dynamo keeps one cache entry for blocks alike)."""

    def __init__(self, block: Callable[..., Any], options: Dict[str, Any]) -> None:
        super().__init__()
        self.block, self.options = block, options

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self.block, *args, use_reentrant=False, **self.options, **kwargs)


class _TorchCheckpoint:
    """A prefire.compile'd block as torch's compiled checkpoint (Note [A
    block no collector sees runs torch's compiled checkpoint]): compiled
    once for each set of checkpoint options it is called with."""

    def __init__(self, model: Callable[..., Any], backend: "_Backend", fullgraph: bool,
                 dynamic: Optional[bool]) -> None:
        self.model, self.backend, self.fullgraph, self.dynamic = model, backend, fullgraph, dynamic
        self.compiled: Dict[Tuple[Tuple[str, Any], ...], Callable[..., Any]] = {}

    def __call__(self, options: Dict[str, Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        key = tuple(sorted(options.items()))
        run = self.compiled.get(key)
        if run is None:
            run = self.compiled[key] = torch.compile(_Checkpointed(self.model, options), backend=self.backend,
                                                     fullgraph=self.fullgraph, dynamic=self.dynamic)
        out = run(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                t.grad_fn.register_prehook(_count_torch_path_backward)
                break
        return out


_torch_checkpoints: "weakref.WeakKeyDictionary[Any, _TorchCheckpoint]" = weakref.WeakKeyDictionary()


def torch_checkpoint_of(function: Any) -> Optional[_TorchCheckpoint]:
    """``function`` as torch's compiled checkpoint, if prefire.compile made
    it (Note [A block no collector sees runs torch's compiled checkpoint])."""
    try:
        return _torch_checkpoints.get(function)
    except TypeError:  # not weakly referable, or unhashable: not one prefire.compile made
        return None


@contextlib.contextmanager
def forward_of(function_outputs: Callable[[], List[torch.Tensor]]) -> Iterator[List[Optional[_Forward]]]:
    """Around a checkpoint's forward: yields a one-element list that holds,
    after the block, the compiled graph whose program may recompute the
    checkpoint (None: the whole function runs again)."""
    chosen: List[Optional[_Forward]] = [None]
    calls: List[Tuple[_Forward, set]] = []
    with set_in_block(_state, "calls", calls):
        yield chosen
    if len(calls) > 1:
        _without_program("a checkpointed function ran more than one compiled graph (a graph break)")
    elif len(calls) == 1:
        graph, returned = calls[0]
        if all(_returned_as_is(t, returned) for t in function_outputs()):
            chosen[0] = graph
        else:
            _without_program("a checkpointed function returned other than its compiled graph's outputs as the graph "
                             "gave them (eager code on them, or an in-place op)")


def _returned_as_is(t: torch.Tensor, returned: set) -> bool:
    """Whether ``t`` is one of a graph's returns that no autograd op touched
    after the graph (an in-place op on it could have saved the return)."""
    return t.untyped_storage().data_ptr() in returned and (
        t.grad_fn is None or type(t.grad_fn).__name__ == "CompiledFunctionBackward")


def recomputing(graph: Optional[_Forward]) -> ContextManager[None]:
    """Around a checkpoint's recomputation: its compiled graph runs its program."""
    return set_in_block(_state, "recompute", graph) if graph is not None else contextlib.nullcontext()


def compile(model: Callable[..., Any], *, fullgraph: bool = False, dynamic: Optional[bool] = None,
            mode: Optional[str] = None, options: Optional[Dict[str, Any]] = None,
            activation_memory_budget: Optional[float] = None) -> Any:
    """``torch.compile(model)`` with inductor, for a block that
    :func:`prefire.checkpoint` (or :func:`prefire.checkpoint_wrapper`)
    checkpoints around it: forward and backward are torch.compile's, and the
    recomputation runs only the part of the compiled forward that computes
    the tensors its backward reads (torch.compile's whole forward otherwise).
    Note [A compiled block's recomputation program] in prefire/_compile.py.

    Checkpointed where no :class:`prefire.collect` is open (so that no
    session or :func:`prefire.prefire` can reach the checkpoint), the block
    runs as ``torch.compile`` of torch's checkpoint around it instead, with
    the same config: the compiled backward recomputes, fused, at torch's
    cost (Note [A block no collector sees runs torch's compiled checkpoint]).

    Args: those of ``torch.compile``; ``mode`` may not use CUDA graphs
    (``"reduce-overhead"``, ``"max-autotune"``). ``activation_memory_budget``
    (0 to 1, default torch's 1): the partitioner's
    ``torch._functorch.config.activation_memory_budget`` for these graphs:
    below 1 the compiled forward saves less and the compiled backward
    recomputes the rest inside itself, so prefire's recomputation program
    makes, and its backward holds, less.
    """
    _check_torch()
    if activation_memory_budget is not None and not 0 <= activation_memory_budget <= 1:
        raise ValueError(f"prefire.compile: activation_memory_budget must be in [0, 1], got "
                         f"{activation_memory_budget!r}")
    from torch._inductor import list_mode_options
    global _in_use
    _in_use = True
    config = dict(list_mode_options(mode, dynamic)) if mode is not None else {}
    config.update(options or {})
    if config.get("triton.cudagraphs"):
        raise ValueError(f"prefire.compile: mode={mode!r} / options use CUDA graphs, which prefire's recomputation "
                         "cannot replay; use mode='max-autotune-no-cudagraphs' or the default mode")

    compiled = torch.compile(model, backend=_Backend(config, activation_memory_budget), fullgraph=fullgraph,
                             dynamic=dynamic)
    _torch_checkpoints[compiled] = _TorchCheckpoint(
        model, _Backend(config, activation_memory_budget, programs=False), fullgraph, dynamic)
    return compiled


class _Backend:
    """Inductor with recomputation programs (without, for
    _TorchCheckpoint: ``programs=False``), under inductor's config patches
    ``config`` and the partitioner's ``budget``. Equal backends compare
    equal, as torch.compile's own do: dynamo keeps one cache entry of a code
    object (a block class's forward, shared by every block) per backend, so
    blocks compiled alike share one."""

    def __init__(self, config: Dict[str, Any], budget: Optional[float], programs: bool = True) -> None:
        self.config, self.budget, self.programs = config, budget, programs

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Backend) and (self.config, self.budget, self.programs) == (
            other.config, other.budget, other.programs)

    def __hash__(self) -> int:
        return hash((repr(sorted(self.config.items())), self.budget, self.programs))

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        from torch._functorch import config as functorch_config
        from torch._inductor.compile_fx import compile_fx
        patches: Dict[str, Any] = {} if self.budget is None else {"activation_memory_budget": self.budget}
        if not self.programs:
            with functorch_config.patch(**patches):
                return compile_fx(gm, example_inputs, config_patches=self.config or None)
        with functorch_config.patch(enable_autograd_cache=False, bundled_autograd_cache=False, **patches):
            return compile_fx(gm, example_inputs, inner_compile=_inner_compile, config_patches=self.config or None)
