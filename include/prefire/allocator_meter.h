#pragma once

// What a device's allocator holds: the live bytes of every tensor storage,
// whoever allocated it (autograd's saved tensors, gradients, an op's working
// memory, a communication library's buffers, prefire's recomputations), as
// opposed to prefire's own census (RuntimeStats, SavedTensorMeter), which
// sees only the tensors prefire handles. Programs and benchmarks compare
// modes' memory with it (torch's checkpoint, no checkpointing, prefire's).

#include <c10/core/Device.h>

#include <cstdint>

namespace prefire {

struct AllocatorBytes {
  int64_t current = 0;  // bytes: allocated and not yet freed
  int64_t peak = 0;     // bytes: the most `current` has been since counting began or reset_allocator_peak()
};

/// Starts counting the CPU allocator: replaces ATen's CPU allocator
/// (c10::SetCPUAllocator, the highest priority) by one that forwards to it and
/// counts what it allocates and frees. Storages allocated before are not
/// counted, so call it before the model is built. Idempotent; any thread; it
/// stays for the process's life. Raises std::runtime_error where the CPU
/// allocator in use offers no raw interface to forward to.
void count_cpu_allocations();

/// The allocator's bytes on `device`: CPU, those counted since
/// count_cpu_allocations() (std::logic_error before it); CUDA, the caching
/// allocator's allocated bytes (requested blocks, rounded as it rounds them;
/// std::runtime_error in a build without CUDA). Any thread.
AllocatorBytes allocator_bytes(c10::Device device);

/// Starts a new peak window on `device` at the current bytes (CUDA: resets
/// every peak statistic of the caching allocator, as
/// torch.cuda.reset_peak_memory_stats does).
void reset_allocator_peak(c10::Device device);

}  // namespace prefire
