"""prefire.pipelining on torch.distributed.pipelining's own schedules.

In one process: a ZBV schedule whose two stages share the rank (no
receives), where sessions alone decide the recomputation count. Across
processes: the pipeline program (apps/pipeline_bench) on 2 ranks over Gloo,
every mode, started and torn down by the test."""

import copy
import gc
import re
import warnings

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.distributed import pipelining as pp

import prefire
from prefire import _compile, _warn_once, pipelining
from pipeline_bench import run
from pipeline_bench.config import RunConfig
from pipeline_bench.model import GPT, ModelConfig, Stage, data, loss_fn, reference_gradients
from test_fsdp import Block

@pytest.fixture(autouse=True)
def no_garbage_holds_saved_tensors():
    """The tests read prefire's process-wide held bytes: an earlier test's
    schedule, in reference cycles until collected, still holds its kept
    blocks' saved tensors (and any session it left open) on the census."""
    gc.collect()
    yield


TINY = ModelConfig(vocab=64, dim=32, heads=2, blocks=4, seq=16, batch=4, micro_batches=2)


def zbv_one_rank(run_block, cfg=TINY, shard=None):
    """A ZBV schedule whose two stages are both on this rank; returns the
    schedule, the stage modules and a function running one step (its
    gradients whole). ``shard``: applied to each stage module (fully_shard)."""
    model = GPT(cfg)
    modules = [Stage(model, i, 2, run_block) for i in range(2)]
    if shard is not None:
        modules = [shard(m) for m in modules]
    stages = [pp.PipelineStage(m, i, 2, torch.device("cpu")) for i, m in enumerate(modules)]
    schedule = pp.ScheduleZBVZeroBubble(stages, cfg.micro_batches, loss_fn=loss_fn)
    tokens, targets = data(cfg)

    def step():
        for m in modules:
            m.zero_grad(set_to_none=True)
        schedule.step(tokens, target=targets)
        return {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
                for m in modules for n, p in m.named_parameters()}

    return schedule, modules, step


def count_runs(modules):
    runs = {}
    for m in modules:
        for block in m.blocks.values():
            block.observer = lambda i, begin, end: runs.__setitem__(i, runs.get(i, 0) + 1)
    return runs


def test_sessions_recompute_each_block_once_per_micro_batch_where_torch_recomputes_in_b_and_w(one_rank):
    expected = reference_gradients(TINY)
    forward_runs = TINY.micro_batches

    schedule, modules, step = zbv_one_rank(lambda b, x: torch_checkpoint.checkpoint(b, x, use_reentrant=False))
    runs = count_runs(modules)
    step()  # the first step also runs the stages once to infer shapes
    runs.clear()
    grads = step()
    assert all(torch.equal(grads[n], expected[n]) for n in expected)
    # stage 0 runs one full backward (in W); stage 1 splits it: B, and W once per group of weights
    assert runs[0] == runs[1] == 2 * forward_runs
    assert runs[2] >= 3 * forward_runs and runs[3] >= 3 * forward_runs

    schedule, modules, step = zbv_one_rank(lambda b, x: prefire.checkpoint(b, x))
    sessions = pipelining.enable(schedule)
    runs = count_runs(modules)
    step()
    for _ in range(2):  # a later step reuses nothing of an earlier one
        runs.clear()
        grads = step()
        assert all(torch.equal(grads[n], expected[n]) for n in expected)
        assert runs == {b: 2 * forward_runs for b in range(TINY.blocks)}
        assert prefire.runtime_stats().held_bytes == 0  # every session cleared after its W
    stats = sessions.stats()
    assert stats.sessions == 6 * TINY.micro_batches and stats.max_session_bytes > 0
    assert stats.bubble_prefires == 0
    # after B, a session of stage 1 keeps only what its W read the first time
    # (Note [What a session keeps for W]): less than B held, and W found all of it
    assert stats.trimmed_after_b >= 2 * TINY.micro_batches and stats.trim_misses == 0
    assert 0 < sessions.budget.kept_bytes[1] < sessions.budget.stage_bytes[1]
    sessions.disable()
    sessions.disable()  # idempotent
    assert all("forward_one_chunk" not in vars(s) for s in schedule._stages)


class Compute(torch.nn.Module):
    """A block's math alone (no timing: nothing dynamo breaks its graph at)."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return self.block.compute(x)


def compiled_zbv_one_rank(wrap, make=torch.compile, shard=None, before_backward=None):
    """zbv_one_rank with each block's math compiled by ``make`` (inductor)
    and run as wrap(compiled block, x); also returns how often each block's
    compiled backward ran. ``before_backward(block)``: called as a block's
    compiled backward begins."""
    backward_runs = {}
    compiled = {}

    def run_block(block, x):
        fn = compiled.setdefault(block.index, make(Compute(block)))
        out = wrap(fn, x)
        assert type(out.grad_fn).__name__ == "CompiledFunctionBackward"

        def counted(grads, i=block.index):
            backward_runs[i] = backward_runs.get(i, 0) + 1
            if before_backward is not None:
                before_backward(block)
        out.grad_fn.register_prehook(counted)
        return out

    return *zbv_one_rank(run_block, shard=shard), backward_runs


@torch._functorch.config.patch(donated_buffer=False)
def test_w_takes_the_weight_gradients_a_compiled_blocks_backward_gave_in_b(one_rank):
    # Note [Weight gradients a custom Function computes in B]. torch's compiled
    # backward donates its buffers unless told not to, which B cannot run
    # (retain_graph): torch's own compiled blocks need this under a B/W split.
    mb = TINY.micro_batches
    expected = reference_gradients(TINY)
    plain = lambda f, x: f(x)  # noqa: E731
    for wrap, make in ((plain, torch.compile),
                       (lambda f, x: torch_checkpoint.checkpoint(f, x, use_reentrant=False), torch.compile),
                       (lambda f, x: prefire.checkpoint(f, x), torch.compile),
                       # recomputing with the compiled forward's program (Note [A compiled block's
                       # recomputation program])
                       (lambda f, x: prefire.checkpoint(f, x), prefire.compile),
                       # torchtitan's order: inside the compiled region prefire's checkpoint is torch's
                       (plain, lambda m: torch.compile(prefire.checkpoint_wrapper(m), fullgraph=True))):
        # whether block 3's weights had their gradients when block 2's backward began, in each step's first B
        # of stage 1 (which runs block 3's backward, then block 2's)
        ready = []

        def before_backward(block):
            if block.index == 2 and ready and ready[-1] is None:
                ready[-1] = all(p.grad is not None for p in block3.parameters())

        schedule, modules, step, backward_runs = compiled_zbv_one_rank(wrap, make, before_backward=before_backward)
        block3 = next(b for m in modules for b in m.blocks.values() if b.index == 3)
        step()
        backward_runs.clear()
        ready.append(None)
        torchs = step()
        # torch's: stage 0 runs its backward once (its W is a full backward), stage 1 in B and again in W
        assert backward_runs == {0: mb, 1: mb, 2: 2 * mb, 3: 2 * mb}
        assert ready[-1] is False  # torch's B dropped them: W makes them
        sessions = pipelining.enable(schedule)
        held = []  # prefire's held bytes at each step's peak
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for _ in range(2):
                backward_runs.clear()
                programs = _compile.program_runs
                prefire.reset_runtime_peak()
                ready.append(None)
                grads = step()
                held.append(prefire.runtime_stats().peak_held_bytes)
                assert backward_runs == {b: mb for b in range(TINY.blocks)}
                # added to .grad as soon as block 3's backward ran, not held through the rest of B
                assert ready[-1] is True
                if make is prefire.compile:  # one recomputation per block and micro-batch, by its program
                    assert _compile.program_runs - programs == TINY.blocks * mb
                # the same program on the same tensors: the same bits as torch's W
                assert all(torch.equal(grads[n], torchs[n]) for n in torchs)
                assert all(torch.allclose(grads[n], expected[n], rtol=1e-4, atol=1e-6) for n in expected)
                assert prefire.runtime_stats().held_bytes == 0
        # W taking them from B is what enable() is for here: no "the sessions do nothing"
        assert not [w for w in said if "made no prefire checkpoint" in str(w.message)]
        stats = sessions.stats()
        assert stats.w_groups_taken_in_b == 2 * 2 * mb  # stage 1's two blocks; its head is eager: W's
        assert stats.trim_misses == 0
        if stats.sessions:  # prefire's: W reads nothing of a session, so after B it keeps nothing
            assert stats.trimmed_after_b > 0 and sessions.budget.kept_bytes[1] == 0
            # and once a W said so, B lets go of each block's recomputation as its compiled backward unpacks it,
            # where the first step's first B held both of stage 1's blocks until it ended (Note [What a
            # session keeps for W])
            assert 0 < held[1] < 0.75 * held[0], held
        sessions.disable()


@torch._functorch.config.patch(donated_buffer=False)
def test_w_takes_from_b_on_fsdp2_stages_as_the_reduce_at_the_steps_end_expects(one_rank):
    # torch's stage runs every B and W of an FSDP2 stage without gradient sync
    # and reduces the unsharded gradients once, after the last W: those taken
    # in B are there as W's would be
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (1,))
    mb = TINY.micro_batches
    expected = reference_gradients(TINY)
    plain = lambda f, x: f(x)  # noqa: E731
    # bf16 parameters, gradients summed in fp32: FSDP sums what B took in fp32 sooner than W's
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for wrap, make, policy in ((plain, lambda m: torch.compile(prefire.checkpoint_wrapper(m), fullgraph=True), None),
                               (lambda f, x: prefire.checkpoint(f, x), prefire.compile, None),
                               (lambda f, x: prefire.checkpoint(f, x), prefire.compile, mixed)):
        shard = lambda m: fully_shard(m, mesh=mesh, **({"mp_policy": policy} if policy else {}))  # noqa: E731
        schedule, modules, step, backward_runs = compiled_zbv_one_rank(wrap, make, shard=shard)
        step()
        backward_runs.clear()
        torchs = step()
        assert backward_runs == {0: mb, 1: mb, 2: 2 * mb, 3: 2 * mb}
        sessions = pipelining.enable(schedule)
        for _ in range(2):
            backward_runs.clear()
            grads = step()
            assert backward_runs == {b: mb for b in range(TINY.blocks)}
            if policy is None:
                assert all(torch.equal(grads[n], torchs[n]) for n in torchs)
                assert all(torch.allclose(grads[n], expected[n], rtol=1e-4, atol=1e-6) for n in expected)
            else:  # every micro-batch's gradient there, up to where bf16 rounds (a lost one: ~1/mb off)
                off = max(float((grads[n] - torchs[n]).norm() / torchs[n].norm()) for n in torchs)
                assert off < 0.02, off
        assert sessions.stats().w_groups_taken_in_b == 2 * 2 * mb and sessions.stats().trim_misses == 0
        sessions.disable()


def test_blocks_fsdp2_resharded_after_forward_get_every_weight_gradient_where_torchs_split_loses_them(one_rank):
    # Note [Parameters torch's W gives no gradient]: a block sharded with reshard_after_forward=True has resharded
    # when B begins, and torch's B/W split then gives its parameters no gradient; enable gathers it for B and W
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    expected = reference_gradients(TINY)
    for reshard in (True, False):
        def shard(m):
            for block in m.blocks.values():
                fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
            return fully_shard(m, mesh=mesh, reshard_after_forward=False)

        schedule, modules, step = zbv_one_rank(lambda b, x: prefire.checkpoint(b, x), shard=shard)
        tokens, targets = data(TINY)
        schedule.step(tokens, target=targets)
        lost = [n for n, p in modules[1].named_parameters() if p.grad is None]
        assert bool(lost) == reshard, lost  # torch's own split (torch 2.11 to 2.15)
        sessions = pipelining.enable(schedule)
        _warn_once.warned.discard("params-w-misses")
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for _ in range(2):
                grads = step()
                assert all(torch.allclose(grads[n], expected[n], rtol=1e-4, atol=1e-6) for n in expected), reshard
        assert not [w for w in said if "put in no param group" in str(w.message)]
        assert (sessions.stats().gathered_for_split > 0) == reshard, sessions.stats()
        sessions.disable()


@torch._functorch.config.patch(donated_buffer=False)
def test_torchtitans_stack_of_compiled_fsdp2_blocks_on_zbv_gets_every_gradient_with_one_backward_per_block(one_rank):
    # torchtitan's order: AC (checkpoint_wrapper), then each block compiled in place (fullgraph, inductor), then
    # fully_shard per block; ZBV splits B and W. enable: W takes what each block's compiled backward gave in B, and
    # blocks resharded after forward get their gradients, which torch's own split loses (Note [Parameters torch's
    # W gives no gradient])
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh, mb = init_device_mesh("cpu", (1,)), 4
    torch.manual_seed(0)
    blocks = [Block() for _ in range(4)]
    for block in blocks:
        block.drop.p = 0.0  # compared with unsplit autograd's gradients
    x, target = torch.randn(2 * mb, 16), torch.randn(2 * mb, 16)
    mse = lambda y, t: (y - t).square().mean()  # noqa: E731
    reference = [torch.nn.Sequential(*blocks)]
    sum(mse(y, t) for y, t in zip(reference[0](x).chunk(mb), target.chunk(mb))).backward()
    expected = [p.grad / mb for p in reference[0].parameters()]  # the schedule averages over micro-batches
    for ac, reshard in (("torch", True), ("prefire", False), ("prefire", True)):
        torch._dynamo.reset()
        wrapped = [checkpoint_wrapper(copy.deepcopy(b), checkpoint_fn=prefire.checkpoint) if ac == "prefire"
                   else checkpoint_wrapper(copy.deepcopy(b)) for b in blocks]
        for block in wrapped:
            block.compile(fullgraph=True)
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        modules = [fully_shard(torch.nn.Sequential(*wrapped[2 * i:2 * i + 2]), mesh=mesh, reshard_after_forward=False)
                   for i in range(2)]
        schedule = pp.ScheduleZBVZeroBubble([pp.PipelineStage(m, i, 2, torch.device("cpu"))
                                             for i, m in enumerate(modules)], mb, loss_fn=mse)
        sessions = pipelining.enable(schedule) if ac == "prefire" else None
        for _ in range(2):
            for m in modules:
                m.zero_grad(set_to_none=True)
            schedule.step(x, target=target)
        grads = [None if p.grad is None else p.grad.full_tensor() for m in modules for p in m.parameters()]
        if sessions is None:  # torch's own split: the split stage's resharded blocks get no gradient
            assert sum(g is None for g in grads) == 2 * 6, [g is None for g in grads]  # 2 blocks, 6 each
            continue
        assert all(g is not None and torch.allclose(g, e, rtol=1e-4, atol=1e-6) for g, e in zip(grads, expected))
        # the split stage's two blocks: each compiled backward ran once per micro-batch, in B
        assert sessions.stats().w_groups_taken_in_b == 2 * 2 * mb, sessions.stats()
        assert (sessions.stats().gathered_for_split > 0) == reshard, sessions.stats()
        sessions.disable()


def test_parameters_the_stage_module_does_not_register_are_named_in_a_warning(one_rank):
    # Note [Parameters torch's W gives no gradient]: torch's W computes gradients for stage.submod.parameters()
    scale = torch.nn.Parameter(torch.ones(TINY.dim))
    schedule, modules, step = zbv_one_rank(lambda b, x: prefire.checkpoint(b, x) * scale)
    sessions = pipelining.enable(schedule)
    _warn_once.warned.discard("params-w-misses")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        step()
    said = [str(w.message) for w in said if "put in no param group" in str(w.message)]
    assert len(said) == 1 and "stage 1's backward reaches 1 parameters (shapes [(32,)])" in said[0], said
    sessions.disable()


@torch._functorch.config.patch(donated_buffer=False)
def test_a_memory_plan_over_compiled_blocks_keeps_or_recomputes_them_and_w_takes_from_b(one_rank):
    mb = TINY.micro_batches
    expected = reference_gradients(TINY)
    schedule, modules, step, backward_runs = compiled_zbv_one_rank(lambda f, x: prefire.checkpoint(f, x))
    sessions = pipelining.enable(schedule, memory_budget=1 << 40)
    step()  # measures every block, checkpointed
    kept = sessions.plan.plan.choices
    sessions.set_memory_budget(sessions.least_memory_budget())
    for _ in range(2):
        backward_runs.clear()
        grads = step()
        assert backward_runs == {b: mb for b in range(TINY.blocks)}
        assert all(torch.allclose(grads[n], expected[n], rtol=1e-4, atol=1e-6) for n in expected)
    assert set(kept) == {prefire.Choice.KEEP} and prefire.Choice.CHECKPOINT in set(sessions.plan.plan.choices)
    assert sessions.stats().w_groups_taken_in_b > 0
    sessions.disable()


def test_w_refuses_param_groups_of_another_form_than_it_takes_gradients_from():
    from prefire.pipelining._hook_points import b_param_groups

    class Stage:
        backward_state = {0: (None, [{"params": set(), "intermediates": []}], None, None), 1: (None, None, None, None)}

    with pytest.raises(RuntimeError, match="param group without grads, intermediates, params"):
        b_param_groups(Stage(), 0)
    assert b_param_groups(Stage(), 1) == [] and b_param_groups(Stage(), 2) == []


@torch._functorch.config.patch(donated_buffer=True)  # torch's default off fbcode
def test_a_compiled_backward_that_donates_its_buffers_fails_b_with_the_setting_that_lets_it_run(one_rank):
    schedule, modules, step, _ = compiled_zbv_one_rank(lambda f, x: prefire.checkpoint(f, x))
    sessions = pipelining.enable(schedule)
    with pytest.raises(RuntimeError, match=r"stage 1's B ran a compiled backward that donates its saved buffers.*"
                                           r"torch._functorch.config.donated_buffer = False"):
        step()
    sessions.disable()


def test_a_w_that_reads_what_the_trim_dropped_recomputes_it_exactly_and_says_so(one_rank):
    expected = reference_gradients(TINY)
    schedule, modules, step = zbv_one_rank(lambda b, x: prefire.checkpoint(b, x))
    sessions = pipelining.enable(schedule)
    step()
    stage = sessions._stages[1]
    assert stage.w_reads is not None and any(any(r) for r in stage.w_reads)
    stage.w_reads = [[False] * len(r) for r in stage.w_reads]  # as if the first W had read nothing
    with pytest.warns(UserWarning, match="read [0-9]+ saved tensor.* that an earlier W of the same forward did not"):
        grads = step()
    assert all(torch.equal(grads[n], expected[n]) for n in expected)
    assert sessions.stats().trim_misses > 0
    sessions.reset_stats()
    runs = count_runs(modules)
    grads = step()  # the misses were learnt: kept from then on
    assert all(torch.equal(grads[n], expected[n]) for n in expected)
    assert sessions.stats().trim_misses == 0 and sessions.stats().trimmed_after_b > 0
    assert runs == {b: 2 * TINY.micro_batches for b in range(TINY.blocks)}
    sessions.disable()


def test_enable_errors(one_rank):
    with pytest.raises(TypeError, match="expected a torch.distributed.pipelining schedule"):
        pipelining.enable(object())
    schedule, _, _ = zbv_one_rank(lambda b, x: prefire.checkpoint(b, x))
    with pytest.raises(ValueError, match="non-negative int"):
        pipelining.enable(schedule, budget_bytes=1.5)
    with pytest.raises(ValueError, match="non-negative int"):
        pipelining.enable(schedule, bubble=True, budget_bytes=-1)
    sessions = pipelining.enable(schedule, bubble=True, budget_bytes=1 << 20)
    with pytest.raises(RuntimeError, match="enable was called twice"):
        pipelining.enable(schedule)
    sessions.disable()
    pipelining.enable(schedule).disable()  # allowed again once disabled

    model = GPT(ModelConfig(vocab=64, dim=32, heads=2, blocks=2, seq=16, batch=2, micro_batches=2))
    single = pp.Schedule1F1B(pp.PipelineStage(Stage(model, 0, 1, lambda b, x: b(x)), 0, 1, torch.device("cpu")),
                             2, loss_fn=loss_fn)
    with pytest.raises(ValueError, match="waits on a receive where it posts it"):
        pipelining.enable(single, bubble=True)
    with pytest.raises(ValueError, match="waits on a receive where it posts it"):
        pipelining.on_receive_wait(single, before=lambda *a: None)
    pipelining.enable(single).disable()  # sessions alone work with any schedule


def test_enable_refuses_a_torch_outside_the_tested_range_and_nothing_inside_it(monkeypatch):
    for version in ("2.11.0", "2.12.1", "2.14.1+cu130", "2.15.0", "2.15.3+cpu"):
        pipelining._hook_points._check_torch_version(version)
    for version in ("2.10.2+cpu", "2.16.0", "3.0.0"):
        with pytest.raises(RuntimeError, match=re.escape(
                "prefire.pipelining is tested with torch 2.11 to 2.15 (CI runs 2.11.0, 2.14.1, 2.15.0); "
                f"this is torch {version}. It hooks into")):
            pipelining._hook_points._check_torch_version(version)
    monkeypatch.setenv("PREFIRE_PIPELINING_UNTESTED_TORCH", "1")
    pipelining._hook_points._check_torch_version("2.16.0")


def test_enable_refuses_a_stage_whose_hook_point_moved(one_rank, monkeypatch):
    schedule, _, _ = zbv_one_rank(lambda b, x: prefire.checkpoint(b, x))
    stage_type = type(schedule._stages[0])
    monkeypatch.setattr(stage_type, "backward_one_chunk", lambda self, bwd_chunk_id, full_backward=True, loss=None: None)
    with pytest.raises(RuntimeError, match="reads full_backward as its third argument"):
        pipelining.enable(schedule)
    monkeypatch.undo()
    monkeypatch.setattr(stage_type, "clear_runtime_states", None)
    with pytest.raises(RuntimeError, match="has no method clear_runtime_states"):
        pipelining.enable(schedule)
    assert all("forward_one_chunk" not in vars(s) for s in schedule._stages)  # nothing left wrapped


def test_a_hook_point_that_does_not_fire_is_reported_after_the_first_step(one_rank):
    # torch running a stage's forward past prefire's wrapper
    schedule, modules, step = zbv_one_rank(lambda b, x: prefire.checkpoint(b, x))
    sessions = pipelining.enable(schedule)
    del vars(schedule._stages[1])["forward_one_chunk"]
    step()
    with pytest.raises(RuntimeError, match="without calling forward_one_chunk of stage 1"):
        step()
    vars(schedule._stages[1])["forward_one_chunk"] = sessions._stages[1].wrappers["forward_one_chunk"]
    sessions.disable()

    # torch waiting on a posted receive without popping it from the table
    schedule, modules, step = zbv_one_rank(lambda b, x: prefire.checkpoint(b, x))
    sessions = pipelining.enable(schedule, bubble=True)
    modules[0].register_forward_pre_hook(
        lambda m, args: schedule.fwd_recv_ops.__setitem__(("posted", len(schedule.fwd_recv_ops)), []))
    step()
    with pytest.raises(RuntimeError, match="never popped them from its table"):
        step()
    sessions.disable()


def test_enable_warns_when_the_first_step_makes_no_prefire_checkpoint(one_rank):
    schedule, _, step = zbv_one_rank(lambda b, x: torch_checkpoint.checkpoint(b, x, use_reentrant=False))
    sessions = pipelining.enable(schedule)
    step()
    with pytest.warns(UserWarning, match="made no prefire checkpoint"):
        step()
    sessions.disable()


def test_budgeted_sessions_leave_no_budget_behind(one_rank):
    schedule, _, step = zbv_one_rank(lambda b, x: prefire.checkpoint(b, x))
    sessions = pipelining.enable(schedule, bubble=True, budget_bytes=1 << 20)
    first = next(pipelining._sessions._session_ids)
    step()
    step()
    last = next(pipelining._sessions._session_ids)
    assert sessions.stats().sessions == last - first - 1 > 0
    # a session that kept its budget would stay in the registry for good
    assert all(prefire.session_stats(i).budget_bytes is None for i in range(first, last))
    sessions.disable()


class _ReadsSavedTwice(torch.autograd.Function):
    """exp(x / 4), whose backward unpacks its saved input twice once
    ``twice`` is set (a checkpoint's plain backward refuses that, as torch's
    does: the first step's shape inference runs one)."""

    twice = False

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return (x / 4).exp()

    @staticmethod
    def backward(ctx, g):
        (first,) = ctx.saved_tensors
        if _ReadsSavedTwice.twice:
            (second,) = ctx.saved_tensors
            first = first + 0 * second
        return g * (first / 4).exp() / 4


def test_a_b_that_unpacks_a_tensor_twice_recomputes_it_says_so_and_later_bs_keep_all(one_rank):
    # Note [What a session keeps for W]: W reads no input of exp (only dx needs it), so a B given W's mask lets
    # it go at its first unpack, and the second unpack finds it gone
    _, _, plain = zbv_one_rank(lambda b, x: _ReadsSavedTwice.apply(b(x)))
    plain()
    expected = plain()
    schedule, _, step = zbv_one_rank(lambda b, x: prefire.checkpoint(lambda h: _ReadsSavedTwice.apply(b(h)), x))
    sessions = pipelining.enable(schedule)
    step()  # W's mask learnt
    assert sessions.stats().trim_misses == 0
    try:
        _ReadsSavedTwice.twice = True
        with pytest.warns(UserWarning, match="a B of stage 1 unpacked .* twice") as said:
            for _ in range(2):
                grads = step()
                assert all(torch.equal(grads[n], expected[n]) for n in expected)
        assert len([w for w in said if "unpacked" in str(w.message)]) == 1
        misses = sessions.stats().trim_misses
        assert misses > 0
        step()  # later Bs keep everything until they end: no miss
        assert sessions.stats().trim_misses == misses
    finally:
        _ReadsSavedTwice.twice = False
    sessions.disable()


def test_a_budget_below_one_pass_keeps_nothing_for_w_and_says_so(one_rank):
    expected = reference_gradients(TINY)
    schedule, modules, step = zbv_one_rank(lambda b, x: prefire.checkpoint(b, x))
    sessions = pipelining.enable(schedule)
    step()
    runs = count_runs(modules)
    prefire.reset_runtime_peak()
    step()
    unbudgeted = dict(runs)
    assert set(unbudgeted.values()) == {2 * TINY.micro_batches}  # forward and one recomputation
    one_pass = sessions.floor_bytes
    assert one_pass > 0 and prefire.runtime_stats().peak_held_bytes == one_pass

    sessions.set_budget_bytes(0)
    sessions.reset_stats()
    runs.clear()
    prefire.reset_runtime_peak()
    with pytest.warns(UserWarning, match=f"budget_bytes=0 is below what one backward pass .* \\({one_pass} bytes"):
        grads = step()
    assert all(torch.equal(grads[n], expected[n]) for n in expected)
    # stage 1 (blocks 2, 3) splits B and W: W recomputes what B let go; stage 0's is one full backward
    assert runs == {0: 2 * TINY.micro_batches, 1: 2 * TINY.micro_batches,
                    2: 3 * TINY.micro_batches, 3: 3 * TINY.micro_batches}
    assert sessions.stats().released_after_b == TINY.micro_batches
    assert sessions.stats().sessions == 2 * TINY.micro_batches  # W's sessions are not micro-batches of their own
    assert prefire.runtime_stats().peak_held_bytes <= one_pass

    sessions.set_budget_bytes(None)  # as before
    runs.clear()
    step()
    assert runs == unbudgeted
    sessions.disable()


def test_bubble_warmup_steps_is_an_argument(one_rank):
    schedule, _, _ = zbv_one_rank(lambda b, x: prefire.checkpoint(b, x))
    with pytest.raises(ValueError, match="bubble_warmup_steps must be an int >= 2"):
        pipelining.enable(schedule, bubble=True, bubble_warmup_steps=1)
    sessions = pipelining.enable(schedule, bubble=True, bubble_warmup_steps=5)
    assert sessions.bubbles.warmup_steps == 5
    sessions.disable()


def test_two_ranks_on_gloo_every_mode_same_gradients_as_one_process_and_one_recomputation(no_children_left):
    cfg = RunConfig(model=TINY, schedule="zbv", steps=1, warmup=4, budgets=(1.0,), timeout_s=60)
    summary = run(cfg, world=2)
    assert list(summary["modes"]) == ["none", "torch", "session", "prefire", "budget 100%"]
    assert no_children_left()
    for mode, m in summary["modes"].items():
        assert m["gradients"]["exact"], (mode, m["gradients"])
        assert not m["gradients"]["missing"]
        per_block = {int(b): n for r in m["ranks"] for b, n in r["recomputations_per_block_per_micro_batch"].items()}
        assert sorted(per_block) == list(range(TINY.blocks))
        if mode == "none":
            assert set(per_block.values()) == {0}
        elif mode == "torch":
            # block 0 is stage 0's: one full backward; the others run B and W
            assert per_block[0] == 1
            assert all(per_block[b] >= 2 for b in range(1, TINY.blocks))
        elif mode == "budget 100%":  # the room kept for one pass may send a micro-batch's W to recompute
            assert set(per_block.values()) <= {1, 1.5, 2}, (mode, per_block)
        else:
            assert set(per_block.values()) == {1}, (mode, per_block)
            assert all(r["pipelining"]["sessions"] == 2 * TINY.micro_batches for r in m["ranks"])
        for r in m["ranks"]:  # the program's timeline and the sessions' counts agree
            prefired = r["pipelining"]["bubble_prefires"] if r["pipelining"] else 0
            assert (r["recompute_bubble_s"] > 0) == (prefired > 0), (mode, r)
        for r in m["ranks"]:
            assert r["wait_s"] is not None and r["step_s"] > 0
            assert r["wasted_prefires"] == 0, (mode, r["rank"])  # every prefire used, or let go on purpose
            assert 0 <= r["hideable_s"] <= min(r["wait_s"], r["recompute_s"]) + 1e-9
    assert all(r["budget_bytes"] is not None for r in summary["modes"]["budget 100%"]["ranks"])
    bound = summary["hidden_fraction_bound"]
    assert bound is None or 0 <= bound <= 1
    h = summary["hidden_fraction"]["overall"]
    assert summary["noisy"] == (h is not None and bound is not None and h > bound + 0.01)
    assert set(summary["rounds"]["step_s"]) == set(summary["modes"])
    assert all(v["min"] <= v["max"] and len(v["per_round"]) == 1 for v in summary["rounds"]["step_s"].values())
    from pipeline_bench.report import table

    text = table(summary)
    assert "step ms over 1 round (min-max)" in text
    assert ("NOISY RUN" in text) == summary["noisy"]
    assert set(summary["timelines"]) == set(summary["modes"])
    # memory by the allocator, for every mode, no checkpointing and torch's included
    assert "step peak MiB" in text
    for mode, m in summary["modes"].items():
        for r in m["ranks"]:
            assert r["step_peak_bytes"] > 0, (mode, r["rank"])
            assert r["step_peak_bytes"] >= r["peak_held_bytes"], (mode, r)  # the census is part of what it sees


def test_compiled_blocks_on_two_ranks_run_their_compiled_backward_once_under_enable_on_every_torch(no_children_left):
    # Interleaved zero bubble: a B/W split every release CI tests runs on Gloo (2.11's V-shaped schedules do not,
    # and 2.11's own W fails on a compiled block's node, which W under enable no longer runs).
    cfg = RunConfig(model=TINY, schedule="interleaved-zb", modes=("torch-w-in-b", "session"), compile=True, steps=1,
                    warmup=1, timeout_s=300)
    summary = run(cfg, world=2)
    assert no_children_left()
    for mode, m in summary["modes"].items():
        assert not m["gradients"]["missing"] and m["gradients"]["max_abs_diff"] < 1e-6, (mode, m["gradients"])
        taken = sum(r["pipelining"]["w_groups_taken_in_b"] for r in m["ranks"])
        # one block a stage: every stage's but stage 0's (its B runs nothing; its W is a full backward), each
        # micro-batch of each step
        assert taken > 0 and taken % ((TINY.blocks - 1) * TINY.micro_batches) == 0, (mode, taken)


def test_held_bytes_fall_with_the_budget_down_to_one_pass_on_two_ranks(no_children_left):
    model = ModelConfig(vocab=64, dim=32, heads=2, blocks=8, seq=16, batch=8, micro_batches=4)
    cfg = RunConfig(model=model, schedule="interleaved-zb", modes=("session", "budget"), budgets=(1.0, 0.5, 0.0),
                    steps=2, warmup=4, timeout_s=120)
    summary = run(cfg, world=2)
    assert no_children_left()
    modes = summary["modes"]
    assert list(modes) == ["session", "budget 100%", "budget 50%", "budget 0%"]
    for name, m in modes.items():
        assert m["gradients"]["exact"], (name, m["gradients"])
    fell = False
    for rank in range(2):
        session, full, half, zero = (modes[name]["ranks"][rank] for name in modes)
        floor = zero["floor_bytes"]
        assert 0 < floor and zero["budget_bytes"] == 0
        # a budget of what sessions alone held in the warm-up steps, the first of which kept whole sessions
        # for W (nothing learnt of what W reads yet; Note [What a session keeps for W]): they keep what they
        # kept (bubble prefires fill what is left)
        assert full["budget_bytes"] >= session["peak_held_bytes"]
        assert set(full["recomputations_per_block_per_micro_batch"].values()) == {1}, full
        for r in (full, half, zero):
            assert r["peak_held_bytes"] <= max(r["budget_bytes"], floor), (rank, r["budget_bytes"], floor)
            assert max(r["recomputations_per_block_per_micro_batch"].values()) <= 2
        # nothing fits beside one pass: no bubble prefire, no micro-batch kept from B to W; the floor counts the
        # warm-up's prefired sessions (held whole before B), a lazy B lets go as it goes (Note [What a session
        # keeps for W])
        assert zero["pipelining"]["bubble_prefires"] == 0 and 0 < zero["peak_held_bytes"] <= floor
        fell |= zero["peak_held_bytes"] < session["peak_held_bytes"]
    assert fell  # a rank that held more than one pass with sessions alone
    # rank 1's stages both split B and W: at budget 0 each block is recomputed for B and again for W
    assert set(modes["budget 0%"]["ranks"][1]["recomputations_per_block_per_micro_batch"].values()) == {2}
    from pipeline_bench.report import table

    text = table(summary)
    sweep = text[text.index("budget sweep, per rank"):].splitlines()
    assert [line.split()[0] for line in sweep[1:5]] == ["session", "budget", "budget", "budget"]
    assert sweep[4].startswith("  budget 0%") and sweep[4].count("below floor") == 2


def test_eval_after_training_with_bubbles_recomputes_nothing(no_children_left):
    # schedule.eval() on one rank with local stage pairs fails in torch 2.14
    # itself ("can't steal_bwd_input"), so two ranks, interleaved zero bubble
    cfg = RunConfig(model=TINY, schedule="interleaved-zb", modes=("session", "prefire"), steps=1, warmup=4,
                    eval_steps=2, timeout_s=120)
    summary = run(cfg, world=2)
    for mode, m in summary["modes"].items():
        assert [r["eval_recomputations"] for r in m["ranks"]] == [0, 0], mode
    assert any(r["pipelining"]["bubble_prefires"] > 0 for r in summary["modes"]["prefire"]["ranks"])
    assert no_children_left()


def test_hideable_recomputation_fills_waits_with_forwarded_micro_batches_whose_backward_comes_first():
    from pipeline_bench.report import hideable_s

    # two micro-batches' checkpoints, 1 s of recomputation each
    events = [
        ["wait", 0, 0, 0.0, 1.0],     # nothing forwarded yet
        ["F", 0, 0, 1.0, 2.0],
        ["wait", 1, 0, 2.0, 2.5],     # (0, 0): 0.5
        ["F", 1, 0, 2.5, 3.0],
        ["wait", 1, 0, 3.0, 4.0],     # (1, 0) first, its B is next: 1.0
        ["B", 1, 0, 4.0, 5.0],
        ["wait", 0, 0, 5.0, 5.25],    # what is left of (0, 0): 0.25
        ["BW", 0, 0, 5.25, 6.0],
        ["wait", 0, 1, 6.0, 7.0],     # every backward has begun
        ["W", 1, 0, 7.0, 8.0],
    ]
    assert hideable_s(events, 2.0) == 1.75
    assert hideable_s(events, 0.5) == 0.5      # no more than there is to recompute
    assert hideable_s(events, 0.0) == 0.0
    assert hideable_s([e for e in events if e[0] != "wait"], 2.0) == 0.0


def test_a_rank_past_its_deadline_ends_the_run_and_leaves_no_process(no_children_left):
    cfg = RunConfig(model=TINY, schedule="zbv", modes=("none",), steps=1, warmup=0, timeout_s=0.5)
    with pytest.raises(TimeoutError, match="ran past"):
        run(cfg, world=2)
    assert no_children_left()


def test_an_h_above_its_bound_is_reported_as_a_noisy_run_with_the_spread_across_rounds():
    from pipeline_bench.report import summarize, table

    def ranks(step_s, hideable_s=0.1):
        return [{"rank": r, "stages": [r], "step_s": step_s, "hideable_s": hideable_s, "timeline": {},
                 "recomputations_per_block_per_micro_batch": {"0": 1.0}, "recompute_s": 0.2,
                 "recompute_bubble_s": 0.0, "wait_s": 0.1, "peak_held_bytes": 0, "step_peak_bytes": 0}
                for r in range(2)]

    # session 1.0 s, none 0.6 s, waits hold 0.1 s: H can be at most 0.25
    rounds = {"none": [ranks(0.6), ranks(0.62)], "session": [ranks(1.0), ranks(1.1)],
              "prefire": [ranks(0.7), ranks(0.95)]}
    runs = {mode: ranks(per_round[0][0]["step_s"]) for mode, per_round in rounds.items()}
    grads = {mode: {"exact": True, "max_abs_diff": 0.0} for mode in rounds}
    summary = summarize({}, runs, grads, rounds)
    assert abs(summary["hidden_fraction"]["overall"] - 0.75) < 1e-9
    assert abs(summary["hidden_fraction_bound"] - 0.25) < 1e-9
    assert summary["noisy"]
    assert summary["rounds"]["step_s"]["prefire"] == {"per_round": [0.7, 0.95], "min": 0.7, "max": 0.95}
    text = table(summary)
    assert "NOISY RUN" in text and "step ms over 2 rounds (min-max): none 600.0-620.0" in text
    assert "(rounds 0.31-0.75)" in text

    rounds["prefire"] = [ranks(0.95), ranks(0.96)]  # within the bound: not noisy
    runs = {mode: ranks(per_round[0][0]["step_s"]) for mode, per_round in rounds.items()}
    summary = summarize({}, runs, grads, rounds)
    assert not summary["noisy"]
    assert "H below 0" not in table(summary)

    rounds["prefire"] = [ranks(1.05), ranks(1.02)]  # slower than session: H < 0, and the table says what that means
    runs = {mode: ranks(per_round[0][0]["step_s"]) for mode, per_round in rounds.items()}
    summary = summarize({}, runs, grads, rounds)
    assert summary["hidden_fraction"]["overall"] < 0
    assert "H below 0: prefire mode's step came out slower than session mode's" in table(summary)

    rounds["placed"] = [ranks(0.8), ranks(0.85)]  # a placement's H has the same bound: 0.5 above 0.25 is noise
    runs = {mode: ranks(per_round[0][0]["step_s"]) for mode, per_round in rounds.items()}
    grads["placed"] = grads["prefire"]
    summary = summarize({}, runs, grads, rounds)
    assert abs(summary["hidden_fraction_placed"]["overall"] - 0.5) < 1e-9 and summary["noisy"]
    assert "placed (the simulator's placement, not the rules): H = (session - placed) / (session - none): overall " \
           "0.50 (rounds 0.50-0.52)" in table(summary)


def test_the_program_says_every_flag_with_its_default_and_one_list_of_modes(capsys):
    from pipeline_bench.config import MODES, PLACED_MODE, SWEEP_MODES, TORCH_W_IN_B_MODE
    from pipeline_bench.main import main

    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--blocks", "--dim", "--heads", "--seq", "--vocab", "--batch", "--micro-batches", "--world",
                 "--schedule", "--steps", "--rounds", "--warmup", "--budgets", "--timeout", "--placement", "--compile"):
        option = text[text.rindex(flag + " "):]  # its help line, after the usage line
        assert "(default:" in option[:400], flag  # every flag says its default
    known = MODES + (PLACED_MODE, TORCH_W_IN_B_MODE) + SWEEP_MODES
    # the modes the program accepts, all of them (argparse may wrap the list at a hyphen)
    assert "from:" + ",".join(known) in "".join(text.split())
    with pytest.raises(SystemExit):
        main(["--modes", "lazy"])
    said = " ".join(capsys.readouterr().err.split())
    assert "choose from " + ", ".join(known) in said


def test_the_package_holds_the_library_and_the_programs_stand_beside_it():
    """The pipeline program and its simulator are apps/pipeline_bench and
    apps/pipeline_sim, not modules of the package (the wheel holds the
    library alone: tests/check_wheel.sh), and they reach it by public names."""
    import importlib.util
    import pathlib
    import re

    import pipeline_bench
    import pipeline_sim

    for gone in ("prefire.pipeline_bench", "prefire.pipeline", "prefire.simulate"):
        assert importlib.util.find_spec(gone) is None, gone
    apps = pathlib.Path(pipeline_bench.__file__).parents[1]
    assert pathlib.Path(pipeline_sim.__file__).parents[1] == apps and not (apps / "__init__.py").exists()
    private = re.compile(r"^\s*(from|import)\s+(prefire\._|prefire\.\w+\._|\.\._)|prefire\._C\b", re.M)
    offending = [f"{path.relative_to(apps)}: {m.group(0).strip()}" for path in sorted(apps.rglob("*.py"))
                 for m in private.finditer(path.read_text())]
    assert offending == []


def test_program_rejects_what_it_cannot_run():
    with pytest.raises(ValueError, match="unknown schedule"):
        run(RunConfig(model=TINY, schedule="gpipe"))
    with pytest.raises(ValueError, match="unknown or repeated modes"):
        run(RunConfig(model=TINY, modes=("lazy",)))
    with pytest.raises(ValueError, match="unknown or repeated modes"):
        run(RunConfig(model=TINY, modes=("none", "none")))
    with pytest.raises(ValueError, match="no bubble to prefire in"):
        run(RunConfig(model=TINY, schedule="1f1b", modes=("prefire",)))
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        run(RunConfig(model=TINY), rounds=0)
    placement = {"schedule": "zbv", "world": 2, "micro_batches": TINY.micro_batches, "ranks": [[], []]}
    with pytest.raises(ValueError, match="pass both --modes ...,placed and --placement"):
        run(RunConfig(model=TINY, modes=("placed",)))
    with pytest.raises(ValueError, match="pass both --modes ...,placed and --placement"):
        run(RunConfig(model=TINY, modes=("prefire",), placement=placement))
    with pytest.raises(ValueError, match="the placement was made for .* this run is"):
        run(RunConfig(model=TINY, schedule="dualpipev", modes=("placed",), placement=placement))
    for budgets in ((-0.5,), (), (0.5, 0.501)):
        with pytest.raises(ValueError, match="budgets must be distinct non-negative fractions"):
            run(RunConfig(model=TINY, budgets=budgets))
    with pytest.raises(ValueError, match="warmup must be at least 1"):
        run(RunConfig(model=TINY, modes=("budget",), warmup=0))
    with pytest.raises(ValueError, match="do not split evenly"):
        run(RunConfig(model=ModelConfig(blocks=3)))
    with pytest.raises(ValueError, match="compiled blocks run in modes none, torch, torch-w-in-b, session, prefire"):
        run(RunConfig(model=TINY, modes=("budget",), compile=True))
    with pytest.raises(ValueError, match="torch-w-in-b mode runs torch's compiled checkpoint: pass compile"):
        run(RunConfig(model=TINY, modes=("torch-w-in-b",)))


class FakeWork:
    def __init__(self, completed=False):
        self.completed = completed

    def is_completed(self):
        return self.completed


#: one rank's order: F of (stage 1, mb 0), B of (1, 0), then of (1, 1)
ORDER = [("F", 1, 0), ("B", 1, 0), ("B", 1, 1)]


def test_bubble_filler_prefires_the_next_backward_at_its_receive_and_others_within_measured_slack():
    from prefire.pipelining._bubbles import BubbleFiller
    from prefire.pipelining import PipelineStats
    from prefire.pipelining._sessions import _MicroBatch

    clock = [0.0]
    prefired = []

    def prefire_fn(handle, session):  # each recomputation takes 10 ms of the fake clock
        clock[0] += 0.010
        prefired.append((session, handle))
        return (prefire.PrefireStatus.REFUSED_OVER_BUDGET if handle == "refuse"
                else prefire.PrefireStatus.RECOMPUTED)

    mbs = {(1, 0): _MicroBatch(10, ["a0", "b0", "c0"]), (1, 1): _MicroBatch(11, ["refuse", "b1"])}
    stats = PipelineStats()
    filler = BubbleFiller(ORDER, lambda s, m: mbs.get((s, m)), stats, prefire_fn, lambda: clock[0])

    def wait(kind, stage, mb, waited, works=()):
        filler.before_wait(kind, stage, mb, list(works))
        begin = clock[0]
        clock[0] += waited
        filler.after_wait(kind, stage, mb, begin, clock[0])

    for waited in (0.001, 0.030, 0.025):  # a warm-up step, two that measure; nothing is prefired
        filler.new_step()
        wait("forward", 1, 0, waited)
        wait("backward", 1, 0, waited)
    assert prefired == [] and abs(filler.slack[("forward", 1, 0)] - 0.025) < 1e-9

    # rule 2 (the slack) at a forward receive: 25 ms hold two of mb 0's checkpoints, last first
    filler.new_step()
    wait("forward", 1, 0, 0.0)
    assert prefired == [(10, "c0"), (10, "b0")]
    assert stats.bubble_prefires == 2 and mbs[(1, 0)].prefired == 2
    # the wait ended at once after prefires: its slack shrinks by one checkpoint
    assert abs(filler.slack[("forward", 1, 0)] - 0.015) < 1e-9

    # rule 1 at mb 0's backward receive: the rest of mb 0 whatever the slack;
    # rule 2 then prefires nothing past a zero slack
    filler.slack[("backward", 1, 0)] = 0.0
    wait("backward", 1, 0, 0.0)
    assert prefired[2:] == [(10, "a0")] and mbs[(1, 0)].prefired == 3
    assert filler.slack[("backward", 1, 0)] == 0.0  # rule 1 alone never shrinks a slack

    # a B that started is skipped; a refused prefire leaves its micro-batch to B
    filler.backward_started(1, 0)
    filler.slack[("forward", 1, 1)] = 1.0
    wait("forward", 1, 1, 0.001)
    assert prefired[3:] == [(11, "b1"), (11, "refuse")] and stats.bubble_refused == 1
    assert mbs[(1, 1)].prefired == 2

    # a receive that reports completion stops the prefires of both rules
    filler.new_step()
    mbs[(1, 0)].prefired = 0
    wait("backward", 1, 0, 0.0, works=[FakeWork(completed=True)])
    assert len(prefired) == 5


def test_bubble_filler_passes_over_a_micro_batch_whose_prefire_would_issue_a_collective():
    """An FSDP2 stage with a resharded module (ready() False): neither rule
    prefires it, the receive's own nor a timed one; once ready, both do."""
    from prefire.pipelining._bubbles import BubbleFiller
    from prefire.pipelining import PipelineStats
    from prefire.pipelining._sessions import _MicroBatch

    clock = [0.0]
    prefired = []
    gathered = [False]

    def prefire_fn(handle, session):
        clock[0] += 0.010
        prefired.append((session, handle))
        return prefire.PrefireStatus.RECOMPUTED

    mbs = {(1, 0): _MicroBatch(10, ["a0", "b0"], ready=lambda: gathered[0]),
           (1, 1): _MicroBatch(11, ["a1", "b1"], ready=lambda: gathered[0])}
    filler = BubbleFiller(ORDER, lambda s, m: mbs.get((s, m)), PipelineStats(), prefire_fn,
                          lambda: clock[0])
    for _ in range(4):
        filler.new_step()
    filler.slack[("forward", 1, 0)] = 1.0   # room for everything
    filler.slack[("backward", 1, 0)] = 1.0
    filler.before_wait("forward", 1, 0, [])
    filler.before_wait("backward", 1, 0, [])
    assert prefired == []
    gathered[0] = True
    filler.before_wait("backward", 1, 0, [])
    assert prefired == [(10, "b0"), (10, "a0"), (11, "b1"), (11, "a1")]


def test_a_b_keeps_its_recomputation_for_w_whatever_the_bubble_prefires_hold():
    """Note [A rank's byte budget]: the keep decision after a B is the one
    without bubble prefires; the prefires it needs room from are let go,
    the micro-batch whose B comes last first. Stage 0's need is 10 bytes."""
    from prefire.pipelining._budget import RankBudget
    from prefire.pipelining._sessions import _MicroBatch

    actions = [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("F", 0, 2), ("B", 0, 1), ("W", 0, 0),
               ("B", 0, 2), ("W", 0, 1), ("W", 0, 2)]
    pending = {(0, m): _MicroBatch(m, ["h"]) for m in range(3)}
    held = {}

    def budget(n):
        b = RankBudget(n, lambda: pending, lambda: actions, holds=lambda mb: held.get((0, mb.session), 0))
        b.closed(0, 10)
        return b

    # after B of mb 0 (10 held): mb 1's B comes next and needs 10 less what is prefired of it
    held.update({(0, 0): 10, (0, 1): 5, (0, 2): 10})
    assert budget(25).after_b((0, 0)) == (True, [(0, 2)])      # 25 + 5 > 25; without mb 2's 10: 20
    assert budget(20).after_b((0, 0)) == (True, [(0, 2)])      # mb 1's own prefire is part of its B's need
    assert budget(19).after_b((0, 0)) == (False, [])            # 10 kept + 10 for mb 1's B: nothing let go
    assert budget(40).after_b((0, 0)) == (True, [])
    for n in range(10, 41):  # the same decision as with nothing prefired (10: the floor)
        prefires = {(0, 1): 5, (0, 2): 10}
        held.update(prefires)
        with_prefires = budget(n).after_b((0, 0))[0]
        held.update({k: 0 for k in prefires})
        assert with_prefires == budget(n).after_b((0, 0))[0], n
    # a session kept for W is not a prefire: it is never let go
    held.update({(0, 0): 0, (0, 1): 10, (0, 2): 10})
    pending[(0, 0)].kept_for_w = True
    held[(0, 0)] = 10
    assert budget(30).after_b((0, 1)) == (True, [])         # 30 held now; W of mb 0 ends before B of mb 2
    assert budget(29).after_b((0, 1)) == (True, [(0, 2)])   # 20 without mb 2's prefire
    assert budget(19).after_b((0, 1)) == (False, [])
    # a bubble prefire fills its session up to what the actions until its B leave (each B before keeping for W)
    pending[(0, 0)].kept_for_w = False
    held.clear()
    b = budget(20)
    for action in actions[:2]:  # F of mb 0 and 1 ran; the rank waits before B of mb 0
        b.ran(action)
    assert b.room_for_prefires((0, 2)) == 10  # place unknown (no step began): room for one pass
    b.step_begins()
    for action in actions[:2]:
        b.ran(action)
    assert b.room_for_prefires((0, 0)) == 20
    assert b.room_for_prefires((0, 1)) == 10  # B of mb 0 keeps 10 until W of mb 0
    assert b.room_for_prefires((0, 2)) == 0   # B of mb 1 comes before it with 10 kept already
    b.ran(("W", 0, 0))  # not the schedule's order: back to keeping room for one pass
    assert b.room_for_prefires((0, 2)) == 10


def test_under_a_memory_plan_the_sessions_hold_what_the_blocks_leave_at_each_action():
    """Note [A rank's byte budget], under a memory plan: the sessions hold
    at most the budget less what the plan's blocks hold at each action
    (``blocks_at``), and a B keeps its recomputation for W only if every
    action up to that W leaves room for it, the other micro-batches at their
    floor (their B lets go, their W recomputes). Stage 0's need is 10."""
    from prefire.pipelining._budget import RankBudget
    from prefire.pipelining._sessions import _MicroBatch

    def budget(actions, n, blocks_at, held):
        pending = {(0, m): _MicroBatch(m, ["h"]) for m in range(3)}
        b = RankBudget(None, lambda: pending, lambda: actions, holds=lambda mb: held.get((0, mb.session), 0))
        b.closed(0, 10)
        # the planner's room beside blocks that hold blocks_at after each action (one kept block, a byte a moment)
        room = None if blocks_at is None else list(prefire.describe_plan(
            [prefire.BlockCost(saved_bytes=1, input_bytes=0, recompute_seconds=0.0, in_flight=max(blocks_at),
                               alive=blocks_at)], [prefire.Choice.KEEP], n).room_bytes)
        b.set(n, room=room)
        return b

    # the blocks hold the most after F1, between B0 and W0: what B0 keeps must fit there too
    actions = [("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("W", 0, 0), ("B", 0, 1), ("W", 0, 1)]
    blocks_at = [50, 50, 100, 50, 50, 0]
    assert budget(actions, 110, blocks_at, {(0, 0): 10}).after_b((0, 0)) == (True, [])
    assert budget(actions, 109, blocks_at, {(0, 0): 10}).after_b((0, 0)) == (False, [])
    # without blocks_at, the budget is the sessions' own at every action
    assert budget(actions, 10, None, {(0, 0): 10}).after_b((0, 0)) == (True, [])
    assert budget(actions, 9, None, {(0, 0): 10}).after_b((0, 0)) == (False, [])
    # ... up to its W, past the next B: F2 brings the blocks' most after B1
    actions = [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("B", 0, 1), ("F", 0, 2), ("W", 0, 0), ("W", 0, 1),
               ("B", 0, 2), ("W", 0, 2)]
    blocks_at = [50, 100, 100, 100, 150, 100, 50, 50, 0]
    assert budget(actions, 160, blocks_at, {(0, 0): 10}).after_b((0, 0)) == (True, [])
    assert budget(actions, 159, blocks_at, {(0, 0): 10}).after_b((0, 0)) == (False, [])
    # a later B and its W at their floor: B1 recomputes beside what B0 keeps, lets go, and W1 recomputes
    actions = [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("B", 0, 1), ("W", 0, 1), ("W", 0, 0)]
    blocks_at = [60, 120, 120, 120, 60, 0]
    assert budget(actions, 140, blocks_at, {(0, 0): 10}).after_b((0, 0)) == (True, [])
    assert budget(actions, 139, blocks_at, {(0, 0): 10}).after_b((0, 0)) == (False, [])
    # a bubble prefire before B1 fills what the actions until then leave (B0 keeping its 10)
    b = budget(actions, 150, blocks_at, {})
    b.step_begins()
    for action in actions[:2]:
        b.ran(action)
    assert b.room_for_prefires((0, 1)) == 150 - 120 - 10
    assert b.room_for_prefires((0, 0)) == 150 - 120
    b.ran(("W", 0, 0))  # not the schedule's order: room beside the blocks' most and one pass
    assert b.room_for_prefires((0, 1)) == 150 - 120 - 10
