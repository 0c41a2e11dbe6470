import os

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    """Bit-equality depends on the intra-op thread count (CPU reductions split
    by it): pin it for every test, whatever this machine's default is."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def no_children_left():
    """A check that this process has no child process left (the pipeline
    tests: no rank outlives its launcher), but multiprocessing's resource
    tracker, which a spawn-started test earlier in the same session leaves
    running by design."""
    def check() -> bool:
        from multiprocessing import resource_tracker

        children = set()
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as f:
                children.update(int(pid) for pid in f.read().split())
        return not children - {resource_tracker._resource_tracker._pid}

    return check


@pytest.fixture(scope="module")
def one_rank():
    """A process group of one rank (Gloo), for schedules whose stages all
    live in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
