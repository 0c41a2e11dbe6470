"""Weight gradients that B computed anyway: taken in B, so that W does not
run those autograd nodes again (used by :mod:`prefire.pipelining`).

Note [Weight gradients a custom Function computes in B]
torch's B (``stage_backward_input``) runs autograd towards the stage's inputs
only; its W (``stage_backward_weight``) runs it again from the param groups'
intermediates towards the weights. A built-in node computes in each pass only
the outputs that pass needs, so the split costs nothing. A custom
``autograd.Function`` (a ``BackwardCFunction`` node) computes all its outputs
whenever it runs, and a compiled block's whole backward is one such node
(AOTAutograd's ``CompiledFunctionBackward``): B runs it for the input
gradient and drops the weight gradients it computed, W runs it again for
those (and, under a checkpoint, recomputes again for it). So B keeps them:

1. Before B, a walk from the stage's outputs (as its forward returned them)
   finds, for each of the stage's parameters, every node with an edge to its
   ``AccumulateGrad``. A parameter whose every such node is a custom
   Function's is *taken in B*; those nodes get a post-hook for this B.
2. After B, each param group (of ``stage.backward_state``) whose every
   parameter is taken and whose every node ran in B gets the gradients the
   hooks saw, summed over the parameter's edges, added to ``.grad`` as torch's
   W adds them; the group is left with no intermediates, so W skips it and
   holds none of its nodes. Any other group is W's, untouched. torch's
   parts read here (``backward_state``, the groups' keys) are checked where
   they are read (``_hook_points.b_param_groups``).

So each compiled block's backward runs once per micro-batch, however it is
checkpointed: torch's compiled checkpoint (torchtitan's order) recomputes
once, inside B's compiled backward, and a prefire session around a compiled
block is not read by W at all (Note [What a session keeps for W] then trims
it after B).

The gradients are the ones W would compute: the same node's same program on
the same saved tensors and the same output gradients (B's, which torch's W
replays). They reach ``.grad`` at B rather than W; torch's W adds its own by
hand too, firing no gradient hooks, so only a reader of ``.grad`` between B
and W could tell. On an FSDP2 stage torch runs every B and W without
gradient sync, into the unsharded parameters' ``.grad`` (the AccumulateGrad
nodes' variables, which these are too), and reduces once after the stage's
last W (``perform_reduce_grad``); what B took is there by then, as W's would
be (bit-equal to torch's, tested on a one-rank mesh). Under a mixed-precision
policy whose reduce dtype differs, FSDP moves ``.grad`` into its
reduce-dtype sum at each later B's post-backward, so a gradient taken in B
is summed in the reduce dtype one micro-batch earlier than W's would be: a
rounding difference, not a lost gradient. Not done (the group stays W's):
the first stage (its B runs nothing), stages with a ``dw_builder``. A stage
whose first B finds no parameter taken walks no more (a stage's graph keeps
its shape between micro-batches).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch.autograd.function import BackwardCFunction
from torch.utils._pytree import tree_flatten

from ._hook_points import b_param_groups, leave_nothing_for_w

Edge = Tuple[Any, int]  # (autograd node, index of its output)


def _consumers(roots: List[Any], params: Set[int]) -> Dict[int, List[Edge]]:
    """id(parameter) -> every (node, output index) whose edge reaches its
    ``AccumulateGrad``, over the graph under ``roots``."""
    seen = set(roots)
    stack = list(roots)
    found: Dict[int, List[Edge]] = {}
    while stack:
        node = stack.pop()
        for index, (child, _) in enumerate(node.next_functions):
            if child is None:
                continue
            if type(child).__name__ == "AccumulateGrad":
                key = id(child.variable)
                if key in params:
                    found.setdefault(key, []).append((node, index))
                continue
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return found


class WeightGradsInB:
    """One stage's taking of weight gradients in B (Note [Weight gradients a
    custom Function computes in B])."""

    def __init__(self, stage: Any) -> None:
        self.stage = stage
        self.active = getattr(stage, "dw_builder", None) is None
        self.roots: Dict[int, List[Any]] = {}  # micro-batch -> grad_fns of its forward's output

    def forward_done(self, fwd_chunk_id: int, output: Any) -> None:
        """Remembers where the graph of a forward's output begins."""
        if self.active and not self.stage.is_first:
            tensors = tree_flatten(output)[0]
            self.roots[fwd_chunk_id] = [t.grad_fn for t in tensors
                                        if isinstance(t, torch.Tensor) and t.grad_fn is not None]

    def clear(self) -> None:
        self.roots.clear()

    def before_b(self, bwd_chunk_id: int, full: bool) -> Optional["_Capture"]:
        """Hooks the nodes whose weight gradients this B will take; None
        when this B takes none (``full``: a full backward, no W to spare)."""
        roots = self.roots.pop(bwd_chunk_id, None)
        if full or not self.active or not roots:
            return None
        params = {id(p) for p in self.stage.submod.parameters() if p.requires_grad}
        taken = {key: edges for key, edges in _consumers(roots, params).items()
                 if all(isinstance(node, BackwardCFunction) for node, _ in edges)}
        if not taken:
            self.active = False  # the stage's graph keeps its shape: no later B takes any either
            self.roots.clear()
            return None
        return _Capture(taken)

    def after_b(self, bwd_chunk_id: int, capture: Optional["_Capture"]) -> int:
        """Adds the taken gradients to ``.grad`` and leaves their groups to W
        with nothing to run; returns how many groups that was."""
        if capture is None:
            return 0
        taken = 0
        for group in b_param_groups(self.stage, bwd_chunk_id):
            params = [node.variable for node in group["params"]]
            grads = [capture.grad(p) for p in params]
            if any(g is _NOT_TAKEN for g in grads):
                continue
            for p, g in zip(params, grads):
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad += g
            leave_nothing_for_w(group)
            taken += 1
        return taken


_NOT_TAKEN = object()


class _Capture:
    """The post-hooks of one B and what they saw."""

    def __init__(self, taken: Dict[int, List[Edge]]) -> None:
        self.taken = taken
        self.seen: Dict[Any, tuple] = {}
        nodes = {node for edges in taken.values() for node, _ in edges}
        self.handles = [node.register_hook(self._hook(node)) for node in nodes]

    def _hook(self, node):
        def hook(grad_inputs, grad_outputs):
            self.seen[node] = grad_inputs
        return hook

    def remove_hooks(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def grad(self, p: torch.Tensor):
        """The gradient B's nodes computed for ``p`` (None: none flowed), or
        _NOT_TAKEN when ``p`` is not taken or a node of it did not run."""
        edges = self.taken.get(id(p))
        if edges is None or any(node not in self.seen for node, _ in edges):
            return _NOT_TAKEN
        total = None
        for node, index in edges:
            g = self.seen[node][index]
            if g is not None:
                total = g if total is None else total + g
        return total
