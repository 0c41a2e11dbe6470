"""prefire where PyTorch users train: tensor subclasses, torch's
checkpoint_wrapper contract (state_dict, attributes,
apply_activation_checkpointing, distributed checkpointing's state-dict API),
torch's checkpoint nested inside prefire's and the other way round (with and
without sessions, through torch.distributed.pipelining's split backward),
torch.compile in both directions, use_reentrant=True and
set_checkpoint_early_stop. CPU, one intra-op thread (conftest.py).

Not covered here: DTensor (test_dtensor.py), transformers
(test_transformers.py), torch's own checkpoint tests (test_torch_contract.py),
CUDA."""

import warnings

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper as TorchCheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper as torch_checkpoint_wrapper,
)

import prefire
import prefire._checkpoint

from conftest import torch_release
from test_checkpoint import Block, OpCounter, assert_bit_equal, model
from test_schedule import runs, setup, split_step


def torch_non_reentrant(fn, *args, **kwargs):
    return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)


# ---- tensor subclasses ----------------------------------------------------------


class SinIsCos(torch.Tensor):
    """A __torch_function__ subclass whose type changes the math: sin is cos."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.sin, torch.sin):
            func = torch.cos
        return super().__torch_function__(func, types, args, kwargs or {})


def subclass_grad(wrap):
    torch.manual_seed(0)
    x = torch.randn(4, 3).as_subclass(SinIsCos).requires_grad_()
    seen = []

    def fn(a):
        seen.append(type(a))
        return (a.sin() * a).sum(-1)

    y = wrap(fn, x)
    # Backward from a plain tensor: Tensor.backward or autograd.grad with a
    # subclass argument runs the whole backward with subclass torch functions
    # disabled, recomputation included, and would hide what this test looks at.
    y.sum().as_subclass(torch.Tensor).backward()
    return x.grad, seen


@pytest.mark.parametrize("nested", [False, True], ids=["top-level", "nested"])
def test_recomputation_sees_the_subclass_forward_saw(nested):
    def prefire_wrap(fn, x):
        if nested:
            return prefire.checkpoint(lambda z: prefire.checkpoint(fn, z * 1), x)
        return prefire.checkpoint(fn, x)

    expected, _ = subclass_grad(lambda fn, x: fn(x))
    torch_grad, torch_seen = subclass_grad(lambda fn, x: torch_non_reentrant(fn, x))
    got, seen = subclass_grad(prefire_wrap)
    assert torch.equal(torch_grad, expected) and torch_seen == [SinIsCos, SinIsCos]
    assert seen == [SinIsCos, SinIsCos], "the recomputation ran on another type than forward"
    assert torch.equal(got, expected)


def test_recomputation_runs_on_forwards_input_objects():
    seen = []
    x = torch.randn(3, requires_grad=True)
    x.tag = "mine"  # a Python attribute only forward's own object has

    def fn(a):
        seen.append((a is x, getattr(a, "tag", None)))
        return a.sin()

    prefire.checkpoint(fn, x).sum().backward()
    assert seen == [(True, "mine"), (True, "mine")]


# ---- checkpoint_wrapper ------------------------------------------------------------


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(8)
        self.fc = torch.nn.Linear(8, 8)
        self.scale = 2.0

    def forward(self, x):
        return self.fc(self.ln(x)).relu() * self.scale


class Stack(torch.nn.Module):
    def __init__(self, n=2):
        super().__init__()
        self.layers = torch.nn.ModuleList(Tiny() for _ in range(n))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def wrap_layers(stack, wrapper):
    for i, layer in enumerate(stack.layers):
        stack.layers[i] = wrapper(layer)
    return stack


def test_checkpoint_wrapper_is_torchs_with_prefires_checkpoint():
    layer = Tiny()
    wrapped = prefire.checkpoint_wrapper(layer)
    assert isinstance(wrapped, TorchCheckpointWrapper)
    assert wrapped.ln is layer.ln and wrapped.scale == 2.0  # attribute lookups reach the wrapped module
    assert set(wrapped.state_dict()) == set(layer.state_dict())
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in layer.named_parameters()]
    x = torch.randn(4, 8, requires_grad=True)
    before = prefire.runtime_stats().recomputations
    wrapped(x).sum().backward()
    assert prefire.runtime_stats().recomputations - before == 1  # prefire's checkpoint ran it


def test_checkpoint_wrapper_state_dict_loads_both_ways():
    torch.manual_seed(0)
    wrapped = wrap_layers(Stack(), prefire.checkpoint_wrapper)
    torch.manual_seed(1)
    plain = Stack()
    # wrapped -> unwrapped
    missing, unexpected = plain.load_state_dict(wrapped.state_dict())
    assert not missing and not unexpected
    for (n, a), (m, b) in zip(wrapped.state_dict().items(), plain.state_dict().items()):
        assert n == m and torch.equal(a, b)
    # unwrapped -> wrapped, and a checkpoint saved with torch's wrapper
    torch.manual_seed(2)
    torch_wrapped = wrap_layers(Stack(), torch_checkpoint_wrapper)
    for source in (Stack(), torch_wrapped):
        missing, unexpected = wrapped.load_state_dict(source.state_dict())
        assert not missing and not unexpected
        for a, b in zip(wrapped.state_dict().values(), source.state_dict().values()):
            assert torch.equal(a, b)


def test_apply_activation_checkpointing_and_distributed_state_dict():
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    torch.manual_seed(0)
    stack = Stack(n=3)
    reference = Stack(n=3)
    reference.load_state_dict(stack.state_dict())
    apply_activation_checkpointing(stack, checkpoint_wrapper_fn=prefire.checkpoint_wrapper,
                                   check_fn=lambda m: isinstance(m, Tiny))
    assert all(isinstance(layer, prefire.CheckpointWrapper) for layer in stack.layers)
    state = get_model_state_dict(stack)
    assert set(state) == set(reference.state_dict())
    torch.manual_seed(3)
    fresh = Stack(n=3)
    set_model_state_dict(fresh, state)
    for a, b in zip(fresh.state_dict().values(), reference.state_dict().values()):
        assert torch.equal(a, b)
    x = torch.randn(5, 8)
    torch.autograd.grad(stack(x).sum(), list(stack.parameters()))
    expected = torch.autograd.grad(reference(x).sum(), list(reference.parameters()))
    assert_bit_equal(torch.autograd.grad(stack(x).sum(), list(stack.parameters())), expected)


# ---- nesting with torch's checkpoint ---------------------------------------------


NESTINGS = {
    "prefire-in-prefire": (prefire.checkpoint, prefire.checkpoint),
    "torch-in-prefire": (prefire.checkpoint, torch_non_reentrant),
    "prefire-in-torch": (torch_non_reentrant, prefire.checkpoint),
    "torch-in-torch": (torch_non_reentrant, torch_non_reentrant),
}


@pytest.mark.parametrize("mode", ["backward", "split", "split-session", "split-prefire"])
@pytest.mark.parametrize("nesting", list(NESTINGS))
def test_nesting_with_torchs_checkpoint(nesting, mode):
    """An outer checkpoint around a block and an op after it, the inner one
    around the block: gradients bit-equal to the unchecked block, through
    one backward or torch's split backward (B, then W per weight group), with
    and without a session shared by B and W."""
    outer, inner = NESTINGS[nesting]
    blocks, x, gy = setup()
    expected = split_step(blocks, lambda b, h: b(h).tanh(), x, gy)
    runs(blocks)

    def wrap(b, h):
        return outer(lambda z: inner(b, z).tanh(), h)

    if mode == "backward":
        torch.manual_seed(1)
        h = x
        for b in blocks:
            h = wrap(b, h)
        assert_bit_equal(torch.autograd.grad(h, [x, *blocks.parameters()], gy), expected)
        assert runs(blocks) == [3, 3]  # forward, the outer's recomputation, the inner's
        return
    if mode == "split":
        assert_bit_equal(split_step(blocks, wrap, x, gy), expected)
        return

    def scheduled(b, h):
        with prefire.collect() as handles:
            y = wrap(b, h)
        for handle in handles:
            if mode == "split-prefire":
                prefire.prefire(handle, 41)
            else:
                prefire.attach(handle, 41)
        return y

    got = split_step(blocks, scheduled, x, gy, prefire.session(41, retain_on_unpack=True), prefire.session(41))
    prefire.clear_session(41)
    assert_bit_equal(got, expected)
    counts = runs(blocks)
    if nesting in ("prefire-in-prefire", "prefire-in-torch"):
        # The block runs in forward and in one recomputation shared by B and W
        # (prefire-in-torch with prefire(): torch's recomputation of the outer
        # one, which prefire() triggers to get the inner's input, runs it once more).
        assert counts == ([3, 3] if nesting == "prefire-in-prefire" else [3 + (mode == "split-prefire")] * 2)
    elif nesting == "torch-in-prefire":
        # torch's inner checkpoint still recomputes once per graph task (B and
        # every weight group of W), from inputs the session holds for all of them.
        assert all(c > 3 for c in counts)


# ---- torch.compile ---------------------------------------------------------------


def compiled_grads(make, backend):
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = Block(dropout=0.0)
    module = make(block, backend)
    torch.manual_seed(1)
    x = torch.randn(2, 8, 32, requires_grad=True)
    y = module(x)
    return list(torch.autograd.grad(y.square().sum(), [x, *block.parameters()]))


COMPILED = {
    "torch's wrapper compiled": lambda b, be: torch.compile(torch_checkpoint_wrapper(b), backend=be),
    "prefire's wrapper compiled": lambda b, be: torch.compile(prefire.checkpoint_wrapper(b), backend=be),
    "model with prefire inside compiled": lambda b, be: torch.compile(
        lambda x: prefire.checkpoint(b, x) * 1.0, backend=be, fullgraph=True),
    "prefire around a compiled block": lambda b, be: prefire.checkpoint_wrapper(torch.compile(b, backend=be)),
}


@pytest.mark.parametrize("how", list(COMPILED))
def test_compile_with_aot_eager_equals_unchecked(how):
    expected = compiled_grads(lambda b, be: b, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = compiled_grads(COMPILED[how], "aot_eager")
    assert_bit_equal(got, expected)
    said = [w for w in caught if "prefire.checkpoint inside torch.compile" in str(w.message)]
    assert len(said) <= 1
    if how in ("prefire's wrapper compiled", "model with prefire inside compiled"):
        # once per process: another test may have said it already
        assert said or "compile" in prefire._warn_once.warned


def test_compile_with_inductor_close_to_torchs_checkpoint():
    expected = compiled_grads(COMPILED["torch's wrapper compiled"], "inductor")
    got = compiled_grads(COMPILED["prefire's wrapper compiled"], "inductor")
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def test_a_wrapped_compiled_layer_saves_and_loads_as_the_bare_layer():
    # checkpoint_wrapper(torch.compile(layer)), the recipe that keeps prefire's runtime around compiled math
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    wrapped = prefire.checkpoint_wrapper(torch.compile(layer, backend="aot_eager"))
    assert list(wrapped.state_dict()) == list(layer.state_dict())  # no _orig_mod., no wrapper prefix
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in layer.named_parameters()]
    assert wrapped[0] is layer[0]  # attribute lookups reach the bare layer
    torch.manual_seed(1)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    missing, unexpected = plain.load_state_dict(wrapped.state_dict())
    assert not missing and not unexpected
    missing, unexpected = wrapped.load_state_dict(plain.state_dict())
    assert not missing and not unexpected
    x = torch.randn(4, 8, requires_grad=True)
    before = prefire.runtime_stats().recomputations
    got = torch.autograd.grad(wrapped(x).sum(), [x, *layer.parameters()])
    assert prefire.runtime_stats().recomputations - before == 1  # prefire's checkpoint ran the compiled layer
    assert_bit_equal(list(got), list(torch.autograd.grad(layer(x).sum(), [x, *layer.parameters()])))


def test_prefire_around_a_compiled_block_shares_one_recomputation_between_b_and_w():
    blocks, x, gy = setup()
    expected = split_step(blocks, lambda b, h: b(h), x, gy)
    compiled = [torch.compile(b, backend="aot_eager") for b in blocks]
    runs(blocks)

    def scheduled(b, h):
        with prefire.collect() as handles:
            y = prefire.checkpoint(compiled[list(blocks).index(b)], h)
        for handle in handles:
            prefire.attach(handle, 42)
        return y

    before = prefire.runtime_stats().recomputations
    got = split_step(blocks, scheduled, x, gy, prefire.session(42, retain_on_unpack=True), prefire.session(42))
    stats = prefire.session_stats(42)
    prefire.clear_session(42)
    assert_bit_equal(got, expected)
    # one recomputation per block, shared by B and every weight group of W (the
    # blocks' own counters cannot see it: a recomputation stops inside the
    # compiled forward, before dynamo replays the counter's side effect)
    assert prefire.runtime_stats().recomputations - before == 2
    assert stats.lazy_recomputes == 2 and stats.hits > 2


# ---- selective activation checkpointing -------------------------------------------------


def test_selective_checkpointing_context_fn_keeps_what_it_selects():
    import functools

    x, w = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)

    def fn(a):
        return torch.mm(a.cos(), w).sin().sum()

    expected = torch.autograd.grad(fn(x), [x, w])
    context_fn = functools.partial(torch_checkpoint.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no FutureWarning about saved-tensor hooks around SAC
        with OpCounter(torch.ops.aten.mm.default) as mode:
            got = torch.autograd.grad(prefire.checkpoint(fn, x, context_fn=context_fn), [x, w])
    assert_bit_equal(got, expected)
    assert mode.count == 3  # forward, and backward's two; the recomputation reuses the cached product


def test_selective_checkpointing_recomputes_again_for_a_second_backward():
    """B and W without a shared session (a budget that lets go after B):
    the second recomputation finds the cache as forward left it, where
    torch's checkpoint raises "backward an extra time"
    (Note [Selective checkpointing inside prefire])."""
    import functools

    x, w = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)

    def fn(a):
        return torch.mm(torch.mm(a.cos(), w).sin(), w).sum()

    y = fn(x)
    with OpCounter(torch.ops.aten.mm.default) as unchecked:  # the products B and W compute themselves
        expected = torch.autograd.grad(y, [x], retain_graph=True) + torch.autograd.grad(y, [w])
    context_fn = functools.partial(torch_checkpoint.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    y = torch_checkpoint.checkpoint(fn, x, use_reentrant=False, context_fn=context_fn)
    torch.autograd.grad(y, [x], retain_graph=True)
    if torch_release() != (2, 11):  # 2.11 allows it (test_torch_differences.py)
        with pytest.raises(RuntimeError, match="backward an extra time"):
            torch.autograd.grad(y, [w])
    before = prefire.runtime_stats().recomputations
    y = prefire.checkpoint(fn, x, context_fn=context_fn)
    with OpCounter(torch.ops.aten.mm.default) as mode:
        (gx,) = torch.autograd.grad(y, [x], retain_graph=True)
        (gw,) = torch.autograd.grad(y, [w])
    assert prefire.runtime_stats().recomputations - before == 2
    assert_bit_equal((gx, gw), expected)
    assert mode.count == unchecked.count  # neither recomputation reran a cached product


def test_selective_checkpointings_cache_is_counted_in_the_meter_while_the_checkpoint_lives():
    import functools

    w, base = torch.randn(16, 16, requires_grad=True), torch.randn(16, 16, requires_grad=True)

    def fn(a):
        return torch.mm(torch.mm(a.cos(), w).sin(), w).sum()

    context_fn = functools.partial(torch_checkpoint.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    block = 16 * 16 * 4
    x = base * 1  # an activation: the checkpoint's input is counted
    with prefire.SavedTensorMeter() as meter:
        y = prefire.checkpoint(fn, x, context_fn=context_fn)
    assert meter.current_bytes == 3 * block  # its input and the two products SAC keeps
    assert prefire._checkpoint.checkpoint_bytes([x]) == 3 * block  # what the planners count for it
    y.backward()
    assert meter.current_bytes == 0  # gone with the checkpoint
    with prefire.SavedTensorMeter() as meter:  # inside another checkpoint: the outer one's inputs only
        y = prefire.checkpoint(lambda a: prefire.checkpoint(fn, a.exp(), context_fn=context_fn), base * 1)
    assert meter.current_bytes == block
    y.backward()


# ---- the rest of torch's calling convention ----------------------------------------------


def test_use_reentrant_true_warns_once_and_runs_prefires_checkpoint():
    prefire._warn_once.warned.discard("reentrant")
    x = torch.randn(4, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            y = prefire.checkpoint(torch.sin, x, use_reentrant=True)
    assert len([w for w in caught if "use_reentrant=True" in str(w.message)]) == 1
    before = prefire.runtime_stats().recomputations
    (g,) = torch.autograd.grad(y.sum(), [x])
    assert prefire.runtime_stats().recomputations - before == 1
    assert torch.equal(g, x.cos())


def test_set_checkpoint_early_stop_is_honoured():
    calls = []

    def fn(a):
        b = a.sin().exp()
        calls.append(1)  # after the last save: runs again only without early stop
        return b.clone()

    for setting, early_stop, runs_after in [(None, True, 1), (False, True, 2), (True, False, 1), (None, False, 2)]:
        calls.clear()
        x = torch.randn(3, requires_grad=True)
        if setting is None:
            y = prefire.checkpoint(fn, x, early_stop=early_stop)
        else:
            with torch_checkpoint.set_checkpoint_early_stop(setting):
                y = prefire.checkpoint(fn, x, early_stop=early_stop)
        y.sum().backward()
        assert len(calls) == runs_after, (setting, early_stop)
