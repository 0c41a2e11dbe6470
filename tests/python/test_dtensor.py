"""DTensor through prefire's checkpoint: a tensor-parallel MLP (torch's
ColwiseParallel / RowwiseParallel, parameters sharded as DTensors) on a
2-rank Gloo mesh, checkpointed whole and with a DTensor as the checkpoint's
input, with and without a session; every gradient bit-equal to the unchecked
run and to torch's checkpoint. CPU, one intra-op thread per rank."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline_bench.process_exit import exit_process

WORLD = 2


class MLP(torch.nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.down = torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def worker(rank, store_path):
    import torch.utils.checkpoint as torch_checkpoint
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import prefire

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    try:
        mesh = dist.device_mesh.init_device_mesh("cpu", (WORLD,))

        def build():
            torch.manual_seed(0)
            return parallelize_module(MLP(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})

        def grads(wrap, dtensor_input, session=False):
            mlp = build()
            assert isinstance(mlp.up.weight, DTensor)
            torch.manual_seed(1)
            x = torch.randn(6, 16)
            if dtensor_input:  # the checkpoint's input is itself a DTensor
                x = distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
                fn = lambda a: mlp(a.redistribute(mesh, [Replicate()]).to_local()).sum() * a.to_local().sum()
            else:
                x.requires_grad_()
                fn = lambda a: mlp(a).square().sum()
            if session:
                with prefire.collect() as handles:
                    loss = wrap(fn, x)
                for h in handles:
                    assert prefire.prefire(h, 5) == prefire.PrefireStatus.RECOMPUTED
                with prefire.session(5):
                    loss.backward()
                prefire.clear_session(5)
            else:
                wrap(fn, x).backward()
            out = [x.grad] + [p.grad for p in mlp.parameters()]
            return [g.full_tensor() if isinstance(g, DTensor) else g for g in out]

        for dtensor_input in (False, True):
            expected = grads(lambda f, a: f(a), dtensor_input)
            with_torch = grads(lambda f, a: torch_checkpoint.checkpoint(f, a, use_reentrant=False), dtensor_input)
            for got in (with_torch, grads(prefire.checkpoint, dtensor_input),
                        grads(prefire.checkpoint, dtensor_input, session=True)):
                assert len(got) == len(expected)
                for g, e in zip(got, expected):
                    assert torch.equal(g, e), (rank, dtensor_input)
    finally:
        dist.destroy_process_group()
    exit_process()  # Note [Leaving a process that ran Gloo collectives]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_tensor_parallel_dtensor_gradients_match_unchecked(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(worker, args=(str(tmp_path / "store"),), nprocs=WORLD, join=True, start_method="spawn")
