"""prefire._selective: the policies a plan's selective checkpoint takes,
the probe that measures one without running it, and what it is taken to
cost (Note [Measuring a selective checkpoint]). CPU, one intra-op thread
(conftest.py)."""

import functools

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import prefire
from prefire import _selective

aten = torch.ops.aten


def test_policies_from_true_a_list_or_a_function_and_clear_errors():
    keep = _selective.policy(True)
    ctx = torch_checkpoint.SelectiveCheckpointContext(is_recompute=False)
    assert keep(ctx, aten.mm.default) and keep(ctx, aten.addmm.default) and not keep(ctx, aten.gelu.default)
    assert aten.mm.default in prefire.MATMUL_AND_ATTENTION
    only_gelu = _selective.policy([aten.gelu.default])
    assert only_gelu(ctx, aten.gelu.default) and not only_gelu(ctx, aten.mm.default)
    fn = lambda ctx, op, *args, **kwargs: False  # noqa: E731
    assert _selective.policy(fn) is fn
    assert _selective.policy(None) is None and _selective.policy(False) is None
    with pytest.raises(ValueError, match="takes OpOverloads"):
        _selective.policy([aten.mm])
    with pytest.raises(TypeError, match="selective= must be True"):
        _selective.policy("mm")


def test_the_probe_counts_what_sac_would_keep_and_holds_nothing():
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(32, 48, requires_grad=True)

    def block(x):
        return torch.nn.functional.gelu(x @ w).sum(dim=1)

    with _selective.probing(_selective.policy([aten.mm.default])) as probe:
        out = prefire.checkpoint(block, x)
    assert probe.bytes == 64 * 48 * 4  # the product's output, nothing else
    assert probe.ops >= 3 and probe.kept_seconds > 0
    # SAC itself keeps that much: its cache, counted with the inputs
    context = functools.partial(torch_checkpoint.create_selective_checkpoint_contexts, [aten.mm.default])
    prefire.checkpoint(block, x, context_fn=context)
    assert prefire._checkpoint.checkpoint_bytes([x]) == 64 * 48 * 4  # x is a leaf: not counted
    out.sum().backward()
    with _selective.probing(None) as nothing:
        assert nothing is None


def test_what_a_selective_checkpoint_is_taken_to_cost():
    probe = _selective.SelectiveProbe(_selective.policy(True))
    probe.bytes, probe.ops, probe.kept_seconds = 1000, 10, 6e-3
    costs = _selective.ModeCosts(probe=1e-4, sac=2e-4)
    selective, seconds, whole = _selective.selective_cost(probe, costs, 100, 11e-3)
    assert selective == 1100
    assert whole == pytest.approx(10e-3)                   # the forward less the probe's 10 x 0.1 ms
    assert seconds == pytest.approx(10e-3 - 6e-3 + 4e-3)   # less the kept ops, plus SAC twice over 10 ops
    assert _selective.selective_cost(None, costs, 100, 11e-3) == (-1, 0.0, 11e-3)
    measured = _selective.mode_costs(_selective.policy(True))
    assert measured.probe >= 0 and measured.sac >= 0
