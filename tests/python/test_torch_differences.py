"""Differences of torch releases' own that the suite meets, each shown with
torch alone (no prefire) on every release CI tests, so that a release
that stops differing is seen (Note [Known differences of a torch release]
in conftest.py; docs/development.md):

* torch 2.11's V-shaped schedules fail on Gloo at their first step;
* torch 2.11's stage_backward_weight fails on a torch.compile'd block;
* torch 2.11's selective checkpoint does not refuse a second backward;
* torch 2.11 to 2.14 keep the last stage's output graph past W (a view
  torch cannot detach in place); 2.15 keeps none.

CPU, one intra-op thread (conftest.py)."""

import functools

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from conftest import torch_release
from test_pipelining import TINY, zbv_one_rank
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.utils._pytree import tree_flatten


def zbv_step_on_one_rank():
    """One step of ZBV over two stages of this rank, without prefire; the last stage."""
    schedule, _, step = zbv_one_rank(lambda b, x: b(x))
    step()
    return schedule._stages[-1]


def test_torch_2_11s_v_shaped_schedules_fail_on_gloo_at_the_first_step_and_later_releases_run_them(one_rank):
    if torch_release() == (2, 11):
        with pytest.raises(RuntimeError, match="Pair is not connected"):
            zbv_step_on_one_rank()
    else:
        zbv_step_on_one_rank()


def test_torchs_last_stage_keeps_its_outputs_graph_after_w_before_2_15_and_not_from_2_15(one_rank):
    if torch_release() == (2, 11):
        pytest.skip("torch 2.11 cannot run ZBV on Gloo (the test above shows it)")
    last = zbv_step_on_one_rank()
    outputs = [t for out in last.output_chunks for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    assert len(outputs) == TINY.micro_batches
    assert [t.grad_fn is not None for t in outputs] == [torch_release() < (2, 15)] * TINY.micro_batches


def test_torch_2_11s_stage_backward_weight_fails_on_a_compiled_block_and_later_releases_compute_it():
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    y = torch.compile(block, backend="aot_eager")(x)
    _, groups = stage_backward_input([y], [torch.ones_like(y)], [x], block.parameters())
    if torch_release() == (2, 11):
        with pytest.raises(RuntimeError, match="Attribute '_input_metadata' is invalid"):
            stage_backward_weight(block.parameters(), groups)
    else:
        stage_backward_weight(block.parameters(), groups)
        assert all(p.grad is not None for p in block.parameters())


def test_torch_2_11s_selective_checkpoint_allows_a_second_backward_and_later_releases_refuse_it():
    x, w = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)

    def fn(a):
        return torch.mm(torch.mm(a.cos(), w).sin(), w).sum()

    context_fn = functools.partial(torch_checkpoint.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    y = torch_checkpoint.checkpoint(fn, x, use_reentrant=False, context_fn=context_fn)
    torch.autograd.grad(y, [x], retain_graph=True)
    if torch_release() == (2, 11):
        torch.autograd.grad(y, [w])
    else:
        with pytest.raises(RuntimeError, match="backward an extra time"):
            torch.autograd.grad(y, [w])
