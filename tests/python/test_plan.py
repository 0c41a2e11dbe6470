"""prefire.plan_checkpoints: a memory budget in, which blocks keep their
activations out (Note [Planning a plain model's blocks] in prefire/_plan.py).
The bytes a step holds are measured by the runtime's census (a
SavedTensorMeter around forward and backward, plus recomputed bytes), never
taken from the plan's own arithmetic. CPU, one intra-op thread
(conftest.py).

Not covered here: the C++ planner's choices (tests/plan_test.cpp: the
budget against an exhaustive search on random costs), pipelines."""

import copy
import functools
import json
import os
import random
import subprocess
import warnings

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper as TorchCheckpointWrapper

import prefire
from prefire import _plan
from prefire._selective import ModeCosts

ONE_PASS = prefire.Release.IN_BACKWARD  # what the planner of a plain model uses


def blocks_of(widths, dim=24, dropout=0.1):
    return torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.LayerNorm(dim), torch.nn.Linear(dim, w), torch.nn.GELU(),
                            torch.nn.Dropout(dropout), torch.nn.Linear(w, dim)) for w in widths)


def step(blocks, x, seed):
    """One training step's forward and backward; returns the gradients, the
    most bytes the blocks' activations held (saved and recomputed) and the
    recomputations it ran."""
    torch.manual_seed(seed)
    for p in blocks.parameters():
        p.grad = None
    x = x.detach().requires_grad_(True)
    prefire.reset_runtime_peak()
    held_before = prefire.runtime_stats().held_bytes
    recomputations = prefire.runtime_stats().recomputations
    with prefire.SavedTensorMeter():
        h = x * 1.0  # not a leaf: block 0's saved input counts, as in a model whose embedding comes first
        for block in blocks:
            h = block(h)
        h.backward(torch.ones_like(h))  # saves nothing: the bytes held are the blocks'
    stats = prefire.runtime_stats()
    grads = [x.grad] + [p.grad for p in blocks.parameters()]
    return grads, stats.peak_held_bytes - held_before, stats.recomputations - recomputations


def unchecked_bytes(blocks, x):
    return step(blocks, x, 0)[1]


def assert_bit_equal(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


@pytest.mark.parametrize("seed", range(6))
def test_every_budget_holds_and_gradients_stay_exact_on_random_block_sizes(seed):
    rng = random.Random(seed)
    widths = [rng.choice([8, 16, 48, 96, 160]) for _ in range(rng.randint(2, 7))]
    reference = blocks_of(widths)
    x = torch.randn(rng.choice([4, 8, 16]), 24)
    expected, none_bytes, _ = step(reference, x, 1)
    probe = copy.deepcopy(reference)
    planner = prefire.plan_checkpoints(probe, memory_budget=none_bytes)
    step(probe, x, 1)
    least = prefire.least_plan_bytes(planner.costs, ONE_PASS)
    assert 0 < least < none_bytes
    for budget in sorted({least, (least + none_bytes) // 2, least + (none_bytes - least) // 5, none_bytes}):
        blocks = copy.deepcopy(reference)
        planner = prefire.plan_checkpoints(blocks, memory_budget=budget)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            grads, measuring_bytes, _ = step(blocks, x, 1)
        assert_bit_equal(grads, expected)
        everything = prefire.plan_bytes(planner.costs, [True] * len(widths), 0, ONE_PASS)
        assert measuring_bytes <= everything
        assert any("measuring step" in str(w.message) for w in caught) == (everything > budget)
        plan = planner.plan
        assert plan.peak_bytes <= budget
        for _ in range(2):
            grads, held, recomputations = step(blocks, x, 1)
            assert_bit_equal(grads, expected)
            assert held <= plan.peak_bytes <= budget, (budget, planner.describe())
            assert recomputations == sum(plan.checkpointed)
        assert planner.measuring_steps == 1
    assert not any(plan.checkpointed), "at the memory of keeping everything, nothing is recomputed"


def test_selective_checkpoints_are_planned_with_what_their_cache_holds():
    """Blocks checkpointed with torch's selective checkpointing (the
    products cached): a checkpointed block counts its cache with its inputs,
    and the census, which counts the cache too, stays within the plan
    (Note [Selective checkpointing inside prefire])."""
    import functools

    import torch.utils.checkpoint as torch_checkpoint

    context_fn = functools.partial(torch_checkpoint.create_selective_checkpoint_contexts,
                                   [torch.ops.aten.addmm.default])
    reference = blocks_of([16, 160, 16, 160], dropout=0.0)
    x = torch.randn(8, 24)
    expected, none_bytes, _ = step(reference, x, 1)
    costs = []
    for kwargs in ({}, {"context_fn": context_fn}):
        probe = copy.deepcopy(reference)
        costs.append(prefire.plan_checkpoints(probe, memory_budget=none_bytes, **kwargs))
        step(probe, x, 1)
    for plain, selective in zip(costs[0].costs, costs[1].costs):
        assert selective.saved_bytes == plain.saved_bytes and selective.input_bytes > plain.input_bytes
    least = prefire.least_plan_bytes(costs[1].costs, ONE_PASS)
    for budget in (least, (least + none_bytes) // 2):
        blocks = copy.deepcopy(reference)
        planner = prefire.plan_checkpoints(blocks, memory_budget=budget, context_fn=context_fn)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the measuring step may hold more than a tight budget
            step(blocks, x, 1)
        grads, held, recomputations = step(blocks, x, 1)
        assert_bit_equal(grads, expected)
        assert held <= planner.plan.peak_bytes <= budget, (budget, planner.describe())
        assert recomputations == sum(planner.plan.checkpointed) > 0


def test_a_selective_checkpoint_is_a_third_choice_and_every_budget_holds_with_exact_gradients(monkeypatch):
    """plan_checkpoints(..., selective=True): the measuring step finds each
    block's selective checkpoint (matmul outputs kept, the rest recomputed)
    between its inputs and all it saves, some budget checkpoints blocks
    selectively, and the census stays within every plan with the gradients
    of the unchecked blocks (dropout recomputed with forward's generator).
    SAC's dispatch costs, which on blocks this small outweigh their ops,
    are taken as none, so that the choice follows bytes and op time."""
    monkeypatch.setattr(_plan, "mode_costs", lambda policy_fn: ModeCosts(probe=0.0, sac=0.0))
    reference = blocks_of([16, 160, 48, 160, 96])
    x = torch.randn(8, 24)
    expected, none_bytes, _ = step(reference, x, 1)
    probe = copy.deepcopy(reference)
    planner = prefire.plan_checkpoints(probe, memory_budget=none_bytes, selective=True)
    step(probe, x, 1)
    for cost in planner.costs:
        assert cost.input_bytes < cost.selective_bytes < cost.saved_bytes
        assert 0 < cost.selective_seconds < cost.recompute_seconds
    least = prefire.least_plan_bytes(planner.costs, ONE_PASS)
    chosen = set()
    for share in (0.0, 0.2, 0.4, 0.6, 0.8, 1.0):
        budget = least + int(share * (none_bytes - least))
        blocks = copy.deepcopy(reference)
        planner = prefire.plan_checkpoints(blocks, memory_budget=budget, selective=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the measuring step may hold more than a tight budget
            grads, _, _ = step(blocks, x, 1)
        assert_bit_equal(grads, expected)
        plan = planner.plan
        for _ in range(2):
            grads, held, recomputations = step(blocks, x, 1)
            assert_bit_equal(grads, expected)
            assert held <= plan.peak_bytes <= budget, (budget, planner.describe())
            assert recomputations == sum(plan.checkpointed)
        chosen.add("".join("s" if s else "c" if c else "k" for c, s in zip(plan.checkpointed, plan.selective)))
    assert any("s" in plan for plan in chosen), chosen
    with pytest.raises(ValueError, match="selective= and a context_fn exclude each other"):
        prefire.plan_checkpoints(blocks_of([8]), memory_budget=10**9, selective=True, context_fn=lambda: None)


def test_a_shape_change_measures_and_plans_again_and_each_shape_keeps_its_plan():
    reference = blocks_of([16, 160, 16, 160])
    small, large = torch.randn(4, 24), torch.randn(8, 24)
    blocks = copy.deepcopy(reference)
    budget = unchecked_bytes(reference, small) * 13 // 10
    planner = prefire.plan_checkpoints(blocks, memory_budget=budget)
    step(blocks, small, 1)
    assert not any(planner.plan.checkpointed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the measuring step of the large shape holds more than the budget
        grads, _, _ = step(blocks, large, 1)
    assert planner.measuring_steps == 2
    assert any(planner.plan.checkpointed), "the same budget is tighter for twice the batch"
    large_plan = list(planner.plan.checkpointed)
    grads_again, held, _ = step(blocks, large, 1)
    assert_bit_equal(grads_again, grads)
    assert held <= budget
    step(blocks, small, 1)
    assert planner.measuring_steps == 2, "the small shape's plan is kept"
    assert not any(planner.plan.checkpointed)
    step(blocks, large, 1)
    assert list(planner.plan.checkpointed) == large_plan


def test_a_budget_below_the_least_plan_says_the_minimum_and_that_minimum_works():
    reference = blocks_of([16, 64, 96])
    x = torch.randn(8, 24)
    blocks = copy.deepcopy(reference)
    prefire.plan_checkpoints(blocks, memory_budget=100)
    with pytest.raises(ValueError, match=r"memory_budget=100 bytes is below the least any plan of these blocks "
                                         r"holds, (\d+) bytes") as error:
        step(blocks, x, 1)
    least = int(str(error.value).split("holds, ")[1].split(" bytes")[0])
    blocks = copy.deepcopy(reference)
    planner = prefire.plan_checkpoints(blocks, memory_budget=least)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the least plan keeps a block: checkpointing all may hold more
        step(blocks, x, 1)
    _, held, _ = step(blocks, x, 1)
    assert held <= least
    assert planner.plan.peak_bytes <= least


def test_weights_save_and_load_as_the_bare_blocks_and_eval_runs_unplanned():
    reference = blocks_of([16, 32])
    blocks = copy.deepcopy(reference)
    planner = prefire.plan_checkpoints(blocks, memory_budget=10**9)
    assert all(isinstance(b, prefire.PlannedBlock) and isinstance(b, TorchCheckpointWrapper) for b in blocks)
    assert list(blocks.state_dict()) == list(reference.state_dict())
    fresh = blocks_of([16, 32])
    fresh.load_state_dict(blocks.state_dict())
    for a, b in zip(fresh.parameters(), reference.parameters()):
        assert torch.equal(a, b)
    other = blocks_of([16, 32])
    blocks.load_state_dict(other.state_dict())
    assert torch.equal(blocks[1]._checkpoint_wrapped_module[4].weight, other[1][4].weight)
    with torch.no_grad():
        h = torch.randn(2, 24)
        for b in blocks:
            h = b(h)
    assert planner.measuring_steps == 0 and planner.plan is None


def test_misuse_is_a_clear_error():
    with pytest.raises(ValueError, match="memory_budget must be a number of bytes"):
        prefire.plan_checkpoints(blocks_of([8]), memory_budget=-1)
    with pytest.raises(ValueError, match="nn.ModuleList or nn.Sequential"):
        prefire.plan_checkpoints([torch.nn.Linear(2, 2)], memory_budget=10)
    with pytest.raises(ValueError, match="already wrapped"):
        prefire.plan_checkpoints(torch.nn.ModuleList([prefire.checkpoint_wrapper(torch.nn.Linear(2, 2))]), 10)
    with pytest.raises(ValueError, match="no blocks"):
        prefire.plan_checkpoints(torch.nn.ModuleList(), 10)
    blocks = blocks_of([8, 8])
    prefire.plan_checkpoints(blocks, memory_budget=10**9)
    x = torch.randn(2, 24, requires_grad=True)
    with pytest.raises(RuntimeError, match="inside prefire.collect"):
        with prefire.collect():
            blocks[0](x)
    out_of_order = blocks_of([8, 8, 8])
    prefire.plan_checkpoints(out_of_order, memory_budget=10**9)
    with pytest.raises(RuntimeError, match="block 1 ran before block 0"):
        out_of_order[1](x)
    with pytest.raises(RuntimeError, match=r"blocks \[1\] did not run"):
        out_of_order[2](out_of_order[0](x))


def test_compiling_a_model_over_planned_blocks_says_to_compile_inside_them():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = blocks_of([8, 8], dropout=0.0)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    model = Model()
    prefire.plan_checkpoints(model.layers, memory_budget=10**9)
    x = torch.randn(2, 24, requires_grad=True)
    with pytest.raises(RuntimeError, match="cannot run inside torch.compile; compile inside the blocks"):
        torch.compile(model, backend="aot_eager")(x).sum().backward()
    # The recipe the message gives: compiled blocks, planned; then an eager step plans them.
    torch._dynamo.reset()
    model = Model()
    expected = torch.autograd.grad(model(x).sum(), [x])
    for i in range(len(model.layers)):
        model.layers[i] = torch.compile(model.layers[i], backend="aot_eager")
    planner = prefire.plan_checkpoints(model.layers, memory_budget=10**9)
    assert list(model.state_dict()) == list(Model().state_dict())  # the bare blocks' keys: no _orig_mod.
    got = torch.autograd.grad(model(x).sum(), [x])
    assert planner.plan is not None
    assert_bit_equal(got, expected)


def test_a_compiled_block_gets_no_selective_choice_and_a_selective_checkpoint_of_one_is_refused():
    torch.manual_seed(0)
    layers = blocks_of([8, 8], dropout=0.0)
    x = torch.randn(2, 24, requires_grad=True)
    expected = torch.autograd.grad(layers[1](layers[0](x)).sum(), [x])
    for i in range(len(layers)):
        layers[i] = torch.compile(layers[i])  # inductor
    sac = functools.partial(torch.utils.checkpoint.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    # a selective policy sees no op inside a compiled function: forward and recomputation would save differently
    with pytest.raises(ValueError, match="a context_fn .* around a torch.compile'd function"):
        prefire.checkpoint(layers[0], x, context_fn=sac)
    # so a plan measures no selective checkpoint of a compiled block, and never chooses one
    planner = prefire.plan_checkpoints(layers, memory_budget=600, selective=True)  # above the least (528)
    for _ in range(2):
        got = torch.autograd.grad(layers[1](layers[0](x)).sum(), [x])
        torch.testing.assert_close(got, expected)
    assert [c.selective_bytes for c in planner.costs] == [-1, -1]
    assert not any(planner.plan.selective)


def test_the_planner_core_from_python():
    blocks = [prefire.BlockCost(saved_bytes=100, input_bytes=10, recompute_seconds=1.0),
              prefire.BlockCost(saved_bytes=100, input_bytes=10, recompute_seconds=3.0)]
    pipeline = prefire.Release.AT_STEP_END  # the default, as in C++
    # in one backward pass the least is block 0 checkpointed and block 1 kept: block 0 recomputes (10 + 100)
    # before block 1 is there, and then block 1 holds 10 + 100; a pipeline's least checkpoints both
    assert prefire.least_plan_bytes(blocks, ONE_PASS) == 110 and prefire.least_plan_bytes(blocks) == 120
    plan = prefire.plan_for_budget(blocks, 200, ONE_PASS)
    assert list(plan.checkpointed) == [False, False] and plan.peak_bytes == 200 and plan.recompute_seconds == 0
    # in one backward pass, block 1's backward has let go before block 0 recomputes: 10 + 100 at most
    plan = prefire.plan_for_budget(blocks, 199, ONE_PASS)
    assert list(plan.checkpointed) == [True, False] and plan.recompute_seconds == 1.0 and plan.peak_bytes == 110
    # a pipeline may hold block 1 while block 0 recomputes: 100 + 10 + 100 > 199
    plan = prefire.plan_for_budget(blocks, 199)
    assert list(plan.checkpointed) == [True, True] and plan.recompute_seconds == 4.0
    assert plan.prefire_ahead == 0 and plan.peak_bytes == 120 == prefire.plan_bytes(blocks, [True, True], 0, pipeline)
    with pytest.raises(ValueError, match="below the least any plan holds: 110 bytes"):
        prefire.plan_for_budget(blocks, 109, ONE_PASS)
    with pytest.raises(ValueError, match="below the least any plan holds: 120 bytes"):
        prefire.plan_for_budget(blocks, 119)
    with pytest.raises(ValueError, match="in_flight=2"):
        prefire.plan_for_budget([prefire.BlockCost(saved_bytes=100, input_bytes=10, recompute_seconds=1.0, in_flight=2)],
                                1000, ONE_PASS)


def test_costs_and_plans_go_by_field_name():
    """Note [Costs and plans by name]: keywords only, and dicts that name
    every field, both ways; a missing or unknown field is an error naming it."""
    cost = prefire.BlockCost(saved_bytes=100, input_bytes=10, recompute_seconds=1.0, in_flight=2, group=0,
                             alive=[1, 2, 0], done=[0, 0, 2], passes=[0, 1, 1], saved_after_bytes=5,
                             selective_bytes=40, selective_seconds=0.25)
    with pytest.raises(TypeError):
        prefire.BlockCost(100, 10, 1.0)  # by position: refused
    with pytest.raises(TypeError, match="missing field.s. recompute_seconds"):
        prefire.BlockCost(saved_bytes=100, input_bytes=10)
    with pytest.raises(TypeError, match="unknown field.s. swap_bytes"):
        prefire.BlockCost(saved_bytes=100, input_bytes=10, recompute_seconds=1.0, swap_bytes=3)
    with pytest.raises(TypeError, match="field alive got str"):
        prefire.BlockCost(saved_bytes=100, input_bytes=10, recompute_seconds=1.0, alive="1, 2")
    defaults = prefire.BlockCost(saved_bytes=100, input_bytes=10, recompute_seconds=1.0)  # the C++ struct's
    assert (defaults.in_flight, defaults.group, defaults.selective_bytes, defaults.offload_bytes) == (1, -1, -1, -1)
    d = cost.to_dict()
    assert list(d) == list(prefire.BlockCost.FIELDS) and d["alive"] == [1, 2, 0] and d["selective_bytes"] == 40
    again = prefire.BlockCost.from_dict(json.loads(json.dumps(d)))
    assert again.to_dict() == d
    with pytest.raises(ValueError, match="missing field.s. passes"):
        prefire.BlockCost.from_dict({k: v for k, v in d.items() if k != "passes"})
    with pytest.raises(ValueError, match="unknown field.s. swap_bytes"):
        prefire.BlockCost.from_dict(dict(d, swap_bytes=3))
    plan = prefire.plan_for_budget([cost, cost], 10 ** 6)
    p = plan.to_dict()
    assert p["choices"] == ["KEEP", "KEEP"] and list(p) == list(prefire.Plan.FIELDS)
    assert prefire.Plan.from_dict(json.loads(json.dumps(p))).to_dict() == p
    # what the planner says of a plan is what describe_plan says of its choices
    described = prefire.describe_plan([cost, cost], plan.choices, 10 ** 6, plan.prefire_ahead)
    assert described.to_dict() == p


def test_offload_is_the_fourth_choice_where_its_costs_are_given():
    """Note [Offloaded blocks in a plan]: offload_bytes -1 offers nothing;
    given, a block whose copy into the tier hides behind a forward costs
    its fetch, and is chosen over its recomputation where the plan leaves
    room for one copy in flight; where it does not, every copy would keep
    forward waiting, and the planner recomputes instead."""
    def block(offload_bytes=-1, offload_seconds=1.5e-3):
        return prefire.BlockCost(saved_bytes=12 << 20, input_bytes=1 << 20, recompute_seconds=1e-3, in_flight=2,
                                 offload_bytes=offload_bytes, offload_moved_bytes=13 << 20,
                                 offload_seconds=offload_seconds, offload_hidden=0.5)
    assert prefire.choice_seconds(block(0), prefire.Choice.OFFLOAD) == pytest.approx(0.75e-3)
    # a copy into the tier longer than a forward (the recomputation's time) leaves the rest exposed
    assert prefire.choice_seconds(block(0, 4e-3), prefire.Choice.OFFLOAD) == pytest.approx(2e-3 + 1e-3)
    none = prefire.plan_bytes([block()] * 4, [False] * 4, 0, prefire.Release.AT_STEP_END)
    roomy = prefire.plan_for_budget([block(0)] * 4, none // 3)  # the fetch's 12 MiB and a 13 MiB copy fit
    assert list(roomy.choices) == [prefire.Choice.OFFLOAD] * 4 and list(roomy.offloaded) == [True] * 4
    assert roomy.recompute_seconds == pytest.approx(4 * 0.75e-3)
    assert roomy.peak_bytes + (13 << 20) <= none // 3
    tight = prefire.plan_for_budget([block(0)] * 4, none // 4)  # offloading fits, a copy in flight beside it not
    assert prefire.describe_plan([block(0)] * 4, [prefire.Choice.OFFLOAD] * 4, none // 4).peak_bytes <= none // 4
    assert list(tight.choices) == [prefire.Choice.CHECKPOINT] * 4, tight.choices
    recompute_only = prefire.plan_for_budget([block()] * 4, none // 4)
    assert prefire.Choice.OFFLOAD not in list(recompute_only.choices)
    assert recompute_only.recompute_seconds == pytest.approx(4e-3)


def test_the_planner_says_what_each_pass_holds_and_the_room_it_leaves():
    """Plan.pass_bytes, blocks_bytes and room_bytes (Note [What a plan
    holds]): a group's checkpointed blocks recompute together; the room
    beside the blocks while an action runs is the budget less the more of
    what they hold before and after it."""
    def block(group, alive):
        return prefire.BlockCost(saved_bytes=100, input_bytes=10, recompute_seconds=1.0, in_flight=2, group=group,
                                 alive=alive)
    blocks = [block(0, [1, 2, 1, 0]), block(0, [1, 2, 1, 0]), block(1, [0, 1, 1, 1])]
    C = prefire.Choice
    plan = prefire.describe_plan(blocks, [C.CHECKPOINT, C.CHECKPOINT, C.KEEP], 1000)
    assert list(plan.pass_bytes) == [200, 200, 0]
    assert list(plan.moment_bytes) == [20, 140, 120, 100] and plan.blocks_bytes == 140
    assert list(plan.room_bytes) == [980, 860, 860, 880]
    assert plan.peak_bytes == 140 + 200 == prefire.plan_bytes(blocks, [True, True, False])


def test_the_same_costs_give_one_plan_through_python_and_prefire_bench(tmp_path):
    """The planner is one: costs planned through the Python API and through
    prefire-bench (C++, ``--plan``) give the same plan, moments, passes and
    room, per micro-batch over a ZBV rank's actions and per block."""
    bench = os.environ.get("PREFIRE_BENCH")
    if not bench:
        pytest.skip("PREFIRE_BENCH (prefire-bench's path) is not set; ctest sets it")
    from pipeline_sim.replay import rank_orders
    from prefire.pipelining.plans import rank_items

    rng = random.Random(38)
    micro_batches = 4
    actions = rank_orders("zbv", 2, micro_batches)[0]
    stages = sorted({s for _, s, _ in actions})
    blocks = []
    for stage in stages:
        for _ in range(2):
            saved = rng.randint(1 << 20, 8 << 20)
            selective = rng.random() < 0.5
            blocks.append(prefire.BlockCost(saved_bytes=saved, input_bytes=saved // 8,
                                            recompute_seconds=rng.uniform(1e-3, 5e-3), group=stage,
                                            selective_bytes=saved // 3 if selective else -1,
                                            selective_seconds=1e-4 if selective else 0.0))
    items = rank_items(blocks, actions, micro_batches)
    path = tmp_path / "costs.json"
    for name, costs, extra in (("per micro-batch", items, {"actions": [list(a) for a in actions],
                                                          "micro_batches": micro_batches}),
                               ("per block", blocks, {})):
        least, most = prefire.least_plan_bytes(costs), prefire.plan_bytes(costs, [False] * len(costs))
        for budget in (least, (least + most) // 2, most):
            plan = prefire.plan_for_budget(costs, budget)
            path.write_text(json.dumps(dict(memory_budget=budget, blocks=[b.to_dict() for b in blocks], **extra)))
            out = subprocess.run([bench, "--plan", str(path)], capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            assert json.loads(out.stdout) == plan.to_dict(), (name, budget)
            assert any(plan.checkpointed) or budget == most
    # a file that names a field the planner does not know is refused, naming it
    path.write_text(json.dumps(dict(memory_budget=1 << 40, blocks=[dict(blocks[0].to_dict(), offload=1)])))
    out = subprocess.run([bench, "--plan", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "unknown field offload" in out.stderr
