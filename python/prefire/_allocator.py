"""What a device's allocator holds: every tensor storage, whoever made it
(autograd, gradients, an op's working memory, a communication library,
prefire), for comparing the memory of any two ways to train, prefire's or
not. prefire's own census (:func:`prefire.runtime_stats`,
:class:`prefire.SavedTensorMeter`) sees only what prefire handles. Note
[Counting the CPU allocator] in src/memory/allocator_meter.cpp says how the
CPU side counts."""

from __future__ import annotations

from typing import Union

import torch

from . import _C

AllocatorBytes = _C.AllocatorBytes
Device = Union[str, int, torch.device]


def count_cpu_allocations() -> None:
    """Counts ATen's CPU allocator from now on, for the life of the process
    (it forwards to the allocator in use). Storages allocated before are not
    counted: call it before the model is built. Idempotent."""
    _C.count_cpu_allocations()


def allocator_bytes(device: Device = "cpu") -> AllocatorBytes:
    """Live bytes of ``device``'s allocator, now and at the peak: CPU, what
    was allocated since :func:`count_cpu_allocations` (which must come
    first); CUDA, the caching allocator's allocated bytes (as
    ``torch.cuda.memory_allocated`` / ``max_memory_allocated``)."""
    return _C.allocator_bytes(torch.device(device))


def reset_allocator_peak(device: Device = "cpu") -> None:
    """Starts a new peak window on ``device`` at its current bytes (CUDA:
    ``torch.cuda.reset_peak_memory_stats``)."""
    _C.reset_allocator_peak(torch.device(device))


class AllocatorPeak:
    """``with AllocatorPeak(device) as peak:`` measures the most the
    allocator held inside the block above what it held when the block began:
    ``peak.bytes`` after the block (``peak.start_bytes``: what it held when
    the block began). On CUDA, synchronizes at both ends. On CPU, call
    :func:`count_cpu_allocations` before the model is built (this does it,
    too late to see storages made before)."""

    def __init__(self, device: Device = "cpu") -> None:
        self.device = torch.device(device)
        self.bytes = 0
        self.start_bytes = 0

    def __enter__(self) -> "AllocatorPeak":
        if self.device.type == "cpu":
            count_cpu_allocations()
        elif self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        reset_allocator_peak(self.device)
        self.start_bytes = allocator_bytes(self.device).current
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.bytes = allocator_bytes(self.device).peak - self.start_bytes
