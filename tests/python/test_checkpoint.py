"""prefire.checkpoint against unchecked PyTorch and torch.utils.checkpoint, in
one process, on CPU. Bit-equality pins what the bits depend on: seeds and one
intra-op thread (set in conftest.py for every test and in every thread a test
starts)."""

import gc
import threading
import weakref

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import prefire


class Block(torch.nn.Module):
    """A GPT block: pre-norm attention and MLP, dropout on both branches."""

    def __init__(self, dim=32, heads=4, dropout=0.1):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.ln2 = torch.nn.LayerNorm(dim)
        self.fc1 = torch.nn.Linear(dim, 4 * dim)
        self.fc2 = torch.nn.Linear(4 * dim, dim)
        self.dropout = dropout

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5).softmax(-1)
        h = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + F.dropout(self.proj(h), self.dropout, self.training)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), self.dropout, self.training)


def model(blocks=2, seed=0):
    torch.manual_seed(seed)
    return torch.nn.ModuleList(Block() for _ in range(blocks))


def run(blocks, x, wrap):
    h = x
    for b in blocks:
        h = wrap(b, h)
    return h


def plain(b, h):
    return b(h)


def with_prefire(b, h):
    return prefire.checkpoint(b, h)


def with_torch(b, h):
    return torch_checkpoint.checkpoint(b, h, use_reentrant=False)


def grads(blocks, wrap, seed=1, x=None):
    x = torch.randn(2, 8, 32, requires_grad=True) if x is None else x
    torch.manual_seed(seed)
    y = run(blocks, x, wrap)
    return torch.autograd.grad(y.square().sum(), [x, *blocks.parameters()])


def assert_bit_equal(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


def test_gpt_blocks_with_dropout_match_unchecked_and_torch_bit_for_bit():
    blocks = model()
    torch.manual_seed(5)
    x = torch.randn(2, 8, 32, requires_grad=True)
    expected = grads(blocks, plain, x=x)
    before = prefire.runtime_stats().recomputations
    assert_bit_equal(grads(blocks, with_prefire, x=x), expected)
    assert prefire.runtime_stats().recomputations - before == 2
    assert_bit_equal(grads(blocks, with_torch, x=x), expected)


def test_positional_keyword_and_non_tensor_arguments_and_nested_outputs():
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)

    def fn(a, pair, *, scale, name, weights=None):
        assert name == "block" and pair[1] == "tag"
        y = (a @ weights["w"]).sin() * scale + pair[0].cos()
        return {"out": y, "extra": (y.exp(), None, 7), "name": name}

    def args():
        return (x, (x * 2, "tag"))

    kwargs = dict(scale=3.0, name="block", weights={"w": w})
    expected_out = fn(*args(), **kwargs)
    expected = torch.autograd.grad(expected_out["out"].sum() + expected_out["extra"][0].sum(), [x, w])
    out = prefire.checkpoint(fn, *args(), **kwargs)
    assert out["name"] == "block" and out["extra"][1] is None and out["extra"][2] == 7
    got = torch.autograd.grad(out["out"].sum() + out["extra"][0].sum(), [x, w])
    assert_bit_equal(got, expected)


def test_nested_checkpoints_match_unchecked():
    blocks = model(blocks=3)
    x = torch.randn(2, 8, 32, requires_grad=True)
    expected = grads(blocks, plain, x=x)

    def nest(h):  # an outer checkpoint around blocks 1 and 2, block 1 checkpointed inside it
        return blocks[2](prefire.checkpoint(blocks[1], h))

    torch.manual_seed(1)
    y = prefire.checkpoint(nest, prefire.checkpoint(blocks[0], x))
    assert_bit_equal(torch.autograd.grad(y.square().sum(), [x, *blocks.parameters()]), expected)


def test_cpu_bf16_autocast_matches_torch():
    blocks = model()
    x = torch.randn(2, 8, 32, requires_grad=True)

    def under_autocast(wrap):
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = run(blocks, x, wrap)
        return torch.autograd.grad(y.float().square().sum(), [x, *blocks.parameters()])

    expected = under_autocast(plain)
    assert_bit_equal(under_autocast(with_prefire), expected)
    assert_bit_equal(under_autocast(with_torch), expected)


def test_partial_backward_and_retain_graph():
    blocks = model()
    x = torch.randn(2, 8, 32, requires_grad=True)
    torch.manual_seed(1)
    y_ref = run(blocks, x, plain)
    expected_x = torch.autograd.grad(y_ref.sum(), [x], retain_graph=True)
    expected_w = torch.autograd.grad(y_ref.sum(), [blocks[0].fc1.weight])
    torch.manual_seed(1)
    y = run(blocks, x, with_prefire)
    assert_bit_equal(torch.autograd.grad(y.sum(), [x], retain_graph=True), expected_x)
    assert_bit_equal(torch.autograd.grad(y.sum(), [blocks[0].fc1.weight]), expected_w)


def test_backward_on_another_thread():
    blocks = model()
    x = torch.randn(2, 8, 32, requires_grad=True)
    expected = grads(blocks, plain, x=x)
    torch.manual_seed(1)
    y = run(blocks, x, with_prefire)
    result = {}

    def backward():
        torch.set_num_threads(1)
        result["g"] = torch.autograd.grad(y.square().sum(), [x, *blocks.parameters()])

    t = threading.Thread(target=backward)
    t.start()
    t.join()
    assert_bit_equal(result["g"], expected)


def torch_non_reentrant(f, a):
    return torch_checkpoint.checkpoint(f, a, use_reentrant=False)


# Both raise torch's CheckpointError when the recomputation saves tensors of
# other shapes, and when it saves more than forward did without early stop
# (with early stop, both stop at forward's count and let it pass:
# test_torch_contract.py).
def without_early_stop(fn, *args):
    return prefire.checkpoint(fn, *args, early_stop=False)


@pytest.mark.parametrize(
    "wrap, second_run",
    [(prefire.checkpoint, "other shapes"), (torch_non_reentrant, "other shapes"), (without_early_stop, "more saves")],
    ids=["prefire-other-shapes", "torch-other-shapes", "prefire-more-saves-without-early-stop"])
def test_recomputation_that_differs_raises_torchs_checkpoint_error(wrap, second_run):
    x = torch.randn(4, 4, requires_grad=True)
    calls = []

    def changes(a):
        calls.append(1)
        if len(calls) == 1:
            return a.sin()
        return a.sin().cos() if second_run == "more saves" else a[:2].sin()

    y = wrap(changes, x)
    with pytest.raises(torch_checkpoint.CheckpointError):
        y.sum().backward()
    assert issubclass(prefire.CheckpointError, torch_checkpoint.CheckpointError)


def test_misuse_raises_before_running():
    x = torch.randn(2, requires_grad=True)
    with pytest.raises(ValueError, match="determinism_check"):
        prefire.checkpoint(torch.sin, x, determinism_check="bits")


def test_exception_in_recomputation_reaches_backward_with_its_type():
    x = torch.randn(4, requires_grad=True)
    calls = []

    def fails_again(a):
        calls.append(1)
        if len(calls) > 1:
            raise KeyError("recompute failed")
        return a.exp()

    y = prefire.checkpoint(fails_again, x)
    with pytest.raises(KeyError, match="recompute failed"):
        y.sum().backward()


def test_early_stop_skips_the_tail_even_under_except_exception():
    x = torch.randn(4, requires_grad=True)
    tail = []

    def fn(a):
        try:
            y = a.sin().exp()  # the last save: exp's output
        except Exception:  # must not swallow the stop
            raise AssertionError("early stop surfaced as an Exception")
        tail.append(1)
        return y * 2  # an autograd node after the last save: stopping pays

    y = prefire.checkpoint(fn, x)
    y.sum().backward()
    assert len(tail) == 1
    tail.clear()
    y = prefire.checkpoint(fn, x, early_stop=False)
    y.sum().backward()
    assert len(tail) == 2


def test_context_fn_wraps_forward_and_recompute():
    events = []

    class Ctx:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            events.append("enter " + self.name)

        def __exit__(self, *exc):
            events.append("exit " + self.name)

    x = torch.randn(4, requires_grad=True)
    y = prefire.checkpoint(torch.sin, x, context_fn=lambda: (Ctx("forward"), Ctx("recompute")))
    y.sum().backward()
    assert events == ["enter forward", "exit forward", "enter recompute", "exit recompute"]


def test_checkpoint_wrapper_module():
    blocks = model(blocks=1)
    x = torch.randn(2, 8, 32, requires_grad=True)
    expected = grads(blocks, plain, x=x)
    wrapped = prefire.checkpoint_wrapper(blocks[0])
    torch.manual_seed(1)
    y = wrapped(x)
    assert_bit_equal(torch.autograd.grad(y.square().sum(), [x, *blocks.parameters()]), expected)


def test_nothing_stays_alive_once_the_graph_is_gone():
    x = torch.randn(4, requires_grad=True)
    h = x * 2
    inputs = weakref.ref(h)
    y = prefire.checkpoint(lambda a, scale: {"y": (a * scale).sin()}, h, scale=2.0)["y"]
    outputs = weakref.ref(y)
    del h
    y.sum().backward()
    del y
    gc.collect()
    assert inputs() is None and outputs() is None


class OpCounter(TorchDispatchMode):
    """Counts the calls of one operator (e.g. torch.ops.aten.mm.default)."""

    def __init__(self, op):
        super().__init__()
        self.op = op
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is self.op
        return func(*args, **(kwargs or {}))


class StorageCensus(TorchDispatchMode):
    """Notes every storage an op makes; held() is the bytes of those still
    alive: what forward keeps for backward, outputs included."""

    def __init__(self):
        super().__init__()
        self.made = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                self.made.setdefault(s._cdata, (StorageWeakRef(s), s.nbytes()))
        return out

    def held(self):
        gc.collect()
        return sum(n for ref, n in self.made.values() if not ref.expired())


def test_forward_keeps_no_more_bytes_than_torchs_checkpoint():
    blocks = model(blocks=4)
    x = torch.randn(4, 64, 32, requires_grad=True)
    held = {}
    for name, wrap in [("plain", plain), ("torch", with_torch), ("prefire", with_prefire)]:
        census = StorageCensus()
        with census:
            y = run(blocks, x, wrap)
        held[name] = census.held()
        y.sum().backward()
        del y
    assert held["prefire"] <= held["torch"] < held["plain"] / 4, held
