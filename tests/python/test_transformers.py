"""Hugging Face transformers as a client of prefire, on tiny random models
built from configs (nothing downloaded): prefire.integrations.transformers
against the model's own activation checkpointing (torch's checkpoint) for
GPT-2 and Llama: training steps with dropout and a padding mask bit-equal,
each layer run exactly twice, generation afterwards; torch's split backward
(B, then W per weight group) recomputing each layer once with a session;
save_pretrained / from_pretrained with prefire's checkpoint_wrapper on the
layers; prefire.plan_checkpoints on the layers (bit-equal to unchecked
within a budget that checkpoints some of them); torch.compile; enabling again (what Trainer does) keeps prefire.
CPU, one intra-op thread (conftest.py).

Not covered here: Trainer itself (it needs accelerate), CUDA."""

import copy

import pytest
import torch

from optional import optional, requires
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

import prefire
from prefire.integrations import transformers as prefire_transformers

transformers = optional("transformers")
pytestmark = requires("transformers")  # each test, skipped one by one where it is missing


def tiny(kind, seed=0):
    torch.manual_seed(seed)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=96, n_positions=32,
                                         resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                          max_position_embeddings=32, attention_dropout=0.1)
        model = transformers.LlamaForCausalLM(config)
    return model.train()


def layers_of(model):
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def count_runs(model):
    """Runs of each layer's body, recomputations included: transformers
    checkpoints the layer's forward, inside the layer's own hooks, so the
    count comes from the layer's first norm, which runs once per body run."""
    runs = [0] * len(layers_of(model))
    for i, layer in enumerate(layers_of(model)):
        first = layer.ln_1 if hasattr(layer, "ln_1") else layer.input_layernorm
        first.register_forward_pre_hook(lambda m, args, i=i: runs.__setitem__(i, runs[i] + 1))
    return runs


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding on the second sequence
    return ids, mask


def train(model, steps):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids, mask = batch()
    losses, grads = [], None
    torch.manual_seed(7)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        if grads is None:
            grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
    return losses, grads, torch.get_rng_state()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_enable_trains_bit_equal_to_torchs_checkpoint_and_runs_each_layer_twice(kind):
    with_torch = tiny(kind)
    with_torch.activation_checkpointing_enable()  # transformers' own: torch.utils.checkpoint
    with_prefire = tiny(kind)
    assert prefire_transformers.enable(with_prefire) is with_prefire
    assert prefire_transformers.is_enabled(with_prefire)
    runs = count_runs(with_prefire)

    before = prefire.runtime_stats().recomputations
    got = train(with_prefire, 1)
    assert runs == [2] * len(runs), "each layer runs in forward and once in backward"
    assert prefire.runtime_stats().recomputations - before == len(runs)
    expected = train(with_torch, 1)
    assert torch.equal(got[0][0], expected[0][0])
    assert all(torch.equal(g, e) for g, e in zip(got[1], expected[1]))
    assert torch.equal(got[2], expected[2]), "the RNG state after the step differs"

    # more AdamW steps, then generation with the trained weights
    got, expected = train(with_prefire, 4), train(with_torch, 4)
    assert all(torch.equal(g, e) for g, e in zip(got[0], expected[0]))
    ids, mask = batch(2)
    with_prefire.eval(), with_torch.eval()
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(with_prefire.generate(ids, **kwargs), with_torch.generate(ids, **kwargs))


def test_every_n_layers_and_enabling_again_keep_prefire():
    model = tiny("gpt2")
    prefire_transformers.enable(model, every_n_layers=2)
    assert [layer.gradient_checkpointing for layer in layers_of(model)] == [True, False, True]
    # Trainer(gradient_checkpointing=True) calls this at the start of train()
    with pytest.warns(FutureWarning):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert prefire_transformers.is_enabled(model)
    model.activation_checkpointing_enable()
    assert prefire_transformers.is_enabled(model)
    clone = copy.deepcopy(model)
    clone.activation_checkpointing_enable()
    assert prefire_transformers.is_enabled(clone)
    assert all(layer._gradient_checkpointing_func.func is prefire.checkpoint for layer in layers_of(clone))


def test_enable_refuses_models_without_checkpointing_support():
    class Plain(torch.nn.Module):
        supports_gradient_checkpointing = False

    with pytest.raises(ValueError, match="does not support"):
        prefire_transformers.enable(Plain())


def test_enable_refuses_every_n_layers_that_is_not_a_positive_int():
    model = tiny("gpt2")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="every_n_layers must be an int >= 1"):
            prefire_transformers.enable(model, every_n_layers=bad)
    assert not prefire_transformers.is_enabled(model)  # nothing half-done


def split_step(model, session):
    """One step through torch.distributed.pipelining's split backward, the
    whole model as one stage: B for the input embeddings, then W."""
    ids, mask = batch()
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    params = [p for p in model.parameters() if p is not model.get_input_embeddings().weight]
    torch.manual_seed(7)
    with prefire.collect() as handles:
        logits = model(inputs_embeds=embeds, attention_mask=mask).logits
    for h in handles:
        if session:
            prefire.attach(h, 51)
    g = torch.ones_like(logits) / logits.numel()
    with prefire.session(51, retain_on_unpack=True) if session else torch.enable_grad():
        (dx,), groups = stage_backward_input([logits], [g], [embeds], iter(params))
    with prefire.session(51) if session else torch.enable_grad():
        stage_backward_weight(iter(params), groups)
    prefire.clear_session(51)
    return [dx] + [p.grad for p in params]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_split_backward_runs_each_layer_twice_with_a_session(kind):
    with_torch = tiny(kind)
    with_torch.activation_checkpointing_enable()
    torch_runs = count_runs(with_torch)
    expected = split_step(with_torch, session=False)
    with_prefire = prefire_transformers.enable(tiny(kind))
    runs = count_runs(with_prefire)
    got = split_step(with_prefire, session=True)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    assert runs == [2] * len(runs)
    assert all(r > 3 for r in torch_runs), torch_runs  # forward, B, and once per weight group of W


def test_save_and_load_with_prefires_checkpoint_wrapper_on_the_layers(tmp_path):
    model = tiny("llama")
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    layers = layers_of(model)
    for i, layer in enumerate(layers):
        layers[i] = prefire.checkpoint_wrapper(layer)
    assert set(model.state_dict()) == set(reference)
    model.save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    state = loaded.state_dict()
    assert set(state) == set(reference)
    assert all(torch.equal(state[k], v) for k, v in reference.items())
    # and a model saved without wrappers loads into a wrapped one
    missing, unexpected = model.load_state_dict(loaded.state_dict())
    assert not missing and not unexpected


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_planned_layers_train_bit_equal_to_unchecked_within_the_budget_and_save_as_bare_layers(kind, tmp_path):
    unchecked = tiny(kind)
    unchecked.config.use_cache = False  # as transformers sets it for checkpointing: no cache to update twice
    n = len(layers_of(unchecked))
    probe = copy.deepcopy(unchecked)
    planner = prefire.plan_checkpoints(layers_of(probe), memory_budget=10**12)
    train(probe, 1)
    costs = planner.costs
    one_pass = prefire.Release.IN_BACKWARD
    least, most = prefire.least_plan_bytes(costs, one_pass), prefire.plan_bytes(costs, [False] * n, 0, one_pass)
    assert least < most
    planned = copy.deepcopy(unchecked)
    planner = prefire.plan_checkpoints(layers_of(planned), memory_budget=(least + most) // 2)
    got, expected = train(planned, 4), train(unchecked, 4)
    assert all(torch.equal(g, e) for g, e in zip(got[0], expected[0]))
    assert all(torch.equal(g, e) for g, e in zip(got[1], expected[1]))
    assert torch.equal(got[2], expected[2]), "the RNG state after the steps differs"
    assert 0 < sum(planner.plan.checkpointed) < n, planner.describe()
    assert planner.measuring_steps == 1
    planned.save_pretrained(tmp_path)
    loaded = type(unchecked).from_pretrained(tmp_path)
    assert set(loaded.state_dict()) == set(unchecked.state_dict())
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in planned.state_dict().items())


def test_compiled_model_with_prefire_equals_torchs_checkpoint():
    def grads(model):
        compiled = torch.compile(model, backend="aot_eager")
        ids, mask = batch()
        torch.manual_seed(7)
        compiled(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        return [p.grad for p in model.parameters()]

    torch._dynamo.reset()
    with_torch = tiny("gpt2")
    with_torch.activation_checkpointing_enable()
    expected = grads(with_torch)
    torch._dynamo.reset()
    got = grads(prefire_transformers.enable(tiny("gpt2")))
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
