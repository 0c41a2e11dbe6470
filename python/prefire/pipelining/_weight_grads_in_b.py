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
3. Held until B ends, the gradients of a stage's first blocks would live
   through the backward of the rest (on the pipeline program's compiled
   ZBV, B's peak 1.5 MiB above torch's W's, which adds each group's as it
   goes, and rank 0's step peak 1.02x torch's compiled checkpoint's; added
   as they come, B's peak is torch's B's). So a hook adds them to
   ``.grad`` in B, as soon as it may: for a set of taken parameters that
   share no node with any other parameter (a compiled block's), once every
   node of the set has run. That set is exactly one of torch's param
   groups: a node that ran in B is on the way to the stage's inputs, where
   ``_get_param_groups`` stops, so a group is the parameters that share
   those nodes. After B such a group is only left with nothing for W; one
   that held both parameters added in B and others would have W add the
   former again, and raises instead.

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
reduce-dtype sum at each B's post-backward, so a gradient taken in B is
summed in the reduce dtype sooner than W's would be: a rounding
difference, not a lost gradient. Not done (the group stays W's):
the first stage (its B runs nothing), stages with a ``dw_builder``. A stage
whose first B finds no parameter taken walks no more (a stage's graph keeps
its shape between micro-batches).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch.autograd.function import BackwardCFunction
from torch.utils._pytree import tree_flatten

from .._warn_once import warn_once, warned
from ._hook_points import b_param_groups, leave_nothing_for_w

# Note [Parameters torch's W gives no gradient]
# torch's B (stage_backward_input) groups the parameters that
# stage.submod.parameters() yields when B begins; its W computes gradients
# for those groups only, each added to the parameter with the same
# AccumulateGrad among those stage.submod.parameters() yields when W
# begins. A parameter the graph reaches that is not among them gets no
# gradient, silently. That happens two ways:
#   * FSDP2. A module in the stage fully_shard'ed with
#     reshard_after_forward=True (fully_shard's default; torchtitan's only
#     without pipelining or with fsdp_reshard_after_forward="always") has
#     resharded when B begins unless a backward gathered it since its
#     forward: parameters() yields its sharded DTensors, and the graph's
#     AccumulateGrad nodes hold the unsharded parameters. torch 2.11 to
#     2.15 lose those gradients under their own split: on a one-rank ZBV
#     of such blocks the split stage's parameters get none, eager or
#     compiled; on an interleaved zero bubble schedule, PP=2 x FSDP=2, the
#     last stage's every micro-batch's and the middle stages' about half.
#     So ``enable`` gathers the stage's resharded FSDP modules
#     (FSDPModule.unshard(), public) before each split B and each W, and
#     both find the parameters the graph holds. B's pre-backward hooks
#     would gather them during B anyway, and torch's pipelining keeps them
#     gathered after it (reshard_after_backward=False until the step's
#     reduce): the same all-gathers, a little sooner (the stage's blocks
#     are all gathered from B's start, not from each block's backward
#     on). A W gathers only when a forward resharded the module since its
#     B (a recomputation in W needs the parameters too). Every rank of the
#     FSDP group runs the schedule's actions in the same order, so the
#     collectives match.
#   * A parameter the stage's forward uses that its module does not
#     register (one another module holds, or a closure's): nothing to
#     gather. So the first split B of each stage records the nn.Parameters
#     its graph reaches, and every split B compares torch's groups with
#     them (a set difference), warning once when some are in none.

Edge = Tuple[Any, int]  # (autograd node, index of its output)


def _consumers(roots: List[Any]) -> Tuple[Dict[int, List[Edge]], Dict[int, torch.Tensor]]:
    """id(leaf) -> every (node, output index) whose edge reaches its
    ``AccumulateGrad``, over the graph under ``roots``; and id(leaf) -> the
    leaf."""
    seen = set(roots)
    stack = list(roots)
    found: Dict[int, List[Edge]] = {}
    leaves: Dict[int, torch.Tensor] = {}
    while stack:
        node = stack.pop()
        for index, (child, _) in enumerate(node.next_functions):
            if child is None:
                continue
            if type(child).__name__ == "AccumulateGrad":
                key = id(child.variable)
                found.setdefault(key, []).append((node, index))
                leaves[key] = child.variable
                continue
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return found, leaves


class WeightGradsInB:
    """One stage's taking of weight gradients in B (Note [Weight gradients a
    custom Function computes in B])."""

    def __init__(self, stage: Any) -> None:
        self.stage = stage
        self.active = getattr(stage, "dw_builder", None) is None
        # Note [Parameters torch's W gives no gradient]: the nn.Parameters the stage's first split B's graph
        # reaches (the graph keeps its shape between micro-batches), which every split B compares with torch's
        # param groups until one warns
        self.unchecked = True
        self.graph_params: Optional[Dict[int, torch.Tensor]] = None
        self.roots: Dict[int, List[Any]] = {}  # micro-batch -> grad_fns of its forward's output

    def forward_done(self, fwd_chunk_id: int, output: Any) -> None:
        """Remembers where the graph of a forward's output begins."""
        if (self.active or self.unchecked) and not self.stage.is_first:
            tensors = tree_flatten(output)[0]
            self.roots[fwd_chunk_id] = [t.grad_fn for t in tensors
                                        if isinstance(t, torch.Tensor) and t.grad_fn is not None]

    def clear(self) -> None:
        self.roots.clear()

    def before_b(self, bwd_chunk_id: int, full: bool) -> Optional["_Capture"]:
        """Hooks the nodes whose weight gradients this B will take; None
        when this B takes none (``full``: a full backward, no W to spare)."""
        roots = self.roots.pop(bwd_chunk_id, None)
        if full or not roots or not (self.active or self.unchecked):
            return None
        found, leaves = _consumers(roots)
        if self.unchecked:
            self.unchecked = False
            self.graph_params = {key: v for key, v in leaves.items() if isinstance(v, torch.nn.Parameter)}
        if not self.active:
            return None
        params = {id(p): p for p in self.stage.submod.parameters() if p.requires_grad}
        found = {key: edges for key, edges in found.items() if key in params}
        taken = {key: edges for key, edges in found.items()
                 if all(isinstance(node, BackwardCFunction) for node, _ in edges)}
        if not taken:
            self.active = False  # the stage's graph keeps its shape: no later B takes any either
            self.roots.clear()
            return None
        whole = [(keys, nodes) for keys, nodes in _sharing(found) if keys <= taken.keys()]
        return _Capture(taken, params, whole)

    def after_b(self, bwd_chunk_id: int, capture: Optional["_Capture"]) -> int:
        """Adds the taken gradients to ``.grad`` and leaves their groups to W
        with nothing to run; returns how many groups that was."""
        if self.graph_params is not None and "params-w-misses" not in warned:
            self._check_groups(b_param_groups(self.stage, bwd_chunk_id))
        if capture is None:
            return 0
        taken = 0
        for group in b_param_groups(self.stage, bwd_chunk_id):
            params = [node.variable for node in group["params"]]
            added = [id(p) in capture.added for p in params]
            if any(added) and not all(added):
                raise RuntimeError(
                    f"prefire.pipelining: stage {self.stage.stage_index}'s B added the weight gradients of "
                    f"{sum(added)} of a param group's {len(params)} parameters, and W would compute the group's "
                    "again; torch grouped the parameters otherwise than Note [Weight gradients a custom Function "
                    "computes in B] expects")
            if not all(added):
                grads = [capture.grad(p) for p in params]
                if any(g is _NOT_TAKEN for g in grads):
                    continue
                for p, g in zip(params, grads):
                    _accumulate(p, g)
            leave_nothing_for_w(group)
            taken += 1
        return taken

    def _check_groups(self, groups: List[Dict[str, Any]]) -> None:
        """Warns when the graph reaches parameters no param group holds
        (Note [Parameters torch's W gives no gradient])."""
        grouped = {id(node.variable) for group in groups for node in group["params"]}
        lost = [p for key, p in (self.graph_params or {}).items() if key not in grouped]
        if lost:
            warn_once(
                "params-w-misses",
                f"prefire.pipelining: stage {self.stage.stage_index}'s backward reaches {len(lost)} parameters "
                f"(shapes {sorted({tuple(p.shape) for p in lost})}) that torch's B put in no param group, so its W "
                "computes no gradient for them: a micro-batch split into B and W adds none to theirs. torch groups "
                "the parameters stage.submod.parameters() gives as B begins; register every parameter the stage's "
                "forward uses in its module (Note [Parameters torch's W gives no gradient] in "
                "prefire/pipelining/_weight_grads_in_b.py)")


def _accumulate(p: torch.Tensor, g: Optional[torch.Tensor]) -> None:
    """``p.grad += g``, as torch's W adds a weight's gradient."""
    if g is None:
        return
    if p.grad is None:
        p.grad = g
    else:
        p.grad += g


def _sharing(found: Dict[int, List[Edge]]) -> List[Tuple[Set[int], Set[Any]]]:
    """The parameters (keys of ``found``) that share a node, transitively,
    and their nodes: each set with no node in common with another."""
    of_node: Dict[Any, Set[int]] = {}
    for key, edges in found.items():
        for node, _ in edges:
            of_node.setdefault(node, set()).add(key)
    out: List[Tuple[Set[int], Set[Any]]] = []
    placed: Set[int] = set()
    for first in found:
        if first in placed:
            continue
        keys: Set[int] = set()
        nodes: Set[Any] = set()
        stack = [first]
        while stack:
            key = stack.pop()
            if key in keys:
                continue
            keys.add(key)
            for node, _ in found[key]:
                if node not in nodes:
                    nodes.add(node)
                    stack.extend(of_node[node] - keys)
        placed |= keys
        out.append((keys, nodes))
    return out


_NOT_TAKEN = object()


class _Capture:
    """The post-hooks of one B and what they saw."""

    def __init__(self, taken: Dict[int, List[Edge]], params: Dict[int, torch.Tensor],
                 whole: List[Tuple[Set[int], Set[Any]]]) -> None:
        self.taken, self.params = taken, params
        self.seen: Dict[Any, Dict[int, Optional[torch.Tensor]]] = {}
        self.added: Set[int] = set()  # parameters whose gradients a hook added to .grad (step 3 of the Note)
        # node -> the sets of parameters it completes, each [keys, nodes yet to run]
        self.waiting: Dict[Any, List[List[Any]]] = {}
        for keys, nodes in whole:
            entry = [keys, set(nodes)]
            for node in nodes:
                self.waiting.setdefault(node, []).append(entry)
        kept: Dict[Any, Set[int]] = {}  # node -> the indices of its gradients that go to taken parameters
        for edges in taken.values():
            for node, index in edges:
                kept.setdefault(node, set()).add(index)
        self.handles = [node.register_hook(self._hook(node, indices)) for node, indices in kept.items()]

    def _hook(self, node, indices: Set[int]):
        def hook(grad_inputs, grad_outputs):
            # the weights' gradients only: the input's goes on to the next node
            self.seen[node] = {i: grad_inputs[i] for i in indices}
            for keys, left in self.waiting.get(node, ()):
                left.discard(node)
                if not left:
                    self._add(keys)
        return hook

    def _add(self, keys: Set[int]) -> None:
        """Adds a set's gradients to ``.grad`` and lets go of them."""
        for key in keys:
            p = self.params[key]
            _accumulate(p, self.grad(p))
            self.added.add(key)
        for key in keys:
            for node, _ in self.taken[key]:
                self.seen.pop(node, None)

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
