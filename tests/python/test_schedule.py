"""Sessions and prefire from Python, with torch.distributed.pipelining's own
split backward (stage_backward_input / stage_backward_weight, single process):
torch's checkpoint recomputes every block in both passes, prefire with a
session once, and the gradients are the same."""

import contextlib
import os
import subprocess
import sys

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

import prefire

from test_checkpoint import Block, assert_bit_equal, model


class Counting(torch.nn.Module):
    """Counts its forward runs (forward and recomputations alike)."""

    def __init__(self, block):
        super().__init__()
        self.block = block
        self.runs = 0

    def forward(self, x):
        self.runs += 1
        return self.block(x)


def split_step(blocks, wrap, x, gy, b_scope=None, w_scope=None):
    x.grad = None  # stage_backward_input accumulates into it in place
    torch.manual_seed(1)
    h = x
    for b in blocks:
        h = wrap(b, h)
    params = list(blocks.parameters())
    with b_scope or contextlib.nullcontext():
        (dx,), groups = stage_backward_input([h], [gy], [x], iter(params))
    with w_scope or contextlib.nullcontext():
        stage_backward_weight(iter(params), groups)
    grads = [dx.clone()] + [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return grads


def setup():
    blocks = torch.nn.ModuleList(Counting(b) for b in model(blocks=2))
    torch.manual_seed(3)
    x = torch.randn(2, 8, 32, requires_grad=True)
    gy = torch.randn(2, 8, 32)
    return blocks, x, gy


def runs(blocks):
    counts = [b.runs for b in blocks]
    for b in blocks:
        b.runs = 0
    return counts


def test_split_backward_torch_recomputes_twice_prefire_session_once():
    blocks, x, gy = setup()
    expected = split_step(blocks, lambda b, h: b(h), x, gy)
    assert runs(blocks) == [1, 1]

    got_torch = split_step(blocks, lambda b, h: torch_checkpoint.checkpoint(b, h, use_reentrant=False), x, gy)
    # forward, one recomputation in B, and one per backward call of W (one per
    # group of weights stage_backward_weight finds)
    assert all(r >= 3 for r in runs(blocks))
    assert_bit_equal(got_torch, expected)

    def attached(b, h):
        with prefire.collect() as new:
            y = prefire.checkpoint(b, h)
        assert all(prefire.attach(handle, 1) for handle in new)
        return y

    got = split_step(blocks, attached, x, gy, prefire.session(1, retain_on_unpack=True), prefire.session(1))
    assert runs(blocks) == [2, 2]  # forward and one recomputation shared by B and W
    assert_bit_equal(got, expected)
    assert prefire.session_stats(1).lazy_recomputes == 2
    prefire.clear_session(1)


def test_a_b_given_what_w_reads_lets_go_of_the_rest_as_it_unpacks_with_torchs_split():
    # See Note [A pass lets go of what the next pass will not read]
    blocks, x, gy = setup()
    expected = split_step(blocks, lambda b, h: b(h), x, gy)

    def attached(b, h):
        with prefire.collect() as new:
            y = prefire.checkpoint(b, h)
        for handle in new:
            prefire.attach(handle, 7)
        return y

    lets_go, held_after_b = [], []

    class B(prefire.session):  # the B scope: whether it let go, read as it ends
        def __exit__(self, *exc):
            lets_go.append(self.lets_go)
            return super().__exit__(*exc)

    def b_scope(**kwargs):
        return B(7, retain_on_unpack=True, **kwargs)

    class W(prefire.session):  # the W scope: what B left in the session, read as W begins
        def __enter__(self):
            held_after_b.append(prefire.session_stats(7))
            return super().__enter__()

    split_step(blocks, attached, x, gy, b_scope(), W(7))
    reads = prefire._C.pass_reads(7)  # what torch's W read: the weights' inputs, not what dx alone needs
    assert len(reads) == 2 and all(0 < sum(r) < len(r) for r in reads)
    prefire.clear_session(7)
    runs(blocks)
    got = split_step(blocks, attached, x, gy, b_scope(next_pass_reads=reads), W(7))
    assert_bit_equal(got, expected)
    assert runs(blocks) == [2, 2]  # forward and one recomputation shared by B and W
    whole, trimmed = held_after_b
    assert lets_go == [False, True]
    assert 0 < trimmed.current_bytes < whole.current_bytes
    assert trimmed.peak_bytes < whole.peak_bytes  # each block's recomputation left as B went, not at its end
    assert prefire.session_stats(7).trim_misses == 0
    prefire.clear_session(7)

    with pytest.raises(ValueError, match="retain_on_unpack=True"):
        prefire.session(7, next_pass_reads=reads)
    with prefire.session(7, retain_on_unpack=True, next_pass_reads=[[True]]) as scope:
        assert not scope.lets_go  # no checkpoint registered: the mask does not fit


def test_prefire_before_backward_recomputes_once_ahead():
    blocks, x, gy = setup()
    expected = split_step(blocks, lambda b, h: b(h), x, gy)
    runs(blocks)
    x.grad = None
    sid = 2
    torch.manual_seed(1)
    with prefire.collect() as handles:
        h = x
        for b in blocks:
            h = prefire.checkpoint(b, h)
    assert len(handles) == 2
    assert [prefire.prefire(hd, sid) for hd in handles] == [prefire.PrefireStatus.RECOMPUTED] * 2
    assert prefire.prefire(handles[0], sid) == prefire.PrefireStatus.ALREADY_RESIDENT
    assert runs(blocks) == [2, 2]
    stats = prefire.session_stats(sid)
    assert stats.prefires == 2 and stats.current_bytes > 0
    params = list(blocks.parameters())
    with prefire.session(sid, retain_on_unpack=True):
        (dx,), groups = stage_backward_input([h], [gy], [x], iter(params))
    with prefire.session(sid):
        stage_backward_weight(iter(params), groups)
    assert runs(blocks) == [0, 0]
    assert_bit_equal([dx] + [p.grad for p in params], expected)
    prefire.clear_session(sid)
    assert prefire.session_stats(sid).current_bytes == 0


def test_budget_refuses_a_prefire_that_does_not_fit():
    blocks, x, gy = setup()
    sid = 3
    prefire.set_session_budget(sid, 1)
    with prefire.collect() as handles:
        y = prefire.checkpoint(blocks[0], x)
    assert prefire.prefire(handles[0], sid) == prefire.PrefireStatus.REFUSED_OVER_BUDGET
    assert prefire.session_stats(sid).refused_prefires == 1
    assert prefire.session_stats(sid).budget_bytes == 1
    prefire.set_session_budget(sid, None)
    prefire.clear_session(sid)
    del y


def test_recompute_observer_sees_lazy_and_prefire_recomputations():
    events = []
    prefire.set_recompute_observer(lambda kind, session, begin, end: events.append((kind, session, begin <= end)))
    try:
        x = torch.randn(4, 4, requires_grad=True)
        prefire.checkpoint(torch.sin, x).sum().backward()
        with prefire.collect() as handles:
            y = prefire.checkpoint(torch.sin, x)
        prefire.prefire(handles[0], 5)
        with prefire.session(5):
            y.sum().backward()
        prefire.clear_session(5)
    finally:
        prefire.set_recompute_observer(None)
    prefire.checkpoint(torch.sin, x).sum().backward()  # removed: not seen
    assert events == [("lazy", -1, True), ("prefire", 5, True)]


def test_a_process_that_exits_with_a_recompute_observer_set_exits_cleanly():
    # Note [A Python object released after Python ended]: C++ drops the
    # observer after the interpreter ended (a segfault before)
    code = ("import torch, prefire; prefire.set_recompute_observer(lambda *event: None); "
            "x = torch.randn(2, requires_grad=True); prefire.checkpoint(torch.sin, x).sum().backward()")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ),
                            timeout=300)
    assert result.returncode == 0, result.stderr


def test_cuda_knobs_without_a_gpu_are_harmless_and_the_stream_is_prefires_own():
    assert prefire.cuda.session_pool_enabled() is False
    prefire.cuda.set_session_pool_enabled(True)
    assert prefire.cuda.session_pool_enabled() is True
    prefire.cuda.set_session_pool_enabled(False)
    prefire.cuda.set_prefire_stream_priority(0)
    if not prefire.cuda.cuda_available():
        assert prefire.cuda.session_pool_reserved_bytes() == 0
        pytest.skip("no CUDA device: the prefire stream is not there")
    stream = prefire.cuda.prefire_stream(0)
    assert stream == prefire.cuda.prefire_stream(0)
    assert stream != torch.cuda.current_stream(0)
    assert all(torch.cuda.Stream(0) != stream for _ in range(64))


@pytest.fixture
def warn_always():
    """TORCH_WARN_ONCE warns every time (torch's switch), so each test sees its warning."""
    before = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    yield
    torch.set_warn_always(before)


def test_session_scopes_alone_around_b_and_w_recompute_in_each_pass_and_warn(warn_always):
    # Note [A session shares what is registered to it]: nothing registered, nothing shared, and said so
    blocks, x, gy = setup()
    expected = split_step(blocks, lambda b, h: b(h), x, gy)
    runs(blocks)
    before = prefire.runtime_stats()
    with pytest.warns(UserWarning, match="ended with no checkpoint registered to it.*prefire.attach") as seen:
        got = split_step(blocks, prefire.checkpoint, x, gy, prefire.session(4, retain_on_unpack=True),
                         prefire.session(4))
    assert len([w for w in seen if "no checkpoint registered" in str(w.message)]) == 2  # each scope
    assert_bit_equal(got, expected)
    assert all(r >= 3 for r in runs(blocks))  # forward, B, and W's backward calls: nothing shared
    after = prefire.runtime_stats()
    assert after.unshared_recomputations - before.unshared_recomputations == after.recomputations - before.recomputations
    prefire.clear_session(4)


def test_session_scopes_alone_around_two_backward_calls_warn(warn_always):
    blocks, x, gy = setup()
    y = prefire.checkpoint(blocks[0], x)
    with pytest.warns(UserWarning, match="ended with no checkpoint registered to it"):
        with prefire.session(5, retain_on_unpack=True):
            y.sum().backward(retain_graph=True)
        with prefire.session(5):
            y.mean().backward()
    prefire.clear_session(5)


def test_attached_checkpoints_share_one_recomputation_in_both_splits_without_a_warning(warn_always):
    import warnings

    blocks, x, gy = setup()
    for split in ("b-then-w", "two-backward-calls"):
        runs(blocks)
        with prefire.collect() as handles:
            y = prefire.checkpoint(blocks[0], x)
        for h in handles:
            prefire.attach(h, 6)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # any warning fails the test
            if split == "b-then-w":
                with prefire.session(6, retain_on_unpack=True):
                    torch.autograd.grad(y.sum(), [x], retain_graph=True)
                with prefire.session(6):
                    torch.autograd.grad(y.sum(), list(blocks[0].parameters()))
            else:
                with prefire.session(6, retain_on_unpack=True):
                    y.sum().backward(retain_graph=True)
                with prefire.session(6):
                    y.mean().backward()
            prefire.clear_session(6)
        assert runs(blocks)[0] == 2, split  # forward and one shared recomputation


def test_a_prefire_no_pass_used_warns_and_counts_as_wasted(warn_always):
    blocks, x, gy = setup()
    with prefire.collect() as handles:
        y = prefire.checkpoint(blocks[0], x)
    prefire.prefire(handles[0], 7)
    assert prefire.session_stats(7).unused_prefires == 1
    wasted = prefire.runtime_stats().wasted_prefires
    with pytest.warns(UserWarning, match="prefired into session 7 was released before any backward pass used"):
        y.sum().backward()  # outside the session's scope: its own recomputation; the graph goes, the prefire too
    assert prefire.runtime_stats().wasted_prefires == wasted + 1
    prefire.clear_session(7)

    with prefire.collect() as handles:
        y = prefire.checkpoint(blocks[0], x)
    prefire.prefire(handles[0], 8)
    with pytest.warns(UserWarning, match="prefired into session 8"):
        prefire.clear_session(8)  # cleared before any pass
    assert prefire.runtime_stats().wasted_prefires == wasted + 2

    with prefire.collect() as handles:
        y = prefire.checkpoint(blocks[0], x)
    prefire.prefire(handles[0], 9)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prefire.discard_session(9)  # let go on purpose: neither warned nor counted
    assert prefire.runtime_stats().wasted_prefires == wasted + 2
    del y


def test_stats_print_their_fields_and_bad_arguments_are_python_errors():
    stats = prefire.session_stats(9)
    assert repr(stats).startswith("SessionStats(current_bytes=0, ") and "unused_prefires=0" in repr(stats)
    assert "budget_bytes=None" in repr(stats)
    assert repr(prefire.runtime_stats()).startswith("RuntimeStats(recomputations=")
    assert "session_stats" in prefire.SessionStats.__doc__ and "runtime_stats" in prefire.RuntimeStats.__doc__
    assert "prefire()" in prefire.SessionStats.prefires.__doc__
    assert "no session kept" in prefire.RuntimeStats.unshared_recomputations.__doc__
    for call, error, words in [
        (lambda: prefire.session("a"), TypeError, "prefire.session: a session id is an int"),
        (lambda: prefire.session(2**70), ValueError, "prefire.session: a session id is an int in"),
        (lambda: prefire.session(1, retain_on_unpack="yes"), TypeError, "retain_on_unpack must be a bool"),
        (lambda: prefire.clear_session(None), TypeError, "prefire.clear_session"),
        (lambda: prefire.session_stats(-1), ValueError, "prefire.session_stats"),
        (lambda: prefire.set_session_budget(0, -1), ValueError, "an int >= 0, or None for no cap"),
        (lambda: prefire.prefire(None, 0), TypeError, "a CheckpointHandle"),
        (lambda: prefire.attach("h", 0), TypeError, "a CheckpointHandle"),
    ]:
        with pytest.raises(error, match=words) as caught:
            call()
        assert "std::" not in str(caught.value) and "prefire::" not in str(caught.value)
