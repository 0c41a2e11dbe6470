"""Checkpoint options are consumed or refused, never passed to the block
(Note [Options that cannot be ignored] in python/prefire/_options.py)."""

import pytest
import torch

import prefire
from optional import optional, requires


class TakesAnything(torch.nn.Module):
    """A block that takes **kwargs and ignores them, as transformers layers do."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.ignored = []

    def forward(self, x, **kwargs):
        self.ignored.append(kwargs)
        return self.linear(x).relu()


def one_line(error):
    text = str(error.value)
    assert "\n" not in text and len(text) < 600, text
    return text


@pytest.mark.parametrize("make", [
    lambda block, **o: prefire.checkpoint_wrapper(block, **o),
    lambda block, **o: prefire.plan_checkpoints(torch.nn.ModuleList([block]), memory_budget=1 << 20, **o),
    lambda block, **o: prefire.checkpoint_sequential([block], 1, torch.ones(2, 4), **o),
], ids=["checkpoint_wrapper", "plan_checkpoints", "checkpoint_sequential"])
def test_an_option_prefire_does_not_have_is_refused_where_it_would_reach_the_block(make):
    block = TakesAnything()
    with pytest.raises(TypeError, match=r"offload= is not an option of prefire.checkpoint.*offload_to="):
        make(block, offload=True)
    with pytest.raises(TypeError, match="early_stopping= is not an option"):
        make(block, early_stopping=False)
    assert block.ignored == []


def test_a_checkpoint_option_of_the_wrong_kind_says_what_it_should_be_in_one_line(tmp_path):
    x = torch.ones(2, 4, requires_grad=True)
    block = TakesAnything()
    with pytest.raises(TypeError, match=r"prefire.checkpoint: offload_to must be None or a prefire.OffloadTier"):
        prefire.checkpoint(block, x, offload_to=str(tmp_path))
    assert str(tmp_path) in one_line(pytest.raises(TypeError, prefire.checkpoint, block, x, offload_to=str(tmp_path)))
    with pytest.raises(TypeError, match="early_stop must be a bool, got 'yes'"):
        prefire.checkpoint(block, x, early_stop="yes")
    with pytest.raises(TypeError, match="prefire.plan_checkpoints: offload_to must be None or a prefire.OffloadTier"):
        prefire.plan_checkpoints(torch.nn.ModuleList([block]), memory_budget=1 << 20, offload_to=str(tmp_path))
    with pytest.raises(TypeError, match="prefire.checkpoint_wrapper: determinism_check must be"):
        prefire.checkpoint_wrapper(block, determinism_check="bytes")
    with pytest.raises(ValueError, match="offload_inputs_only=True needs offload_to="):
        prefire.checkpoint_wrapper(block, offload_inputs_only=True)
    assert block.ignored == []


def test_a_large_value_is_named_by_its_type_not_printed():
    x = torch.ones(2, 4, requires_grad=True)
    error = pytest.raises(TypeError, prefire.checkpoint, TakesAnything(), x, offload_to=torch.zeros(1000))
    assert "got a Tensor" in one_line(error)


transformers = optional("transformers")


@requires("transformers")
def test_transformers_enable_refuses_offload_and_consumes_the_trainers_options():
    from prefire.integrations import transformers as prefire_transformers

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    with pytest.raises(TypeError, match="offload= is not an option of prefire.checkpoint"):
        prefire_transformers.enable(model, offload=True)
    prefire_transformers.enable(model)
    with pytest.raises(ValueError, match=r"offload=True\) would offload with torch's save_on_cpu"):
        model.activation_checkpointing_enable(offload=True)
    with pytest.raises(TypeError, match="gradient_checkpointing_enable: offload= is not an option"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"offload": True})
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False, "early_stop": False})
    assert prefire_transformers.is_enabled(model)
    functions = {layer._gradient_checkpointing_func for layer in model.transformer.h}
    assert [f.keywords for f in functions] == [{"early_stop": False}]
