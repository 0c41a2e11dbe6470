"""prefire.allocator_bytes / AllocatorPeak: what the CPU allocator holds,
every storage whoever made it, so that memory is compared across ways to
train that prefire's census cannot see (no checkpointing, torch's
checkpoint). CPU, one intra-op thread (conftest.py).

Not covered here: CUDA (tests/cuda_test.cpp), the allocator itself
(tests/allocator_meter_test.cpp)."""

import torch
import torch.utils.checkpoint as torch_checkpoint

import prefire

prefire.count_cpu_allocations()  # before any model of this file is built


def layers():
    torch.manual_seed(0)
    return torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
                               for _ in range(4))


def forward_peak(run):
    """The most a forward and backward held above what was there before, and
    the bytes live after forward."""
    blocks = layers()
    x = torch.randn(32, 64, requires_grad=True)
    with prefire.AllocatorPeak() as peak:
        h = x
        for b in blocks:
            h = run(b, h)
        after_forward = prefire.allocator_bytes().current - peak.start_bytes
        h.sum().backward()
    return peak.bytes, after_forward


def test_the_allocator_sees_what_every_mode_keeps_and_the_census_does_not():
    held = prefire.runtime_stats().held_bytes
    none_peak, none_kept = forward_peak(lambda b, h: b(h))
    torch_peak, torch_kept = forward_peak(lambda b, h: torch_checkpoint.checkpoint(b, h, use_reentrant=False))
    prefire_peak, prefire_kept = forward_peak(prefire.checkpoint)
    assert prefire.runtime_stats().held_bytes == held  # prefire's census saw none of the first two
    # four blocks of GELU(32 x 256) inputs and outputs kept unchecked; checkpoints keep each block's input
    assert none_kept > 4 * 32 * 256 * 4 * 2
    assert torch_kept < none_kept / 4 and prefire_kept < none_kept / 4
    # the same inputs kept by either checkpoint; torch's also keeps the CPU generator's state as a tensor
    assert prefire_kept <= torch_kept
    assert none_peak >= none_kept and torch_peak > torch_kept and prefire_peak > prefire_kept


def test_peak_windows_and_repr():
    prefire.reset_allocator_peak()
    before = prefire.allocator_bytes()
    assert before.peak == before.current
    t = torch.empty(1000, dtype=torch.float32)
    assert prefire.allocator_bytes().current - before.current == 4000
    del t
    after = prefire.allocator_bytes("cpu")
    assert after.current == before.current and after.peak - before.current == 4000
    assert repr(after).startswith("AllocatorBytes(current=")
