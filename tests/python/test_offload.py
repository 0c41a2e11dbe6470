"""Offloaded checkpoints from Python (prefire.checkpoint(..., offload_to=tier),
whole or offload_inputs_only, on the host file tier, and the pinned host tier
on a GPU): gradients bit-equal to no checkpointing with dropout, the function
run once; B and W sharing one prefetched copy in a session
(torch's split backward); checkpoint_wrapper; transformers models through
prefire.integrations.transformers; the saved bytes leave the CPU allocator
(the instrument that sees every allocation) once their copies are written;
clear errors for a tier that cannot be made, a full tier and torch.compile.
CPU, one intra-op thread (conftest.py)."""

import copy
import json

import warnings

import pytest
import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

import prefire
from optional import requires

TIER_BYTES = 64 << 20


@pytest.fixture
def tier(tmp_path):
    return prefire.OffloadTier.host_file(tmp_path, TIER_BYTES)  # an os.PathLike, or a str


class Block(torch.nn.Module):
    def __init__(self, dim=32, p=0.2):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.down = torch.nn.Linear(4 * dim, dim)
        self.drop = torch.nn.Dropout(p)
        self.runs = 0

    def forward(self, x):
        self.runs += 1
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


def blocks(n=3, seed=0):
    torch.manual_seed(seed)
    return torch.nn.ModuleList(Block() for _ in range(n))


def grads(model, wrap, seed=1, device="cpu"):
    torch.manual_seed(seed)
    x = torch.randn(4, 8, 32, device=device, requires_grad=True)
    torch.manual_seed(seed + 1)
    y = x
    for b in model:
        y = wrap(b, y)
    y.square().sum().backward()
    out = [x.grad] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return out


def test_offloaded_blocks_give_unchecked_gradients_and_run_once(tier):
    model = blocks()
    expected = grads(model, lambda b, y: b(y))
    for b in model:
        b.runs = 0
    before = prefire.runtime_stats()
    got = grads(model, lambda b, y: prefire.checkpoint(b, y, offload_to=tier))
    after = prefire.runtime_stats()
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    assert [b.runs for b in model] == [1, 1, 1], "an offloaded block is read back, not run again"
    assert after.recomputations == before.recomputations
    assert after.offload_fetches - before.offload_fetches == 3
    assert tier.bytes_read == tier.bytes_written > 0
    assert tier.used_bytes == 0, "the tier's regions go with the graph"


def test_checkpoint_wrapper_takes_offload_to(tier):
    model = blocks(seed=2)
    expected = grads(model, lambda b, y: b(y))
    wrapped = torch.nn.ModuleList(prefire.checkpoint_wrapper(b, offload_to=tier) for b in model)
    got = grads(wrapped, lambda b, y: b(y))
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    assert tier.bytes_written > 0


def split(model, offload_to, prefetch, device="cpu"):
    """torch.distributed.pipelining's split backward on the blocks: B for the
    input, then W, sharing session 71."""
    torch.manual_seed(3)
    x = torch.randn(4, 8, 32, device=device, requires_grad=True)
    torch.manual_seed(4)
    with prefire.collect() as handles:
        y = x
        for b in model:
            y = prefire.checkpoint(b, y, offload_to=offload_to) if offload_to is not None else b(y)
    for h in handles:
        if prefetch:
            assert prefire.prefire(h, 71) == prefire.PrefireStatus.RECOMPUTED
        else:
            assert prefire.attach(h, 71)
    params = list(model.parameters())
    with prefire.session(71, retain_on_unpack=True):
        (dx,), groups = stage_backward_input([y], [torch.ones_like(y)], [x], iter(params))
    with prefire.session(71):
        stage_backward_weight(iter(params), groups)
    prefire.clear_session(71)
    out = [dx] + [p.grad.clone() for p in params]
    model.zero_grad()
    return out


@pytest.mark.parametrize("prefetch", [True, False])
def test_b_and_w_share_one_fetch_per_block_prefetched_or_lazy(tier, prefetch):
    model = blocks(seed=5)
    expected = split(model, None, False)
    before = prefire.runtime_stats()
    got = split(model, tier, prefetch)
    after = prefire.runtime_stats()
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    assert after.offload_fetches - before.offload_fetches == 3, "one fetch per block serves B and every W group"
    assert after.unshared_recomputations == before.unshared_recomputations
    assert after.recomputed_bytes == 0


def test_offloaded_bytes_leave_the_cpu_allocator_once_written(tier):
    prefire.count_cpu_allocations()
    model = blocks(seed=6)
    torch.manual_seed(7)
    x = torch.randn(4, 8, 32, requires_grad=True)

    def heap_after_forward(wrap):
        start = prefire.allocator_bytes("cpu").current
        y = x
        for b in model:
            y = wrap(b, y)
        tier.synchronize()
        return prefire.allocator_bytes("cpu").current - start, y

    unchecked, y0 = heap_after_forward(lambda b, y: b(y))
    recomputed, y1 = heap_after_forward(lambda b, y: prefire.checkpoint(b, y))
    offloaded, y2 = heap_after_forward(lambda b, y: prefire.checkpoint(b, y, offload_to=tier))
    # the inputs of blocks 2 and 3 go too (x is the caller's leaf)
    assert recomputed - offloaded == 2 * x.nbytes, "an offloaded chain holds less than a recomputed one: its inputs"
    assert unchecked - offloaded == tier.bytes_written, "the tier holds what the unchecked chain kept"
    del y0, y1
    y2.sum().backward()


def test_a_tier_that_cannot_be_made_or_is_full_says_so(tmp_path):
    with pytest.raises(prefire.CheckpointError, match="nonexistent"):
        prefire.OffloadTier.host_file(str(tmp_path / "nonexistent"), 1 << 20)
    with pytest.raises(ValueError, match="at least one page"):
        prefire.OffloadTier.host_file(str(tmp_path), 10)
    with pytest.raises(TypeError):
        prefire.OffloadTier.host_file(3, 1 << 20)
    small = prefire.OffloadTier.host_file(str(tmp_path), 2 * 4096)
    model = blocks(seed=8)
    x = torch.randn(4, 8, 32, requires_grad=True)
    with pytest.raises(prefire.CheckpointError, match="is full"):
        prefire.checkpoint(model[0], x, offload_to=small)
    small.synchronize()
    assert small.used_bytes == 0


def test_the_pinned_host_tier_says_why_it_cannot_be_made_here():
    with pytest.raises(ValueError, match="at least one page"):
        prefire.OffloadTier.pinned_host(10)
    # without a device, torch's FakeTensorMode (torch.compile enters it) leaves a fake CUDA device guard behind that
    # counts devices: prefire asks ATen, as torch.cuda.is_available does
    with torch._subclasses.fake_tensor.FakeTensorMode():
        pass
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the tier can be made")
    assert not prefire.cuda.cuda_available()
    with pytest.raises(prefire.CheckpointError, match="no CUDA device|CUDA parts"):
        prefire.OffloadTier.pinned_host(1 << 20)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
@pytest.mark.parametrize("prefetch", [True, False])
def test_the_pinned_host_tier_gives_cuda_blocks_unchecked_gradients(prefetch):
    tier = prefire.OffloadTier.pinned_host(TIER_BYTES)
    model = blocks(seed=10).cuda()
    expected = grads(model, lambda b, y: b(y), device="cuda")
    assert all(torch.equal(g, e) for g, e in zip(
        grads(model, lambda b, y: prefire.checkpoint(b, y, offload_to=tier), device="cuda"), expected))
    expected = split(model, None, False, device="cuda")
    before = prefire.runtime_stats()
    assert all(torch.equal(g, e) for g, e in zip(split(model, tier, prefetch, device="cuda"), expected))
    assert prefire.runtime_stats().offload_fetches - before.offload_fetches == 3
    tier.synchronize()
    assert tier.bytes_read == tier.bytes_written > 0
    assert tier.used_bytes == 0
    assert tier.measure_copy_seconds(1 << 20) > 0


def test_offload_inside_torch_compile_is_refused(tier):
    block = blocks(1, seed=9)[0]

    def f(x):
        return prefire.checkpoint(block, x, offload_to=tier)

    with pytest.raises(Exception, match="offload_to is not supported inside a region torch.compile traces"):
        torch.compile(f, backend="eager", fullgraph=True)(torch.randn(2, 32, requires_grad=True))


@requires("transformers")
@pytest.mark.parametrize("inputs_only", [False, True])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_transformers_layers_offloaded_train_bit_equal_to_unchecked(tier, kind, inputs_only):
    from test_transformers import count_runs, tiny, train

    from prefire.integrations import transformers as prefire_transformers

    unchecked = tiny(kind)
    unchecked.config.use_cache = False
    expected = train(unchecked, 2)
    offloaded = prefire_transformers.enable(tiny(kind), offload_to=tier, offload_inputs_only=inputs_only)
    runs = count_runs(offloaded)
    got = train(offloaded, 2)
    assert all(torch.equal(g, e) for g, e in zip(got[0], expected[0]))
    assert all(torch.equal(g, e) for g, e in zip(got[1], expected[1]))
    # two steps: a forward each, and with inputs only, a recomputation each
    assert runs == [4 if inputs_only else 2] * len(runs), runs
    assert tier.bytes_written > 0


def planned_step(model, x):
    torch.manual_seed(11)
    y = x
    for b in model:
        y = b(y)
    y.square().sum().backward()
    out = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    x.grad = None
    return out


def test_plan_checkpoints_offloads_where_recomputation_cannot_fit_and_holds_the_budget(tier):
    """A quarter of what keeping every block holds is below what any
    recompute-only plan holds (every block's inputs and one recomputation);
    with offload_to the planner offloads and the step holds the budget."""
    prefire.count_cpu_allocations()
    model = blocks(5, seed=12)
    torch.manual_seed(13)
    x = torch.randn(8, 16, 32, requires_grad=True)
    expected = planned_step(model, x)
    costs = measured_costs(model, x)
    none = sum(c.saved_bytes for c in costs)
    budget = none // 4
    assert budget < prefire.least_plan_bytes(costs, prefire.Release.IN_BACKWARD), "recompute-only cannot fit"
    with pytest.raises(ValueError, match="below the least"):
        planned_step(_planned(model, budget, None), x)
    planned = _planned(model, budget, tier)
    with pytest.warns(UserWarning, match="the measuring step checkpointed every block"):  # above the budget
        assert all(torch.equal(g, e) for g, e in zip(planned_step(planned, x), expected))
    plan = planned.planner.plan
    assert any(plan.offloaded) and plan.peak_bytes <= budget
    assert all(c.offload_seconds > 0 and c.offload_moved_bytes >= c.saved_bytes for c in planned.planner.costs)
    # the planned step: bit-equal, and by the allocator, what its forward leaves is within the budget
    before = prefire.allocator_bytes("cpu").current
    torch.manual_seed(11)
    y = x
    for b in planned:
        y = b(y)
    tier.synchronize()
    held = prefire.allocator_bytes("cpu").current - before - y.nbytes
    assert held <= budget, (held, budget)
    y.square().sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in planned.parameters()]
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    assert "offloaded" in planned.planner.describe()


def _planned(model, budget, offload_to):
    planned = copy.deepcopy(model)
    planned.planner = prefire.plan_checkpoints(planned, memory_budget=budget, offload_to=offload_to)
    return planned


def measured_costs(model, x):
    """The blocks' costs, as a planner's measuring step finds them (on a copy of ``model``)."""
    probe = copy.deepcopy(model)
    planner = prefire.plan_checkpoints(probe, memory_budget=10 ** 12)
    planned_step(probe, x)
    return planner.costs


def test_zbv_with_offloaded_blocks_fetches_each_once_per_micro_batch_and_matches_no_checkpointing(one_rank, tier):
    """torch's ZBV schedule with both stages on this rank: B and W split by
    the schedule share one fetch per block and micro-batch through
    prefire.pipelining's sessions; no block runs again."""
    from test_pipelining import TINY, count_runs, zbv_one_rank

    from prefire import pipelining
    from pipeline_bench.model import reference_gradients

    expected = reference_gradients(TINY)
    schedule, modules, step = zbv_one_rank(lambda b, x: prefire.checkpoint(b, x, offload_to=tier))
    sessions = pipelining.enable(schedule)
    runs = count_runs(modules)
    step()  # the first step also infers shapes
    for _ in range(2):
        runs.clear()
        before = prefire.runtime_stats()
        grads = step()
        after = prefire.runtime_stats()
        assert all(torch.equal(grads[n], expected[n]) for n in expected)
        assert runs == {b: TINY.micro_batches for b in range(TINY.blocks)}, "forward only"
        assert after.recomputations == before.recomputations
        assert after.offload_fetches - before.offload_fetches == TINY.blocks * TINY.micro_batches
        assert after.unshared_recomputations == before.unshared_recomputations
        assert after.held_bytes == 0
    sessions.disable()


@pytest.mark.parametrize("bubble", [False, True])
def test_a_pipeline_plan_at_a_budget_only_offloading_fits_holds_it_with_exact_gradients(one_rank, tier, bubble):
    """enable(schedule, memory_budget=..., offload_to=tier): the measuring
    step times each block's copies on the tier; at the least budget a plan
    with offload holds, below any recompute-only plan, the plan offloads,
    holds the budget, and the gradients stay exact, with bubble prefires
    prefetching offloaded blocks in the waits. (Above it, whether a block
    is offloaded or recomputed is the measured times' call.)"""
    from test_pipeline_plan import Run, planned_gpt, unchecked

    from prefire import pipelining

    modules, loss, batch, _ = planned_gpt(None)
    expected, _ = Run([unchecked(m) for m in modules], loss, batch).step()
    run = Run(*planned_gpt(None)[:3])
    run.sessions = pipelining.enable(run.schedule, bubble=bubble, memory_budget=1 << 40, offload_to=tier)
    run.step()  # measures
    planner = run.sessions.planner
    least = planner.least_budget()
    _, items = planner._items(planner.plan.key)
    recompute_only = [prefire.BlockCost.from_dict(dict(c.to_dict(), offload_bytes=-1)) for c in items]
    assert least < prefire.least_plan_bytes(recompute_only), "no recompute-only plan fits the least budget"
    with pytest.warns(UserWarning, match="the measuring step checkpointed every block"):
        run.sessions.set_memory_budget(least)
    fetches = prefire.runtime_stats().offload_fetches
    for step in range(5):
        grads, held = run.step()
        assert held <= least, (step, held, least)
        assert all(torch.equal(grads[n], expected[n]) for n in expected), step
    plan = run.sessions.plan
    assert plan.plan.peak_bytes <= least
    assert any(c == prefire.Choice.OFFLOAD for p in plan.stages.values() for blocks in p.choices for c in blocks)
    assert all(c.offload_seconds > 0 and c.offload_bytes == 0 for c in plan.costs)
    assert prefire.runtime_stats().offload_fetches > fetches
    assert "offloaded" in run.sessions.describe_plan()
    run.close()


def test_pipelining_offload_to_needs_a_memory_budget_and_a_tier(one_rank, tier):
    from test_pipeline_plan import Run, planned_gpt

    from prefire import pipelining

    run = Run(*planned_gpt(None)[:3])
    with pytest.raises(ValueError, match="offload_to= is a choice of memory_budget's plan"):
        pipelining.enable(run.schedule, offload_to=tier)
    with pytest.raises(TypeError, match="offload_to must be None or a prefire.OffloadTier"):
        pipelining.enable(run.schedule, memory_budget=1 << 30, offload_to="/tmp")


def test_zbv_on_two_ranks_plans_with_offload_hold_their_budgets_with_exact_gradients(no_children_left,
                                                                                   tmp_path_factory):
    """The pipeline program's plan-offload mode on 2 Gloo ranks (ZBV): at the
    least budget and at half of none's, every plan holds its budget and the
    gradients equal the single-process reference; at the least, a rank whose
    budget only a plan with offload fits offloads. The simulator's search and
    its predictions of both plans on more ranks take the run's costs."""
    from pipeline_bench import run
    from pipeline_bench.config import RunConfig
    from pipeline_bench.model import ModelConfig
    from pipeline_bench.sweep import rows

    tiny = ModelConfig(vocab=64, dim=32, heads=2, blocks=4, seq=16, batch=4, micro_batches=2)
    pace = 50e6  # bytes per second each way: a few ms per block here
    cfg = RunConfig(model=tiny, schedule="zbv",
                    modes=("none", "torch", "session", "plan", "plan-offload", "plan-offload-all"),
                    memory_budgets=(0.0, 0.5), meter_blocks=True, steps=2, warmup=2, timeout_s=120,
                    tier_bytes_per_second=pace)
    summary = run(cfg, world=2)
    assert no_children_left()
    sweep = {r["name"]: r for r in rows(summary)}
    assert set(sweep) == {f"{m} {f}%" for m in ("plan", "plan-offload", "plan-offload-all") for f in (0, 50)}
    for name, r in sweep.items():
        assert r["within_budget"] and r["exact"], (name, r)
    for rank in sweep["plan-offload-all 50%"]["plan"]:  # every block of every micro-batch, whatever the budget
        assert {c for per_stage in rank.values() for blocks in per_stage for c in blocks} == {"OFFLOAD"}, rank
    for r in summary["modes"]["plan-offload 50%"]["ranks"]:  # the planner measured the paced tier
        for cost in r["plan_costs"]:
            assert cost["offload_seconds"] >= 2 * cost["offload_moved_bytes"] / pace, cost
    # the least budget with offload is at most the recompute-only plan's; where it is below, only a plan that
    # offloads fits (which blocks, above it, is the measured times' call)
    least = list(zip(sweep["plan-offload 0%"]["budgets"], sweep["plan 0%"]["budgets"]))
    assert all(o <= p for o, p in least) and any(o < p for o, p in least), least
    for (o, p), rank in zip(least, sweep["plan-offload 0%"]["plan"]):
        if o < p:
            assert any(c == "OFFLOAD" for per_stage in rank.values() for blocks in per_stage for c in blocks), rank
    # the simulator's search tries offloading as a fourth choice; over a tier far slower than a
    # recomputation (an assumed bandwidth) its best plan at half of none's offloads nothing
    from pipeline_sim.plan_search import search

    searched = {row["name"]: row for row in search(summary)}
    assert {"plan-offload 0%", "plan-offload 50%"} <= set(searched)
    slow = {row["name"]: row for row in search(summary, bandwidth=1e3)}
    assert not any(o == prefire.Choice.OFFLOAD for per_micro_batch in slow["plan-offload 50%"]["best"] for o in per_micro_batch)
    # predictions on more ranks: both plans per rank within their budgets by the planner's count (or at their least
    # where they cannot hold it, said so), never faster than no checkpointing in the replay; offloading never
    # raises the least a plan holds; over the slow tier nothing is offloaded
    from pipeline_sim.plan_predict import predict_plans
    from pipeline_sim.cli import main as simulate

    for world in (2, 4):
        rows = predict_plans(summary, world, [0.25, 0.5])
        assert [(r["world"], r["fraction"], r["micro_batches"]) for r in rows] == [(world, 0.25, 2 * world),
                                                                                   (world, 0.5, 2 * world)]
        for r in rows:
            for kind in ("offload", "recompute"):
                plan = r[kind]
                assert len(plan["budgets"]) == world and plan["items"] > 0, (kind, r)
                if plan["fits"]:
                    assert all(h <= b for h, b in zip(plan["peak_bytes"], plan["budgets"])), (kind, r)
                assert plan["step_s"] >= r["none_s"] * (1 - 1e-9), (kind, r)
            assert r["offload"]["fits"] or not r["recompute"]["fits"], r
            assert r["recompute"]["offloaded_items"] == 0
    assert all(r["offload"]["offloaded_items"] == 0 for r in predict_plans(summary, 4, [0.5], bandwidth=1e3))
    path = tmp_path_factory.mktemp("predict") / "sweep.json"
    path.write_text(json.dumps(summary))
    assert simulate(["predict-plans", str(path), "--ranks", "4", "--fractions", "0.5"]) == 0
    # the joint plan from the same sweep's costs (Note [The joint plan]): within half of what keeping all holds
    out = path.parent / "place.json"
    assert simulate(["place", str(path), "--ranks", "2", "--schedules", "zbv", "--search-ranks", "0",
                     "--plan-sweep", str(path), "--json", str(out)]) == 0
    row, = json.loads(out.read_text())
    assert row["joint"]["fits"] and row["joint_peak_fraction"] <= 0.5 and row["h_search"] is None, row
    starts = [row["joint"][k] for k in ("planner_s", "recompute_only_s") if row["joint"][k] is not None]
    assert starts and row["joint_s"] <= min(starts) + 1e-12, row


def test_a_paced_tier_takes_its_bandwidths_time_per_copy(tmp_path):
    nbytes = 1 << 20
    paced = prefire.OffloadTier.host_file(tmp_path, TIER_BYTES, bytes_per_second=20e6)
    assert paced.measure_copy_seconds(nbytes) >= 2 * nbytes / 20e6, "one copy each way, each at least 52 ms"
    with pytest.raises(ValueError, match="bytes_per_second must be a finite number >= 0"):
        prefire.OffloadTier.host_file(tmp_path, TIER_BYTES, bytes_per_second=-1.0)


def test_queued_copies_count_as_held_until_written_and_backpressure_bounds_them(tmp_path):
    """A storage waiting for the tier is held: the census counts it until it
    is written; with max_pending_bytes a forward waits for the oldest copies
    (0: every copy written before forward goes on)."""
    tier = prefire.OffloadTier.host_file(tmp_path, TIER_BYTES, bytes_per_second=2e6)  # ~16 ms per block's 32 KiB
    model = blocks(4, seed=21)
    x = torch.randn(4, 8, 32, requires_grad=True)
    assert tier.max_pending_bytes >= 1 << 62, "no limit by default"
    held = prefire.runtime_stats().held_bytes
    y = x
    for b in model:
        y = prefire.checkpoint(b, y, offload_to=tier)
    pending = tier.pending_bytes
    assert pending > 0, "the copies lag behind forward"
    assert prefire.runtime_stats().held_bytes - held >= pending
    tier.synchronize()
    assert tier.pending_bytes == 0 and prefire.runtime_stats().held_bytes == held
    y.sum().backward()

    tier.max_pending_bytes = 0
    y = x
    for b in model:
        y = prefire.checkpoint(b, y, offload_to=tier)
        assert tier.pending_bytes == 0, "every copy written before forward goes on"
    y.sum().backward()
    with pytest.raises(ValueError, match="max_pending_bytes must be >= 0"):
        tier.max_pending_bytes = -1


class SavesBig(torch.autograd.Function):
    """Saves 64 times its input and gives a gradient of its input's size: a
    backward whose memory is all in what it reads back."""

    @staticmethod
    def forward(ctx, h):
        big = h.repeat(64, 1)
        ctx.save_for_backward(big)
        return h * 2

    @staticmethod
    def backward(ctx, g):
        (big,) = ctx.saved_tensors
        return g * big[: g.shape[0]]


def test_a_backward_that_reaches_a_block_still_being_copied_never_holds_it_twice(tmp_path):
    """A lazy fetch waits for the block's queued copies before it allocates
    what it reads into, and the census stops counting them as pending
    before it counts what was read back (Note [A lazy fetch waits before it
    allocates]): neither the allocator nor the census sees the block twice."""
    prefire.count_cpu_allocations()
    tier = prefire.OffloadTier.host_file(tmp_path, TIER_BYTES, bytes_per_second=20e6)  # ~0.2 s for the 4 MiB
    x = torch.randn(16, 1024, requires_grad=True)
    for _ in range(2):
        y = prefire.checkpoint(SavesBig.apply, x * 1, offload_to=tier)
        pending = tier.pending_bytes
        assert pending == 64 * x.nbytes, "backward starts while the saved tensor's copy is queued"
        held = prefire.runtime_stats().held_bytes
        prefire.reset_runtime_peak()
        with prefire.AllocatorPeak() as peak:
            y.sum().backward()
        assert peak.bytes < pending // 4, "the storage read back is made once the copy has let go of forward's"
        assert prefire.runtime_stats().peak_held_bytes == held, "the census counts the block once: pending, then read"
        assert torch.equal(x.grad, x), "the gradient reads forward's bytes back (g * big[:16] is x)"
        x.grad = None


def test_a_plan_with_offload_holds_its_budget_on_its_first_step_on_a_slow_tier(tmp_path):
    """The first planned step, not only later ones: by the allocator right
    after forward (no synchronize), what the blocks hold and what their copies
    still queued hold is within the budget (a tier at 4 MB/s lags a forward
    by every block; without backpressure this step held several blocks'
    saved tensors beyond the budget)."""
    prefire.count_cpu_allocations()
    tier = prefire.OffloadTier.host_file(tmp_path, TIER_BYTES, bytes_per_second=4e6)
    model = blocks(5, seed=12)
    torch.manual_seed(23)
    x = torch.randn(8, 16, 32, requires_grad=True)
    expected = planned_step(copy.deepcopy(model), x)
    budget = sum(c.saved_bytes for c in measured_costs(model, x)) // 4
    planned = _planned(model, budget, tier)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the measuring step may hold more than the budget
        planned_step(planned, x)
    plan = planned.planner.plan
    assert any(plan.offloaded) and tier.max_pending_bytes == budget - plan.peak_bytes
    torch.manual_seed(11)
    before = prefire.allocator_bytes("cpu").current
    y = x
    for b in planned:
        y = b(y)
    held = prefire.allocator_bytes("cpu").current - before - y.nbytes
    assert held <= budget, (held, budget, tier.pending_bytes)
    y.square().sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in planned.parameters()]
    assert all(torch.equal(g, e) for g, e in zip(got, expected))


def test_a_plan_refuses_an_offload_the_tier_cannot_hold(tmp_path):
    tier = prefire.OffloadTier.host_file(tmp_path, 49 * 4096)  # one block's saved tensors, not two
    model = blocks(5, seed=24)
    x = torch.randn(8, 16, 32, requires_grad=True)
    budget = sum(c.saved_bytes for c in measured_costs(model, x)) // 4  # only offloading fits
    planned = _planned(model, budget, tier)
    with pytest.raises(ValueError, match=r"the plan offloads \d+ bytes at once and the offload tier holds 200704"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            planned_step(planned, x)


class Masked(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(32, 32)

    def forward(self, x, mask):
        return self.linear(x) * mask  # saves mask


@pytest.mark.parametrize("own_counters", [False, True])
def test_a_storage_several_offloaded_checkpoints_save_is_written_once(tier, own_counters):
    """Once per storage and version counter (Note [One copy per storage]):
    through ``.data`` each save has a counter of its own, whose writes the
    others could not see, so each is written."""
    torch.manual_seed(25)
    model = torch.nn.ModuleList(Masked() for _ in range(4))
    x = torch.randn(4, 8, 32, requires_grad=True)
    mask = (torch.rand(8, 32) > 0.5).float()

    def step(wrap):
        m = mask.clone()
        y = x
        for b in model:
            y = wrap(b, y, m.data if own_counters else m)
        y.square().sum().backward()
        out = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
        x.grad = None
        model.zero_grad()
        return out

    unchecked = step(lambda b, y, m: b(y, m))
    written = tier.bytes_written
    got = step(lambda b, y, m: prefire.checkpoint(b, y, m, offload_to=tier))
    tier.synchronize()
    masks = 4 if own_counters else 1
    # the blocks write their linears' inputs (x, a leaf, is kept by reference) and the mask once per version
    assert tier.bytes_written - written == 3 * x.nbytes + masks * mask.nbytes
    assert all(torch.equal(g, e) for g, e in zip(got, unchecked))


def test_fetch_ahead_inside_backward_prefetches_an_offloaded_block_with_unchecked_gradients(tier):
    """A hook on block j's output gradient starts block j-1's fetch (the
    reload schedule's mechanism): every block but the top one is fetched
    ahead, the gradients are the unchecked ones, and outside a backward or
    for a block that is not offloaded fetch_ahead does nothing."""
    model = blocks(4, seed=26)
    expected = grads(model, lambda b, y: b(y))
    kinds = []
    prefire.set_recompute_observer(lambda kind, session, begin, end: kinds.append(kind))
    try:
        handles = []

        def wrap(b, y):
            with prefire.collect() as made:
                out = prefire.checkpoint(b, y, offload_to=tier)
            if handles:
                below = handles[-1]
                out.register_hook(lambda g: prefire.fetch_ahead(below) and None)
            handles.extend(made)
            return out

        got = grads(model, wrap)
    finally:
        prefire.set_recompute_observer(None)
    assert sorted(kinds) == ["lazy", "prefire", "prefire", "prefire"], "the top block fetches lazily, the rest ahead"
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    x = torch.randn(4, 8, 32, requires_grad=True)
    with prefire.collect() as made:
        y = prefire.checkpoint(model[0], x, offload_to=tier)
        z = prefire.checkpoint(model[1], y)
    assert not prefire.fetch_ahead(made[0]), "outside a backward"
    z.register_hook(lambda g: results.append(prefire.fetch_ahead(made[1])))
    results = []
    z.sum().backward()
    assert results == [False], "a recomputed checkpoint has nothing to fetch"


def test_a_plan_with_headroom_fetches_its_offloaded_blocks_ahead_by_its_reload_schedule(tier):
    """A top block that saves far more than the others sets the plan's
    peak; at a budget of that peak nothing below it can be kept or
    checkpointed (either would be held while the top block's backward runs),
    so the blocks between are offloaded, and the room the top block
    leaves while the blocks below run their backward is the reload
    schedule's: their fetches begin ahead (Note [A reload schedule for a
    plain backward])."""
    torch.manual_seed(27)
    wide = torch.nn.Sequential(torch.nn.Linear(32, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 32))
    model = torch.nn.ModuleList(list(blocks(4, seed=12)) + [wide])
    torch.manual_seed(13)
    x = torch.randn(8, 16, 32, requires_grad=True)
    expected = planned_step(model, x)
    costs = measured_costs(model, x)
    budget = max(c.saved_bytes for c in costs)
    assert budget >= 2 * max(c.saved_bytes for c in costs[:-1])
    planned = _planned(model, budget, tier)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planned_step(planned, x)
    plan, costs = planned.planner.plan, planned.planner.costs
    assert all(plan.offloaded[1:-1]), plan.choices
    schedule = prefire.reload_schedule(costs, plan.choices, budget)
    ahead = sum(len(s) for s in schedule)
    assert ahead >= 2, schedule
    kinds = []
    prefire.set_recompute_observer(lambda kind, session, begin, end: kinds.append(kind))
    try:
        got = planned_step(planned, x)
    finally:
        prefire.set_recompute_observer(None)
    assert kinds.count("prefire") == ahead and kinds.count("lazy") == sum(plan.offloaded) - ahead
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
