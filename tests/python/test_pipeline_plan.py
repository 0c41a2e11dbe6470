"""enable(schedule, memory_budget=...): a pipeline rank's keep/checkpoint plan
from a memory budget (Note [A pipeline rank's memory plan]), on a ZBV
schedule whose two stages share this rank: the budget holds at every step,
the measuring one included, gradients stay exact under every plan, a shape
change re-plans, and a budget below the least plan says that least."""

import contextlib
import functools
import random
import statistics

import pytest
import torch
from torch import nn
from torch.distributed import pipelining as pp
from torch.utils._pytree import tree_flatten

import prefire
from prefire import pipelining
from prefire.pipelining import _plan as _pipeline_plan
from prefire._selective import ModeCosts
from pipeline_bench.model import GPT, ModelConfig, Stage, data, loss_fn, reference_gradients
from pipeline_bench.sweep import plan_letters

TINY = ModelConfig(vocab=64, dim=32, heads=2, blocks=4, seq=16, batch=4, micro_batches=2)


def planned_gpt(memory_budget, cfg=TINY):
    model = GPT(cfg)
    modules = [Stage(model, i, 2, lambda b, x: prefire.checkpoint(b, x)) for i in range(2)]
    return modules, loss_fn, data(cfg), memory_budget


class Residual(nn.Module):
    """x + W2 gelu(W1 x): a block whose saved bytes grow with ``hidden``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Blocks(nn.Module):
    def __init__(self, blocks, run_block) -> None:
        super().__init__()
        self.blocks, self.run_block = nn.ModuleList(blocks), run_block

    def forward(self, x):
        for block in self.blocks:
            x = self.run_block(block, x)
        return x


def mse(out, target):
    return ((out - target) ** 2).mean()


class Run:
    """One ZBV schedule on this rank over two stage modules; ``step()``
    returns the gradients and the most the step held (the census: blocks'
    saved tensors and inputs, recomputations)."""

    def __init__(self, modules, loss, batch, memory_budget=None, selective=None, choices=None) -> None:
        self.modules = modules
        self.stages = [pp.PipelineStage(m, i, 2, torch.device("cpu")) for i, m in enumerate(modules)]
        self.schedule = pp.ScheduleZBVZeroBubble(self.stages, 2, loss_fn=loss)
        self.batch = batch
        self.sessions = (pipelining.enable(self.schedule, memory_budget=memory_budget, selective=selective,
                                           choices=choices)
                         if memory_budget is not None else None)

    def step(self, batch=None):
        inputs, targets = batch or self.batch
        for m in self.modules:
            m.zero_grad(set_to_none=True)
        for stage in self.stages:  # what torch's stages keep of the last step until the next one begins
            type(stage).clear_runtime_states(stage)
        prefire.reset_runtime_peak()
        held_before = prefire.runtime_stats().held_bytes
        self.schedule.step(inputs, target=targets)
        grads = {n: p.grad.clone() for m in self.modules for n, p in m.named_parameters() if p.grad is not None}
        return grads, prefire.runtime_stats().peak_held_bytes - held_before

    def close(self):
        if self.sessions is not None:
            self.sessions.disable()


def bounds(modules, loss, batch, selective=None):
    """From a measuring step: the least budget every step holds, the
    measuring one included (what it holds, checkpointing every block; the
    least any plan holds may be lower, then the measuring step holds more
    than such a budget), what keeping every block holds, and the least any
    plan holds."""
    run = Run(modules, loss, batch, memory_budget=1 << 40, selective=selective)
    run.step()
    costs = run.sessions.plan.costs
    least = run.sessions.least_memory_budget()
    run.close()
    measuring = prefire.plan_bytes(costs, [True] * len(costs))
    return max(least, measuring), prefire.plan_bytes(costs, [False] * len(costs)), least


def sweep(make, steps=3, selective=None, at=(0.0, 0.25, 0.5, 0.75, 1.0)):
    """Every budget from the least plan to keeping everything: the budget
    holds at every step and the gradients equal the unchecked run's. The
    plans: per stage, its blocks' choices (k: kept, c: checkpointed, s:
    selectively)."""
    modules, loss, batch, _ = make(None)
    expected, _ = Run([unchecked(m) for m in modules], loss, batch).step()
    least, most, _ = bounds(*make(None)[:3], selective=selective)
    assert least < most
    plans = set()
    for share in at:
        budget = least + int(share * (most - least))
        run = Run(*make(budget)[:3], memory_budget=budget, selective=selective)
        for step in range(steps):
            grads, held = run.step()
            assert held <= budget, (share, step, held, budget)
            assert grads.keys() == expected.keys()
            assert all(torch.equal(grads[n], expected[n]) for n in expected), (share, step)
        plan = run.sessions.plan
        assert plan.plan.peak_bytes <= budget
        plans.add(tuple(plan_letters(p.to_dict()["choices"]) for p in plan.stages.values()))
        run.close()
    return plans


def checkpoints(plan):
    """How many (stage, micro-batch, block) a plan checkpoints: ``plan`` per
    stage, micro-batch and block, whether checkpointed (``RankPlan.checkpointed``)
    or the choice by name (the pipeline program's JSON)."""
    return sum(c not in (False, "KEEP") for per_micro_batch in plan.values() for blocks in per_micro_batch
               for c in blocks)


def unchecked(module):
    """The same module with its blocks run unchecked (the reference)."""
    module.run_block = lambda block, x: block(x)
    return module


def test_every_budget_holds_and_gradients_stay_exact_under_every_plan(one_rank):
    plans = sweep(lambda budget: planned_gpt(budget))
    assert len(plans) >= 3  # the sweep runs several plans, not one
    # the least budget keeps the last stage's blocks: their passes run where the rank holds less than
    # at its peak (Note [What a plan holds]), so keeping them costs nothing there and saves their recomputation
    assert ("cc", "kk") in plans and ("kk", "kk") in plans


def selective_gpt(memory_budget, cfg=TINY):
    """planned_gpt with torch's selective checkpointing inside each block:
    attention's outputs are cached, the rest recomputed."""
    import functools

    import torch.utils.checkpoint as torch_checkpoint

    ops = [torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default]
    context_fn = functools.partial(torch_checkpoint.create_selective_checkpoint_contexts, ops)
    model = GPT(cfg)
    modules = [Stage(model, i, 2, lambda b, x: prefire.checkpoint(b, x, context_fn=context_fn)) for i in range(2)]
    return modules, loss_fn, data(cfg), memory_budget


def test_selective_checkpoints_are_planned_with_their_cache_and_recompute_again_for_w(one_rank):
    """Blocks whose checkpoint runs torch's SAC: the measuring step, whose
    W recomputes after B let go, works (SAC alone raises there), a
    checkpointed block is counted with what SAC caches, and every budget
    holds with exact gradients (Note [Selective checkpointing inside
    prefire])."""
    plans = sweep(selective_gpt)
    assert len(plans) >= 2
    runs = []
    for make in (planned_gpt, selective_gpt):
        run = Run(*make(None)[:3], memory_budget=1 << 40)
        run.step()
        runs.append(run.sessions.plan.costs)
        run.close()
    for plain, selective in zip(*runs):
        assert selective.saved_bytes == plain.saved_bytes  # kept, a block runs unchecked either way
        assert selective.input_bytes > plain.input_bytes   # checkpointed, it holds SAC's cache too


class Gated(nn.Module):
    """x + W2 (h * sigmoid(h) * tanh(h)), h = W1 x: a block that saves
    several tensors of h's size beside the matrix product's output, so that
    a selective checkpoint (the products kept) holds a quarter of what it
    saves."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        h = self.up(x)
        return x + self.down(h * torch.sigmoid(h) * torch.tanh(h))


def gated_blocks(memory_budget):
    torch.manual_seed(0)
    blocks = [Gated(16, 64) for _ in range(4)]
    run_block = lambda b, x: prefire.checkpoint(b, x)  # noqa: E731
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(4, 8, 16, generator=g), torch.randn(4, 8, 16, generator=g))
    return [Blocks(blocks[:2], run_block), Blocks(blocks[2:], run_block)], mse, batch, memory_budget


def test_a_selective_checkpoint_is_a_third_choice_that_holds_every_budget_with_exact_gradients(one_rank,
                                                                                              monkeypatch):
    """enable(memory_budget=..., selective=True): the measuring step finds
    what each block's selective checkpoint (matrix products kept) would
    hold and recompute, some budget's plan checkpoints blocks selectively,
    and every plan holds its budget with the gradients of the unchecked run
    (Note [Selective checkpoints in a plan]). SAC's dispatch costs, which
    on these tiny blocks outweigh their ops (Note [Measuring a selective
    checkpoint]), are taken as none here, so that the choice follows bytes
    and op time alone. A selective recomputation is charged all the block
    saves where it runs, so it beats keeping the block only where it holds
    less than half of that (with two micro-batches in flight): these gated
    blocks, not the GPT's."""
    monkeypatch.setattr(_pipeline_plan, "mode_costs", lambda policy_fn: ModeCosts(probe=0.0, sac=0.0))
    plans = sweep(gated_blocks, selective=True, at=(0.0, 0.2, 0.35, 0.5, 0.65, 0.8, 1.0))
    assert any("s" in stage for plan in plans for stage in plan), plans
    assert ("kk", "kk") in plans
    run = Run(*gated_blocks(None)[:3], memory_budget=1 << 40, selective=True)
    run.step()
    for cost in run.sessions.plan.costs:  # between its inputs and all it saves, and cheaper to recompute
        assert cost.input_bytes < cost.selective_bytes < cost.saved_bytes / 2
        assert 0 < cost.selective_seconds < cost.recompute_seconds
    run.close()


def test_a_call_with_a_context_fn_of_its_own_gets_no_selective_choice(one_rank):
    """A block that runs torch's SAC itself keeps it: the plan never swaps
    what the user chose for its own policy."""
    run = Run(*selective_gpt(None)[:3], memory_budget=1 << 40, selective=True)
    run.step()
    assert all(cost.selective_bytes == -1 for cost in run.sessions.plan.costs)
    run.close()
    sweep(selective_gpt, selective=True, at=(0.0, 0.5, 1.0))


def test_selective_misuse_is_a_clear_error(one_rank):
    modules, loss, batch, _ = planned_gpt(None)
    stages = [pp.PipelineStage(m, i, 2, torch.device("cpu")) for i, m in enumerate(modules)]
    schedule = pp.ScheduleZBVZeroBubble(stages, 2, loss_fn=loss)
    with pytest.raises(ValueError, match="selective= is a choice of memory_budget's plan"):
        pipelining.enable(schedule, selective=True)
    with pytest.raises(ValueError, match="takes OpOverloads"):
        pipelining.enable(schedule, memory_budget=1 << 30, selective=[torch.ops.aten.mm])
    with pytest.raises(TypeError, match="selective= must be True"):
        pipelining.enable(schedule, memory_budget=1 << 30, selective=3)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_budget_holds_on_random_block_sizes(one_rank, seed):
    rng = random.Random(seed)
    hidden = [rng.choice([8, 32, 64, 128, 256]) for _ in range(6)]

    def make(budget):
        torch.manual_seed(seed)
        blocks = [Residual(16, h) for h in hidden]
        run_block = lambda b, x: prefire.checkpoint(b, x)  # noqa: E731
        modules = [Blocks(blocks[:3], run_block), Blocks(blocks[3:], run_block)]
        g = torch.Generator().manual_seed(seed)
        batch = (torch.randn(4, 8, 16, generator=g), torch.randn(4, 8, 16, generator=g))
        return modules, mse, batch, budget

    sweep(make)


def test_a_shape_change_measures_and_plans_again_and_each_shape_keeps_its_plan(one_rank):
    modules, loss, (tokens, targets), _ = planned_gpt(None)
    least, most, _ = bounds(*planned_gpt(None)[:3])
    run = Run(modules, loss, (tokens, targets), memory_budget=(least + most) // 2)
    short = (tokens[:, :8].contiguous(), targets[:, :8].contiguous())
    run.step()
    assert run.sessions.planner.measuring_steps == 1
    long_plan = run.sessions.plan
    run.step()  # the first planned step sees what the last stage's kept blocks hold after W: it may plan again
    assert run.sessions.planner.measuring_steps == 1 and run.sessions.plan.key == long_plan.key
    long_plan = run.sessions.plan
    run.step(short)
    assert run.sessions.planner.measuring_steps == 2
    short_plan = run.sessions.plan
    assert short_plan is not long_plan and short_plan.key != long_plan.key
    # half the sequence saves less: the same budget keeps more
    assert checkpoints(short_plan.checkpointed) < checkpoints(long_plan.checkpointed)
    run.step()
    assert run.sessions.plan.key == long_plan.key
    run.step(short)
    assert run.sessions.planner.measuring_steps == 2  # each shape kept its plan
    assert run.sessions.plan.key == short_plan.key
    # a new budget plans every shape again from what was measured, measuring nothing again
    run.sessions.set_memory_budget(least)
    for batch, before in ((None, long_plan), (short, short_plan)):
        _, held = run.step(batch)
        plan = run.sessions.plan
        assert held <= least and plan.plan.peak_bytes <= least and plan.key == before.key
        assert checkpoints(plan.checkpointed) >= checkpoints(before.checkpointed)
    assert run.sessions.planner.measuring_steps == 2
    run.close()


def test_a_budget_below_the_least_plan_says_the_least_and_the_least_works(one_rank):
    """The least budget is the least any plan holds (the planner's rule, as
    a plain model's): below it a ValueError names it; at it the later steps
    hold it, and the measuring step, which checkpoints every block and here
    holds more, says so."""
    every_step, _, least = bounds(*planned_gpt(None)[:3])
    run = Run(*planned_gpt(None)[:3], memory_budget=least - 1)
    with pytest.raises(ValueError, match=f"memory_budget={least - 1} bytes is below the least any plan of this "
                                         f"rank's blocks holds: {least} bytes"):
        run.step()
    run.close()
    run = Run(*planned_gpt(None)[:3], memory_budget=least)
    with pytest.warns(UserWarning, match=f"the measuring step checkpointed every block and held up to {every_step} "
                                         f"bytes, above memory_budget={least}") if least < every_step else \
            contextlib.nullcontext():
        _, held = run.step()
    assert held <= every_step
    for _ in range(2):
        _, held = run.step()
        assert held <= least
    assert run.sessions.plan.plan.peak_bytes <= least
    run.close()
    run = Run(*planned_gpt(None)[:3], memory_budget=every_step)  # every step within it, the measuring one too
    for _ in range(2):
        _, held = run.step()
        assert held <= every_step
    assert "stage 0: checkpoints [0, 1] of 2 blocks" in run.sessions.describe_plan()
    run.close()


def test_memory_budget_misuse_is_a_clear_error(one_rank):
    modules, loss, batch, _ = planned_gpt(None)
    stages = [pp.PipelineStage(m, i, 2, torch.device("cpu")) for i, m in enumerate(modules)]
    schedule = pp.ScheduleZBVZeroBubble(stages, 2, loss_fn=loss)
    for bad in (-1, 1.5, True, "1GB"):
        with pytest.raises(ValueError, match="memory_budget must be a number of bytes"):
            pipelining.enable(schedule, memory_budget=bad)
    with pytest.raises(ValueError, match="memory_budget and budget_bytes exclude each other"):
        pipelining.enable(schedule, memory_budget=1 << 20, budget_bytes=1 << 20)
    sessions = pipelining.enable(schedule, memory_budget=1 << 30)
    assert sessions.describe_plan().endswith("no memory plan yet (the first training step measures)")
    with pytest.raises(ValueError, match="call set_memory_budget instead"):
        sessions.set_budget_bytes(0)
    sessions.disable()
    sessions = pipelining.enable(schedule)
    with pytest.raises(ValueError, match="set_memory_budget needs enable"):
        sessions.set_memory_budget(1 << 20)
    sessions.disable()


def test_given_choices_run_in_place_of_the_planners_with_exact_gradients_within_the_budget(one_rank):
    """Rule 9: choices the planner would not make (it keeps the last
    stage's blocks at the least budget) run as given, per micro-batch, and
    hold the budget from the step after the measuring one."""
    modules, loss, batch, _ = planned_gpt(None)
    expected, _ = Run([unchecked(m) for m in modules], loss, batch).step()
    every_step, most, _ = bounds(*planned_gpt(None)[:3])
    given = {0: [["KEEP", "CHECKPOINT"], ["CHECKPOINT", "CHECKPOINT"]],
             1: [[prefire.Choice.CHECKPOINT, prefire.Choice.KEEP], ["CHECKPOINT", "CHECKPOINT"]]}
    run = Run(*planned_gpt(None)[:3], memory_budget=most, choices=given)
    for step in range(3):
        grads, held = run.step()
        assert held <= max(every_step, most), step
        assert all(torch.equal(grads[n], expected[n]) for n in expected), step
    plan = run.sessions.plan
    assert {s: p.to_dict()["choices"] for s, p in plan.stages.items()} == \
        {s: [[c if isinstance(c, str) else c.name for c in row] for row in rows] for s, rows in given.items()}
    assert plan.plan.peak_bytes <= most
    run.close()


def test_given_choices_that_do_not_fit_are_a_clear_error(one_rank):
    modules, loss, batch, _ = planned_gpt(None)
    stages = [pp.PipelineStage(m, i, 2, torch.device("cpu")) for i, m in enumerate(modules)]
    schedule = pp.ScheduleZBVZeroBubble(stages, 2, loss_fn=loss)
    every = [["CHECKPOINT", "CHECKPOINT"]] * 2
    with pytest.raises(ValueError, match="choices= is a memory plan given in place of the planner's; pass "
                                         "memory_budget=N"):
        pipelining.enable(schedule, choices={0: every, 1: every})
    for bad, says in (({0: every}, r"from each of this rank's stages \[0, 1\]"),
                      ({0: every[:1], 1: every}, r"choices\[0\] must list 2 micro-batches' choices"),
                      ({0: every, 1: [["KEEP", "RECOMPUTE"]] * 2}, r"choices\[1\] lists \['KEEP', 'RECOMPUTE'\]")):
        with pytest.raises(ValueError, match=says):
            pipelining.enable(schedule, memory_budget=1 << 30, choices=bad)
    _, most, least = bounds(*planned_gpt(None)[:3])
    for choices, budget, says in (
            ({0: every, 1: [["SELECTIVE", "KEEP"]] * 2}, most, "chooses SELECTIVE for stage 1, micro-batch 0, "
                                                              r"block 0, which is offered \['KEEP', 'CHECKPOINT'\]"),
            ({0: [["KEEP", "KEEP"]] * 2, 1: [["KEEP", "KEEP"]] * 2}, least, "the given choices hold [0-9]+ bytes at "
                                                                            f"their peak, over memory_budget={least}"),
            ({0: every, 1: [["KEEP"]] * 2}, most, "choices for stage 1 name .1, 1. blocks per micro-batch; its "
                                                  "forward makes 2 checkpoint calls")):
        run = Run(*planned_gpt(None)[:3], memory_budget=budget, choices=choices)
        with pytest.raises(ValueError, match=says):
            run.step()
        run.close()


def test_a_forward_that_changes_its_checkpoint_calls_is_refused(one_rank):
    modules, loss, batch, _ = planned_gpt(None)
    run = Run(modules, loss, batch, memory_budget=1 << 30)
    run.step()
    # the blocks of stage 1 now run as one call: fewer calls than the plan was measured with
    inner = modules[1].run_block
    blocks = list(modules[1].blocks.values())
    modules[1].blocks = nn.ModuleDict({"2": nn.Sequential(*blocks)})
    modules[1].run_block = inner
    with pytest.raises(RuntimeError, match="stage 1's forward made 1 checkpoint calls where its plan was measured "
                                           "with 2"):
        run.step()
    run.close()


def test_the_memory_sweep_on_two_ranks_holds_every_budget_with_exact_gradients(no_children_left):
    from pipeline_bench import run
    from pipeline_bench.config import RunConfig
    from pipeline_sim.plan_search import search
    from pipeline_bench.sweep import TORCH, rows, table

    cfg = RunConfig(model=TINY, schedule="interleaved-zb", modes=TORCH + ("session", "plan", "plan-selective"),
                    memory_budgets=(0.0, 0.5, 2.0), meter_blocks=True, steps=2, warmup=2, timeout_s=120)
    summary = run(cfg, world=2)
    assert no_children_left()
    modes = summary["modes"]
    for name, m in modes.items():
        assert m["gradients"]["exact"], (name, m["gradients"])
    # none holds the most, torch's checkpoint on every block the least, on every rank
    for rank in range(2):
        held = {t: modes[t]["ranks"][rank]["peak_held_bytes"] for t in TORCH}
        assert held["none"] == max(held.values()) > held["torch"] == min(held.values())
    sweep = rows(summary)
    assert [r["name"] for r in sweep] == ["plan 0%", "plan 50%", "plan 200%", "plan-selective 0%",
                                          "plan-selective 50%", "plan-selective 200%"]
    every = summary["rounds"]["steps_s"]  # each measured step of each mode (one round), for the paired ratio
    assert set(every) == set(modes) and all(len(rounds) == 1 and len(rounds[0]) == 2 for rounds in every.values())
    for r in sweep:
        assert r["within_budget"], r
        pairs = [a / b for a, b in zip(every[r["name"]][0], every["none"][0])]
        assert r["plan_over_none_paired"] == pytest.approx(statistics.median(pairs))
        assert all(m <= b for m, b in zip(r["measuring_held"], r["budgets"])), r  # the measuring step too
    for least, _, most in (sweep[:3], sweep[3:]):
        assert all(checkpoints(plan) > 0 for plan in least["plan"])     # the least checkpoints on every rank
        assert not any(checkpoints(plan) for plan in most["plan"])      # twice none's keeps all
    # a plan per micro-batch: a rank keeps a block of one micro-batch and checkpoints it in another (their
    # lifetimes differ: on rank 0, stage 2's first micro-batch runs its B where the rank holds the most)
    assert any(len({tuple(blocks) for blocks in per_micro_batch}) > 1
               for r in sweep for plan in r["plan"] for per_micro_batch in plan.values()), sweep
    assert "torch-every2" in table(summary) and "plan-selective 50%" in table(summary)
    # the search tries the selective choice too where the plan had one: three per block, not two
    searched = {row["name"]: row for row in search(summary)}
    assert set(searched) == {r["name"] for r in sweep}
    for name in ("plan 200%", "plan-selective 200%"):
        assert searched[name]["chosen_over_best"] >= 1 - 1e-9
    blocks = len(searched["plan 200%"]["chosen"][0]) // 2  # per rank
    assert searched["plan 200%"]["plans_tried"] == (2 ** blocks) ** 2
    assert searched["plan-selective 200%"]["plans_tried"] == (3 ** blocks) ** 2


def test_a_uniform_budget_gives_every_rank_the_share_of_the_most_none_held_on_any(no_children_left):
    """uniform_budget: one budget for every rank (what an SPMD script passes),
    a share of the most none held on any rank, where the default gives each
    rank a share of its own."""
    from pipeline_bench import run
    from pipeline_bench.config import RunConfig
    from pipeline_bench.sweep import rows

    summaries = {uniform: run(RunConfig(model=TINY, schedule="zbv", modes=("none", "plan"), memory_budgets=(1.0,),
                                        uniform_budget=uniform, meter_blocks=True, steps=2, warmup=2,
                                        timeout_s=120), world=2)
                 for uniform in (False, True)}
    assert no_children_left()
    own, uniform = (rows(summaries[u])[0] for u in (False, True))
    none = [[r["peak_held_bytes"] for r in summaries[u]["modes"]["none"]["ranks"]] for u in (False, True)]
    assert none[0] == none[1] and min(none[0]) < max(none[0])  # the ranks hold apart: the test tells the two
    assert own["budgets"] == none[0]
    assert uniform["budgets"] == [max(none[1])] * 2
    for r in (own, uniform):
        assert r["within_budget"] and r["exact"], r


def test_bubble_prefires_under_a_memory_budget_keep_it_on_two_ranks_with_exact_gradients(no_children_left):
    """enable(schedule, bubble=True, memory_budget=...): bubble prefires
    hold their recomputations in the sessions, within what the plan left
    them; the budget holds in every step and the gradients stay exact."""
    from pipeline_bench import run
    from pipeline_bench.config import RunConfig
    from pipeline_bench.sweep import rows

    cfg = RunConfig(model=TINY, schedule="interleaved-zb", modes=("none", "plan-prefire"), memory_budgets=(0.0, 0.5),
                    meter_blocks=True, steps=3, warmup=3, timeout_s=120)
    summary = run(cfg, world=2)
    assert no_children_left()
    sweep = rows(summary)
    assert [r["name"] for r in sweep] == ["plan-prefire 0%", "plan-prefire 50%"]
    for r in sweep:
        assert r["within_budget"] and r["exact"], r
        assert all(m <= b for m, b in zip(r["measuring_held"], r["budgets"])), r
        # the filler ran: it prefired where the plan left the sessions room, and the budget refused it where
        # not (a plan keeps what blocks it can: a kept block saves its recomputation, a prefire only moves it)
        ranks = [rank["pipelining"] for rank in summary["modes"][r["name"]]["ranks"]]
        assert sum(p["bubble_prefires"] + p["bubble_refused"] for p in ranks) > 0, r


def keep_last_stage_graphs(patch):
    """Stands in a schedule that keeps the last stage's graphs to the step's
    end, as torch 2.11 to 2.14 do and 2.15 does not (Note [The last stage
    lets go of its graph after W]): a view of each output of the last
    stage's forward, dropped when the next step begins, and prefire told
    that the graph stayed."""
    kept = []
    forward, clear = pp.PipelineStage.forward_one_chunk, pp.PipelineStage.clear_runtime_states

    @functools.wraps(forward)
    def forward_keeping(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if self.is_last:
            kept.extend(t.view_as(t) for t in tree_flatten(out)[0]
                        if isinstance(t, torch.Tensor) and t.grad_fn is not None)
        return out

    @functools.wraps(clear)
    def clear_dropping(self, *args, **kwargs):
        kept.clear()
        return clear(self, *args, **kwargs)

    patch.setattr(pp.PipelineStage, "forward_one_chunk", forward_keeping)
    patch.setattr(pp.PipelineStage, "clear_runtime_states", clear_dropping)
    patch.setattr(pipelining._enable, "let_go_of_graph", lambda stage, schedule, micro_batch: False)


def test_the_last_stage_is_counted_by_what_its_blocks_hold_after_w_once_seen(one_rank, monkeypatch):
    # a schedule that keeps the last stage's graphs to the step's end (as torch's did, before prefire let go
    # of them: Note [The last stage lets go of its graph after W]): keeping everything holds what none holds;
    # the first plan counts the last stage's micro-batches to the step's end, whole, and cannot keep
    # everything within a hair above it
    keep_last_stage_graphs(monkeypatch)
    run = Run(*planned_gpt(None)[:3], memory_budget=1 << 40)
    for _ in range(3):
        _, everything = run.step()
    run.close()
    budget = everything * 102 // 100
    run = Run(*planned_gpt(None)[:3], memory_budget=budget)
    plans = []
    for _ in range(4):
        _, held = run.step()
        assert held <= budget
        plans.append(run.sessions.plan.checkpointed)
    assert checkpoints(plans[0]) > 0  # the first plan checkpoints some block
    assert checkpoints(plans[-1]) == 0  # once a last-stage block was seen after W: none
    last = [c for c in run.sessions.plan.costs if c.group == 1]
    assert all(0 < c.saved_after_bytes < c.saved_bytes for c in last)  # a share of it stays, not all
    assert all(c.saved_after_bytes == 0 for c in run.sessions.plan.costs if c.group == 0)
    run.close()


def test_the_last_stage_lets_go_of_its_graphs_after_w_and_the_plan_counts_nothing_after(one_rank, monkeypatch):
    expected = reference_gradients(TINY)
    held = {}
    for let_go in (False, True):
        with monkeypatch.context() as patch:
            if not let_go:
                keep_last_stage_graphs(patch)
            run = Run(*planned_gpt(None)[:3], memory_budget=1 << 40)  # every block kept once planned
            for _ in range(3):
                grads, held[let_go] = run.step()
            assert all(torch.equal(grads[n], expected[n]) for n in expected)
            after = [c.saved_after_bytes for c in run.sessions.plan.costs if c.group == 1]
            assert checkpoints(run.sessions.plan.checkpointed) == 0
            if let_go:
                assert after == [0] * len(after) and run.sessions.stats().graphs_let_go > 0
                losses = []
                inputs, targets = run.batch
                out = run.schedule.step(inputs, target=targets, losses=losses)
                # the caller gets values without a graph: the same as torch computes (the outputs merged)
                assert out.grad_fn is None and all(loss.grad_fn is None for loss in losses)
                assert len(losses) == 2 and all(torch.isfinite(loss) for loss in losses)
            else:
                assert all(a > 0 for a in after)
            run.close()
    assert held[True] < held[False]  # the last stage's kept blocks no longer hold to the step's end

