"""prefire with FSDP2 (fully_shard) on Gloo, in both orders of stacking:
checkpoint inside fully_shard (torchtitan's: fully_shard(checkpoint_wrapper(block)))
and fully_shard inside the checkpoint (checkpoint(fsdp_block, x)), with and
without mixed precision. Lazy recomputation, sessions, and prefire ahead of
backward (Note [Prefire of FSDP2-sharded blocks]): gradients bit-equal to no
checkpointing, each block run twice, blocks resharded after a prefire as FSDP
had them, FSDP's forward order untouched, all-gathers counted. Then the
torchtitan stack on 4 ranks: PP=2 x FSDP=2, AC through torch's
checkpoint_wrapper with checkpoint_fn=prefire.checkpoint, fully_shard per
block without reshard_after_forward (torchtitan's default under pipelining)
and with it, interleaved zero bubble, prefire.pipelining with bubble=True.
CPU, one intra-op thread per rank."""

import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline_bench.process_exit import exit_process

DIM = 16
BLOCKS = 3


class Block(torch.nn.Module):
    def __init__(self, dim=DIM):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.down = torch.nn.Linear(4 * dim, dim)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


class CheckpointedInside(torch.nn.Module):
    """fully_shard inside the checkpoint: the model checkpoints its (sharded) blocks."""

    def __init__(self, blocks, checkpoint):
        super().__init__()
        self.blocks = blocks
        self.checkpoint = checkpoint

    def forward(self, x):
        for block in self.blocks:
            x = self.checkpoint(block, x)
        return x


def count_all_gathers():
    """Counts FSDP2's all-gathers in this process (its one call per parameter group)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    count = [0]
    original = _fsdp_param_group.foreach_all_gather

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    _fsdp_param_group.foreach_all_gather = counted
    return count


def count_runs(modules):
    runs = [0]
    for m in modules:
        m.register_forward_pre_hook(lambda *_: runs.__setitem__(0, runs[0] + 1))
    return runs


def two_rank_worker(rank, store_path):
    import torch.utils.checkpoint as torch_checkpoint
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    import prefire
    import prefire.pipelining
    from prefire import _fsdp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    gathers = count_all_gathers()
    try:
        def run(order, mixed, mode, early_stop=True):
            """One forward and backward; returns (gradients, all-gathers, block runs)."""
            torch.manual_seed(0)
            blocks = [Block() for _ in range(BLOCKS)]
            runs = count_runs(blocks)
            mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed \
                else MixedPrecisionPolicy()
            if mode == "none":
                ckpt = lambda f, x: f(x)
            elif mode == "torch":
                ckpt = lambda f, x: torch_checkpoint.checkpoint(f, x, use_reentrant=False)
            else:
                ckpt = lambda f, x: prefire.checkpoint(f, x, early_stop=early_stop)
            if order == "inside":  # fully_shard(checkpoint_wrapper(block)), torchtitan's order
                from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

                if mode == "none":
                    wrapped = blocks
                else:
                    wrapped = [checkpoint_wrapper(b, checkpoint_fn=lambda f, *a, **k: ckpt(f, *a)) for b in blocks]
                for b in wrapped:
                    fully_shard(b, mp_policy=mp_policy)
                model = fully_shard(torch.nn.Sequential(*wrapped), mp_policy=mp_policy)
                fsdp_blocks = wrapped
            else:  # checkpoint(fsdp_block, x)
                for b in blocks:
                    fully_shard(b, mp_policy=mp_policy)
                model = fully_shard(CheckpointedInside(torch.nn.ModuleList(blocks), ckpt), mp_policy=mp_policy)
                fsdp_blocks = blocks
            torch.manual_seed(1 + rank)
            x = torch.randn(4, DIM, requires_grad=True)
            gathers[0] = 0
            with prefire.collect() as handles:
                loss = model(x).float().square().sum()
            groups = [_fsdp._groups(b._get_fsdp_state())[0] for b in fsdp_blocks]  # torch 2.11: _fsdp_param_group
            order_length = len(groups[0].comm_ctx.post_forward_order)
            sharded_after_forward = [g.is_sharded for g in groups]
            if mode == "ahead":
                assert len(handles) == BLOCKS
                for h in reversed(handles):
                    assert prefire.prefire(h, 3) == prefire.PrefireStatus.RECOMPUTED
                # as FSDP had them; its forward order untouched
                assert [g.is_sharded for g in groups] == sharded_after_forward
                assert len(groups[0].comm_ctx.post_forward_order) == order_length
                assert _fsdp.all_gathered(model) == (not any(sharded_after_forward))
            if mode in ("lazy", "ahead"):
                with prefire.session(3):
                    loss.backward()
                prefire.clear_session(3)
            else:
                loss.backward()
            grads = [x.grad] + [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                                for p in model.parameters()]
            return grads, gathers[0], runs[0], sum(sharded_after_forward)

        for order in ("inside", "outside"):
            for mixed in (False, True):
                expected, base_gathers, base_runs, sharded = run(order, mixed, "none")
                assert base_runs == BLOCKS and sharded > 0
                cases = [("torch", True), ("lazy", True), ("ahead", True), ("ahead", False)]
                for mode, early_stop in cases:
                    got, all_gathers, runs, _ = run(order, mixed, mode, early_stop)
                    where = (rank, order, mixed, mode, early_stop)
                    assert len(got) == len(expected), where
                    for g, e in zip(got, expected):
                        assert torch.equal(g, e), where
                    assert runs == 2 * BLOCKS, (where, runs)
                    # a prefire gathers a block FSDP had resharded: the one
                    # all-gather its recomputation needs
                    extra = sharded if mode == "ahead" else 0
                    assert all_gathers == base_gathers + extra, (where, all_gathers, base_gathers)
    finally:
        dist.destroy_process_group()
    exit_process()  # Note [Leaving a process that ran Gloo collectives]


def spawn(worker, world, tmp_path, *args):
    mp.start_processes(worker, args=(str(tmp_path / "store"),) + args, nprocs=world, start_method="spawn")


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_fsdp2_both_orders_prefire_ahead_gathers_once_reshards_and_matches_no_checkpointing(tmp_path):
    spawn(two_rank_worker, 2, tmp_path)


STAGES = 4          # two per pipeline rank (interleaved)
MICRO_BATCHES = 4
STEPS = 4


def titan_worker(rank, store_path, results_dir):
    """torchtitan's stack on PP=2 x FSDP=2: AC per block through torch's
    checkpoint_wrapper (checkpoint_fn swapped), fully_shard per block and
    per stage without reshard_after_forward (torchtitan's default under
    pipelining; "prefire-resharded": the blocks with it), interleaved zero
    bubble. Writes this rank's losses, parameters and counts per
    configuration."""
    import torch.distributed.pipelining as pp
    import torch.utils.checkpoint as torch_checkpoint
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import prefire
    import prefire.pipelining

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 4), rank=rank, world_size=4)
    gathers = count_all_gathers()
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        out = {}
        for ac in ("none", "torch", "prefire", "prefire-budget", "prefire-resharded"):
            torch.manual_seed(0)
            all_blocks = [Block() for _ in range(2 * STAGES)]
            mine = [s for s in range(STAGES) if s % 2 == pp_rank]
            runs = count_runs([b for s in mine for b in all_blocks[2 * s:2 * s + 2]])
            stages, params = [], []
            for s in mine:
                blocks = all_blocks[2 * s:2 * s + 2]
                if ac != "none":
                    fn = torch_checkpoint.checkpoint if ac == "torch" else prefire.checkpoint
                    blocks = [checkpoint_wrapper(b, checkpoint_fn=fn, use_reentrant=False) if ac == "torch"
                              else checkpoint_wrapper(b, checkpoint_fn=fn) for b in blocks]
                for b in blocks:
                    fully_shard(b, mesh=mesh["dp"], reshard_after_forward=ac == "prefire-resharded",
                                mp_policy=mp_policy)
                module = fully_shard(torch.nn.Sequential(*blocks), mesh=mesh["dp"], reshard_after_forward=False,
                                     mp_policy=mp_policy)
                params += list(module.parameters())
                stages.append(pp.PipelineStage(module, s, STAGES, torch.device("cpu"), group=mesh["pp"].get_group()))
            schedule = pp.ScheduleInterleavedZeroBubble(
                stages, MICRO_BATCHES, loss_fn=lambda y, t: (y.float() - t).square().mean())
            # prefire-budget: a budget of 0 keeps nothing from B to W (W recomputes) and prefires nothing
            pipelining = prefire.pipelining.enable(schedule, bubble=True, bubble_warmup_steps=2,
                                                   budget_bytes=0 if ac == "prefire-budget" else None) \
                if ac.startswith("prefire") else None
            optimizer = torch.optim.SGD(params, lr=0.1)
            torch.manual_seed(10 + dp_rank)
            data = [(torch.randn(2 * MICRO_BATCHES, DIM), torch.randn(2 * MICRO_BATCHES, DIM))
                    for _ in range(STEPS)]
            losses, step_runs, step_gathers, step_s, gradless = [], [], [], [], []
            warnings.filterwarnings("ignore", message=".*budget_bytes=0 is below")
            prefire._warn_once.warned.discard("params-w-misses")
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                for x, target in data:
                    began = time.perf_counter()
                    optimizer.zero_grad()
                    runs[0] = gathers[0] = 0
                    step_losses = []
                    if pp_rank == 0:
                        schedule.step(x)
                    else:
                        schedule.step(target=target, losses=step_losses)
                    gradless.append(sum(p.grad is None for p in params))
                    optimizer.step()
                    losses.append([float(l) for l in step_losses])
                    step_runs.append(runs[0])
                    step_gathers.append(gathers[0])
                    step_s.append(time.perf_counter() - began)
            out[ac] = {"losses": losses, "params": [p.full_tensor() for p in params], "runs": step_runs,
                       "gathers": step_gathers, "seconds": step_s, "gradless": gradless,
                       "warned_gradless": any("put in no param group" in str(w.message) for w in said),
                       "bubble_prefires": pipelining.stats().bubble_prefires if pipelining else 0,
                       "released_after_b": pipelining.stats().released_after_b if pipelining else 0,
                       "gathered_for_split": pipelining.stats().gathered_for_split if pipelining else 0}
            if pipelining is not None:
                pipelining.disable()
        torch.save(out, os.path.join(results_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    exit_process()  # Note [Leaving a process that ran Gloo collectives]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_torchtitan_stack_pp2_fsdp2_bubble_prefire_equals_no_checkpointing_with_one_recomputation(tmp_path):
    spawn(titan_worker, 4, tmp_path, str(tmp_path))
    blocks_per_rank = 2 * STAGES // 2
    for rank in range(4):
        out = torch.load(tmp_path / f"rank{rank}.pt")
        none, with_torch, with_prefire, budgeted = out["none"], out["torch"], out["prefire"], out["prefire-budget"]
        resharded = out["prefire-resharded"]
        for ac in (with_torch, with_prefire, budgeted, resharded):
            assert ac["losses"] == none["losses"], rank
            for p, e in zip(ac["params"], none["params"]):
                assert torch.equal(p, e), rank
        # every parameter has its gradient; with the blocks resharded after forward, torch's own B/W split
        # gives the resharded blocks' parameters none (Note [Parameters torch's W gives no gradient]), and
        # prefire gathers them for B and W (the equalities above: no gradient lost)
        for ac in (none, with_torch, with_prefire, budgeted, resharded):
            assert not any(ac["gradless"]) and not ac["warned_gradless"], (rank, ac["gradless"])
        assert resharded["gathered_for_split"] > 0 and with_prefire["gathered_for_split"] == 0, rank
        # (the first step also runs the stages' shape inference)
        assert none["runs"][1:] == [blocks_per_rank * MICRO_BATCHES] * (STEPS - 1)
        # prefire: forward plus one recomputation per block and micro-batch
        assert with_prefire["runs"][1:] == [2 * blocks_per_rank * MICRO_BATCHES] * (STEPS - 1), \
            (rank, with_prefire["runs"])
        assert resharded["runs"][1:] == with_prefire["runs"][1:], (rank, resharded["runs"])
        assert all(t > p for t, p in zip(with_torch["runs"], with_prefire["runs"])), (rank, with_torch["runs"])
        # bubble prefires ran (after the two warm-up steps; only where the
        # stage was all gathered) and added no all-gather
        assert with_prefire["bubble_prefires"] > 0, rank
        assert all(p <= t for t, p in zip(with_torch["gathers"], with_prefire["gathers"])), \
            (rank, with_torch["gathers"], with_prefire["gathers"])
        # budget 0: W recomputes what B let go (the stage is unsharded for W: no all-gather added)
        assert budgeted["released_after_b"] > 0 and budgeted["bubble_prefires"] == 0, rank
        assert all(p < b <= t for t, p, b in zip(with_torch["runs"], with_prefire["runs"], budgeted["runs"])), \
            (rank, with_torch["runs"], budgeted["runs"])
        assert all(b <= t for t, b in zip(with_torch["gathers"], budgeted["gathers"])), \
            (rank, with_torch["gathers"], budgeted["gathers"])
        print(f"rank {rank}: block runs per step none {none['runs'][-1]}, torch AC {with_torch['runs'][-1]}, "
              f"prefire {with_prefire['runs'][-1]}, prefire budget 0 {budgeted['runs'][-1]}; all-gathers per step "
              f"none {none['gathers'][-1]}, torch AC {with_torch['gathers'][-1]}, prefire {with_prefire['gathers'][-1]}, "
              f"prefire budget 0 {budgeted['gathers'][-1]}, prefire resharded {resharded['gathers'][-1]}; "
              f"bubble prefires {with_prefire['bubble_prefires']}; last step's time against no checkpointing "
              f"(not asserted): torch AC {with_torch['seconds'][-1] / none['seconds'][-1]:.2f}, "
              f"prefire {with_prefire['seconds'][-1] / none['seconds'][-1]:.2f}, "
              f"prefire resharded {resharded['seconds'][-1] / none['seconds'][-1]:.2f} "
              f"({resharded['bubble_prefires']} bubble prefires)")
