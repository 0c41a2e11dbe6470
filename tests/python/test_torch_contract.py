"""torch.utils.checkpoint's own CPU tests, re-expressed against prefire.

Each test here is one of PyTorch's non-reentrant checkpoint tests
(test/test_autograd.py: TestAutograd's checkpoint tests and
TestNestedCheckpoint; test/test_utils.py: TestCheckpoint), rewritten for
pytest with `checkpoint` bound to prefire.checkpoint and
`checkpoint_sequential` to prefire.checkpoint_sequential, and named as in
torch. Where prefire differs on purpose, the test asserts prefire's
behaviour and says why; docs/torch-contract.md lists every such difference.
Left out: tests of the reentrant variant only, and CUDA tests.
"""

import contextlib
import collections
import copy
import random
import weakref

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointError, set_checkpoint_early_stop
from torch.utils._python_dispatch import TorchDispatchMode

import prefire

from test_checkpoint import OpCounter

checkpoint = prefire.checkpoint
checkpoint_sequential = prefire.checkpoint_sequential


# ---- test_autograd.py: TestAutograd -------------------------------------------------


@pytest.mark.parametrize("enabled", [True, False])
def test_checkpointing_non_reentrant_autocast_cpu(enabled):
    def foo(x, y, z):
        x = torch.mm(x, y)
        y = torch.mm(x, z)
        z = torch.mm(z, z)
        assert z.dtype == (torch.bfloat16 if enabled else torch.float32)
        return z

    x, y, z = (torch.randn(3, 3, requires_grad=True) for _ in range(3))
    with torch.autocast("cpu", enabled=enabled, dtype=torch.bfloat16):
        loss = checkpoint(foo, x, y, z).sum()
    loss.backward()  # the recomputation must run under bf16 too, or autograd sees mismatched dtypes


def test_checkpointing_without_reentrant_custom_function_works():
    class MyFunc(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y, z):
            w = x * y * z
            out = w + w
            ctx.save_for_backward(x, y, z, w, out)
            return out

        @staticmethod
        def backward(ctx, grad_out):
            x, y, z, w, out = ctx.saved_tensors
            # a second read in the same backward: recomputed tensors are handed out once
            with pytest.raises(CheckpointError, match="unpacked a second time"):
                ctx.saved_tensors
            return x, y, z

    x, y, z = (torch.tensor(v, requires_grad=True) for v in (1.0, 2.0, 3.0))

    def foo(x, y, z):
        return MyFunc.apply(x * y * z, y * y * z, z * z)

    checkpoint(foo, x, y, z).sum().backward()


def test_checkpointing_without_reentrant_with_context_fn():
    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.operators = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.operators.append(func.__name__)
            return func(*args, **(kwargs or {}))

    x = torch.tensor(1.0, requires_grad=True)
    mode = Ops()
    checkpoint(lambda a: a.exp(), x, context_fn=lambda: (mode, contextlib.nullcontext()))
    assert mode.operators == ["exp.default"]
    mode.operators = []
    out = checkpoint(lambda a: a.exp(), x, context_fn=lambda: (contextlib.nullcontext(), mode))
    out.backward()
    assert mode.operators == ["exp.default", "detach.default"]  # the detach is autograd's, saving exp's output
    # Difference: use_reentrant=True runs prefire's non-reentrant checkpoint
    # (a warning says so), so context_fn works there too instead of raising.
    with pytest.warns(UserWarning, match="use_reentrant=True") if "reentrant" not in prefire._warn_once.warned \
            else contextlib.nullcontext():
        checkpoint(lambda a: a.sin(), x, use_reentrant=True, context_fn=lambda: (mode, contextlib.nullcontext()))


@pytest.mark.parametrize("use_group", [True, False])
def test_checkpoint_graph_execution_group(use_group):
    counter = [0]

    def fn(x):
        counter[0] += 1
        y = x.sin().cos()
        z = y.sin().cos()
        return y, z

    x = torch.randn(3, 3, requires_grad=True)
    y, z = checkpoint(fn, x)
    with torch.utils.checkpoint.GraphExecGroup() if use_group else contextlib.nullcontext():
        (grad_y,) = torch.autograd.grad(z, inputs=(y,), grad_outputs=(torch.ones(3, 3),))
        (grad_x,) = torch.autograd.grad(y, inputs=(x,), grad_outputs=(grad_y,))
    assert counter[0] == (2 if use_group else 3)


def test_checkpoint_graph_execution_group_overlapping_backwards_raise():
    x = torch.randn(3, 3, requires_grad=True)
    out = checkpoint(lambda a: a.sin().cos(), x)
    with torch.utils.checkpoint.GraphExecGroup():
        out.sum().backward(retain_graph=True)
        with pytest.raises(CheckpointError, match="GraphExecGroup"):
            out.sum().backward()


def non_deterministic(first, later):
    calls = [0]

    def fn(x):
        calls[0] += 1
        return first(x) if calls[0] == 1 else later(x)

    return fn


def save_3(x):
    return x.sin().exp().sin()


def save_2(x):
    return x.sin().exp()


def save_2_other_shape(x):
    return x.sin() * torch.tensor([1.0, 2.0])


def test_checkpoint_detects_non_determinism():
    a = torch.randn(1, requires_grad=True)
    with pytest.raises(CheckpointError, match="saved fewer tensors"):
        checkpoint(non_deterministic(save_3, save_2), a).backward()
    with set_checkpoint_early_stop(False):
        out = checkpoint(non_deterministic(save_2, save_3), a)
    with pytest.raises(CheckpointError, match="saved more tensors"):
        out.backward()
    # with early stop, the extra save is never reached in effect: no error, right gradients
    checkpoint(non_deterministic(save_2, save_3), a).backward()
    with pytest.raises(CheckpointError, match="differs between forward and recomputation") as caught:
        checkpoint(non_deterministic(save_2, save_2_other_shape), a).backward()
    assert 'determinism_check="none"' in str(caught.value)  # the option as Python spells it
    # Difference: debug=True (torch's operator traces in the error) is not supported.
    with pytest.raises(ValueError, match="debug"):
        checkpoint(save_2, a, debug=True)


def test_checkpoint_device_context_fn():
    # torch's test runs on CUDA; the meta device shows the same on CPU: the
    # recomputation creates its tensors under forward's torch.device context.
    def fn(x):
        return x.sin() * torch.ones(x.shape)  # created without a device: takes the context's

    x = torch.randn(4, requires_grad=True)
    with torch.device("cpu"):
        out = checkpoint(fn, x)
    with torch.device("meta"):  # another context when the recomputation runs must not matter
        saved = out.grad_fn._saved_other  # read outside backward: a recomputation of its own
    assert saved.device.type == "cpu"
    out.sum().backward()
    assert torch.equal(x.grad, x.cos())


def test_access_saved_tensor_twice_without_recomputation_works():
    count = [0]

    def foo(a):
        count[0] += 1
        b = a * a
        c = a * b
        return torch.exp(a)

    a = torch.randn(5, requires_grad=True)
    d = checkpoint(foo, a)
    assert count[0] == 1
    d.grad_fn._saved_result  # outside backward: a recomputation of its own, dropped at once
    assert count[0] == 2
    d.grad_fn._saved_result
    assert count[0] == 3
    d.sum().backward()
    assert count[0] == 4
    with pytest.raises(RuntimeError, match="after they have already been freed"):
        d.grad_fn._saved_result


@pytest.mark.parametrize("input_requires_grad", [True, False])
def test_checkpointing_without_reentrant(input_requires_grad):
    class Holder(nn.Module):  # keyword arguments reach the function
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, data):
            return self.module(data)

    module = Holder(nn.Sequential(nn.Linear(10, 100), nn.ReLU(), nn.Linear(100, 10)))
    module_copy = copy.deepcopy(module)
    checked, unchecked = [], []
    for _ in range(50):
        data = torch.rand(1, 10).requires_grad_(input_requires_grad)
        checked.append(checkpoint(module, data=data))
        unchecked.append(module_copy(data))
    torch.stack(checked).mean().backward()
    torch.stack(unchecked).mean().backward()
    for p, q in zip(module.parameters(), module_copy.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_checkpointing_without_reentrant_detached_tensor():
    class NoGrad(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(2, 2, bias=False)
            self.lin2 = nn.Linear(2, 2, bias=False)

        def forward(self, x):
            with torch.no_grad():
                return self.lin2(self.linear(x))

    module = NoGrad()
    a = torch.randn(2, 2, requires_grad=True)
    for _ in range(3):
        out = checkpoint(module, a)
        out += a
        out.sum().backward()


def test_checkpointing_without_reentrant_saved_object_identity():
    x_backward = None

    class Test(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            ctx.save_for_backward(y)
            return x

        @staticmethod
        def backward(ctx, x):
            nonlocal x_backward
            (x_backward,) = ctx.saved_tensors
            return x, None

    a = torch.tensor(1.0, requires_grad=True)
    b = torch.tensor(1.0, requires_grad=False)
    Test.apply(a, b).backward()
    assert x_backward is b
    x_backward = None
    checkpoint(Test.apply, a, b).backward()
    assert x_backward is b


def test_checkpointing_without_reentrant_correct_grad():
    a = torch.randn(2, 2, requires_grad=True)
    torch.exp(a).sum().backward()
    b_grad, a.grad = a.grad, None
    checkpoint(torch.exp, a).sum().backward()
    c_grad, a.grad = a.grad, None
    (d_grad,) = torch.autograd.grad(checkpoint(torch.exp, a).sum(), (a,))
    assert torch.equal(b_grad, c_grad) and torch.equal(b_grad, d_grad)


def test_checkpointing_without_reentrant_dataparallel():
    model = nn.Linear(2, 2, bias=False)
    a = torch.randn(2, 2, requires_grad=True)
    copy.deepcopy(model)(a).sum().backward()
    b_grad, a.grad = a.grad, None
    checkpoint(nn.DataParallel(copy.deepcopy(model)), a).sum().backward()
    assert torch.equal(b_grad, a.grad)


def test_checkpointing_without_reentrant_parameter_used_in_an_out():
    w = torch.randn(10, 10, requires_grad=True)
    count = [0]
    w.register_hook(lambda grad: count.__setitem__(0, count[0] + 1))
    x = torch.rand(10, 10, requires_grad=True)
    h = w * x  # w outside the checkpoint
    out = checkpoint(lambda a: w * a, h)  # and inside
    out.sum().backward()
    assert count[0] == 1


def test_checkpointing_without_reentrant_arbitrary_input_output():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(5, 5, bias=False)

        def forward(self, d):
            return {"result": self.layer(d["tensor"])}

    plain = Model()
    checked = copy.deepcopy(plain)
    inp = {"tensor": torch.randn(5, 5)}
    out_plain = plain(inp)["result"].sum()
    out_checked = checkpoint(checked, inp)["result"].sum()
    assert torch.equal(out_plain, out_checked)
    out_plain.backward()
    out_checked.backward()
    for p, q in zip(plain.parameters(), checked.parameters()):
        assert torch.equal(p.grad, q.grad)


# ---- test_autograd.py: TestNestedCheckpoint -----------------------------------------


def grad(fn):
    def wrapper(x):
        with torch.enable_grad():
            out = fn(x)
            (g,) = torch.autograd.grad(out, inputs=(x,), create_graph=True)
        return g

    return wrapper


def total(fn):
    return lambda x: fn(x).sum()


def ck(fn):
    return lambda *args, **kwargs: checkpoint(fn, *args, **kwargs)


def wrapped_variants(fn):
    """(function, variants of it wrapped in checkpoints and gradients in various ways)"""
    return (
        (fn, (ck(fn), ck(ck(fn)))),
        (grad(fn), (grad(ck(fn)), grad(ck(ck(fn))))),
        (grad(grad(fn)), (grad(ck(grad(fn))), ck(grad(grad(ck(fn)))), grad(ck(grad(ck(fn)))))),
        (grad(grad(grad(fn))), (grad(ck(grad(grad(ck(fn))))), grad(ck(grad(ck(grad(ck(fn)))))))),
    )


def assert_graph_dies(fn):
    def scope():
        a = torch.randn((), requires_grad=True)
        out = fn(a)
        refs, seen, queue = [], set(), collections.deque([out.grad_fn])
        while queue:
            node = queue.popleft()
            if node is None or node in seen:
                continue
            seen.add(node)
            marker = type("Marker", (), {})()
            node.metadata["marker"] = marker
            refs.append(weakref.ref(marker))
            queue.extend(f for f, _ in node.next_functions)
        return refs

    alive = [r for r in scope() if r() is not None]
    assert not alive, "nodes of the graph outlived it"


def f_plain(x):
    return x.sin().exp().sin()


def g_grads_inside(x):
    a = x.sin().exp().sin()
    b = x.sin().exp().sin()
    (ga,) = torch.autograd.grad(a, x)
    (gb,) = torch.autograd.grad(b, x)
    return x.sin()


@pytest.mark.parametrize("early_stop", [True, False])
@pytest.mark.parametrize("fn", [f_plain, g_grads_inside], ids=["plain", "backward-inside"])
def test_nested_checkpoint(fn, early_stop):
    with set_checkpoint_early_stop(early_stop):
        x = torch.randn((), requires_grad=True)
        for expected_fn, actual_fns in wrapped_variants(fn):
            expected = expected_fn(x)
            for actual_fn in actual_fns:
                assert torch.allclose(expected, actual_fn(x))
                assert_graph_dies(actual_fn)


@pytest.mark.parametrize("early_stop", [True, False])
def test_nested_checkpoint_two_children(early_stop):
    with set_checkpoint_early_stop(early_stop):
        def f(x):
            return x.sin().exp().sin()

        def g(x):
            return x.cos().sin().exp()

        def hc(x):
            return ck(g)(ck(f)(x))

        def h(x):
            return g(f(x))

        a = torch.randn(3, 3, requires_grad=True)
        expected = grad(total(grad(total(h))))(a)
        assert torch.allclose(expected, grad(total(grad(total(ck(hc)))))(a))
        assert torch.allclose(expected, grad(total(ck(grad(total(ck(hc))))))(a))
        assert_graph_dies(grad(ck(hc)))
        assert_graph_dies(grad(total(grad(total(ck(hc))))))
        assert_graph_dies(grad(total(ck(grad(total(ck(hc)))))))


@pytest.mark.parametrize("early_stop", [True, False])
def test_nested_checkpoint_non_tensor_inputs_and_outputs(early_stop):
    def fn(k, a, b, f):
        return f(k * a * b.exp()), 1, "abcd"

    k, a, b = 3, torch.tensor(2.0, requires_grad=True), torch.tensor(3.0, requires_grad=True)
    with set_checkpoint_early_stop(early_stop):
        out, one, text = checkpoint(fn, k, a, b, torch.sin)
    assert (one, text) == (1, "abcd")
    actual = torch.autograd.grad(out, (a, b))
    expected = torch.autograd.grad(fn(k, a, b, torch.sin)[0], (a, b))
    assert all(torch.allclose(g, e) for g, e in zip(actual, expected))


@pytest.mark.parametrize("early_stop", [True, False])
def test_nested_checkpoint_kwargs(early_stop):
    def fn(a, blah=None):
        out = a.sin().exp()
        if blah is not None:
            out = out * blah
        return out.sin().exp()

    a, b = torch.tensor(2.0, requires_grad=True), torch.tensor(3.0, requires_grad=True)
    with set_checkpoint_early_stop(early_stop):
        actual = torch.autograd.grad(checkpoint(fn, a, blah=b), (a, b))
        expected = torch.autograd.grad(fn(a, blah=b), (a, b))
    assert all(torch.allclose(g, e) for g, e in zip(actual, expected))


@pytest.mark.parametrize("early_stop", [True, False])
def test_nested_checkpoint_same_graph(early_stop):
    counter = [0]
    a = torch.tensor(1.0, requires_grad=True)
    with set_checkpoint_early_stop(early_stop):
        out = checkpoint(lambda t: t.sin().cos().sin(), a)
    out.grad_fn.next_functions[0][0].register_hook(lambda *_: counter.__setitem__(0, counter[0] + 1))
    out.backward()
    assert counter[0] == 1  # the hook sits on forward's graph, and backward runs forward's graph


@pytest.mark.parametrize("early_stop", [True, False])
def test_nested_checkpoint_reentrant_backwards(early_stop):
    def fn(a):
        x = a.sin().cos()
        return x, x.sin()

    def hook(*_):
        # another backward from inside this one, over the part below the hook
        x.backward(retain_graph=True)

    a = torch.tensor(1.0, requires_grad=True)
    with set_checkpoint_early_stop(early_stop):
        x, out = checkpoint(fn, a)
    out.grad_fn.register_hook(hook)
    out.backward(retain_graph=True)


def count_clone(counter):
    def fn(x):
        counter[0] += 1
        return x.clone()

    return fn


def test_nested_checkpoint_set_early_stop():
    def run(local=None, setting=None, nested_setting=None):
        counter = [0]
        clone = count_clone(counter)
        kwargs = {} if local is None else {"early_stop": local}
        a = torch.tensor(1.0, requires_grad=True)
        with set_checkpoint_early_stop(setting) if setting is not None else contextlib.nullcontext():
            with set_checkpoint_early_stop(nested_setting) if nested_setting is not None \
                    else contextlib.nullcontext():
                out = checkpoint(lambda x: clone(x.sin().cos()), a, **kwargs)
        out.backward()
        return counter[0]

    assert run() == 1  # on by default: clone saves nothing, so it does not run again
    assert run(local=False) == 2
    assert run(local=True) == 1
    assert run(setting=False) == 2  # the setting at forward decides, not at backward
    assert run(setting=True) == 1
    assert run(local=False, setting=False, nested_setting=True) == 1  # innermost setting wins
    assert run(local=True, setting=False) == 2  # the setting wins over the argument
    assert run(local=False, setting=True) == 1


def test_nested_checkpoint_set_early_stop_no_recompution_needed():
    def SinCounter():
        return OpCounter(torch.ops.aten.sin.default)

    counter = [0]

    def fn(x):
        counter[0] += 1
        return x.sin()

    # Only the input is saved, before sin's kernel: early stop skips the
    # kernel. Difference (docs/torch-contract.md): prefire does so for inputs
    # of at least 16384 elements, and lets a smaller kernel run again (it
    # costs less than the stop); torch skips it always (sins.count == 1 here).
    a = torch.tensor(1.0, requires_grad=True)
    with SinCounter() as sins:
        checkpoint(fn, a).sum().backward()
    assert counter[0] == 2 and sins.count == 2
    counter[0] = 0
    large = torch.randn(128, 128, requires_grad=True)
    with SinCounter() as sins:
        checkpoint(fn, large).sum().backward()
    assert counter[0] == 2 and sins.count == 1
    counter[0] = 0
    with SinCounter() as sins:
        with set_checkpoint_early_stop(False):
            out = checkpoint(fn, large)
        out.sum().backward()
    assert counter[0] == 2 and sins.count == 2
    # Nothing saved: nothing to recompute, whether or not early stop is on.
    for early_stop in (True, False):
        counter[0] = 0

        def clone(x):
            counter[0] += 1
            return x.clone()

        with set_checkpoint_early_stop(early_stop):
            out = checkpoint(clone, torch.tensor(1.0, requires_grad=True))
        out.backward()
        assert counter[0] == 1


# ---- test_utils.py: TestCheckpoint ------------------------------------------------------


def check_checkpoint_sequential(model, variants, chunks, inp):
    out = model(inp)
    expected_out = out.detach().clone()
    model.zero_grad()
    out.sum().backward()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    expected_input_grad = inp.grad.clone()
    for variant in variants:
        detached = inp.detach().requires_grad_()
        out = checkpoint_sequential(variant, chunks, detached)
        model.zero_grad()
        out.sum().backward()
        assert torch.equal(out.detach(), expected_out)
        assert torch.equal(detached.grad, expected_input_grad)
        for n, p in model.named_parameters():
            assert torch.equal(p.grad, expected_grads[n])


def test_checkpoint_trigger():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.counter = 0

        def forward(self, x):
            self.counter += 1
            return x * torch.tensor(2.0)

    modules = [Net() for _ in range(10)]
    out = checkpoint_sequential(modules, 2, torch.randn(3, 4, requires_grad=True))
    assert all(m.counter == 1 for m in modules)
    out.sum().backward()
    assert [m.counter for m in modules] == [2] * 5 + [1] * 5  # the last segment is not checkpointed


def sequential():
    return nn.Sequential(nn.Linear(100, 50), nn.ReLU(), nn.Linear(50, 20), nn.ReLU(), nn.Linear(20, 5), nn.ReLU())


def test_checkpoint_valid():
    model = sequential()
    x = torch.randn(1, 100, requires_grad=True)
    out = model(x)
    expected = torch.autograd.grad(outputs=[out], grad_outputs=[torch.ones(1, 5)], inputs=[x], create_graph=True)
    out_checked = checkpoint_sequential(list(model.children()), 2, x)
    assert torch.equal(out_checked, out)
    got = torch.autograd.grad(outputs=[out_checked], grad_outputs=[torch.ones(1, 5)], inputs=[x], create_graph=True)
    assert torch.equal(got[0], expected[0])


def test_checkpoint():
    model = sequential()
    check_checkpoint_sequential(model, [list(model.children()), model], 2, torch.randn(1, 100, requires_grad=True))


def test_checkpoint_module_list():
    class ModuleListNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.module_list = nn.ModuleList(sequential().children())

        def forward(self, x):
            for layer in self.module_list:
                x = layer(x)
            return x

    model = ModuleListNet()
    check_checkpoint_sequential(model, [list(model.module_list.children()), model.module_list], 2,
                                torch.randn(1, 100, requires_grad=True))


def test_checkpoint_rng_cpu():
    for _ in range(5):
        inp = torch.randn(20000).requires_grad_()
        phase1, phase2 = nn.Dropout(), nn.Dropout()
        state = torch.get_rng_state()
        checkpoint(phase2, phase1(inp)).sum().backward()
        with_checkpoint, inp.grad = inp.grad, None
        torch.set_rng_state(state)
        phase2(phase1(inp)).sum().backward()
        assert torch.equal(with_checkpoint, inp.grad)


def test_checkpoint_non_tensor():
    x = torch.randn(1, 100, requires_grad=True)
    checkpoint(lambda t1, t2: t1 if t2 is None else t1 + t2, x, None).sum().backward()


def foo_mixed(t1, t2, scale, t3):
    t4 = t1 + t2 * t3
    t5 = t1 * t2 + t3
    t4 *= scale
    t5 *= scale
    return scale, t4, None, True, t5, "bar", t1


def test_checkpoint_non_tensor_inputs_outputs():
    t1, t2, t3 = torch.rand(10, requires_grad=True), torch.rand(10, requires_grad=True), torch.rand(10)
    scale = random.randint(0, 10)
    res = checkpoint(foo_mixed, t1, t2, scale, t3)
    assert res[0] == scale and res[2] is None and res[3] is True and res[5] == "bar"
    assert torch.equal((t1 + t2 * t3) * scale, res[1]) and torch.equal((t1 * t2 + t3) * scale, res[4])
    assert torch.equal(t1, res[6])
    res[1].sum().backward(retain_graph=True)
    res[4].sum().backward(retain_graph=True)
    res[6].sum().backward()
    grads = (t1.grad, t2.grad)
    t1.grad = t2.grad = None
    res = foo_mixed(t1, t2, scale, t3)
    torch.autograd.backward([res[1].sum(), res[4].sum(), res[6].sum()])
    # one backward against three: the gradients accumulate in another order
    torch.testing.assert_close(t1.grad, grads[0])
    torch.testing.assert_close(t2.grad, grads[1])


def test_checkpoint_no_tensors():
    t1, t2, t3 = random.random(), random.random(), random.random()
    scale = random.randint(0, 10)
    res = checkpoint(foo_mixed, t1, t2, scale, t3)
    assert res == foo_mixed(t1, t2, scale, t3)


def test_checkpoint_partial_grad():
    x = torch.randn(1, 4, requires_grad=True)
    out = checkpoint(lambda t1, t2: (t1, t2), x, torch.randn(1, 4))
    out[0].sum().backward()
    # torch's reentrant variant raises "none of output has requires_grad=True"
    # here; the non-reentrant one (and prefire) returns an output that needs no grad.
    out = checkpoint(lambda t1, t2: t1, torch.randn(1, 4), torch.randn(1, 4, requires_grad=True))
    assert not out.requires_grad
