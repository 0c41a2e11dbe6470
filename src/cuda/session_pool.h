#pragma once

// Note [Session buffer pool]
// Rationale: tensors a prefire creates live from the prefire until their
// unpack in backward, across other work of the step. Served from the general
// caching allocator they fragment it and, with the B/W split, compete with
// the activations of the next micro-batch. A private pool keeps them apart and
// lets one iteration's buffers serve the next: after warm-up, reserved memory
// stops growing.
// Approach: one private pool of the CUDA caching allocator per device
// (MempoolId_t from at::cuda::graph_pool_handle()). A prefire routes its
// allocations there with beginAllocateToPool(device, pool, filter), the
// filter matching the prefire stream only, so allocations of other threads
// and streams are untouched, and endAllocateToPool() after the recomputation.
// The pool is reference-counted by the allocator: prefire keeps one owner
// reference from creation (createOrIncrefPool), each prefire takes one
// (beginAllocateToPool increments) and drops it (releasePool) when it ends;
// release_session_pools() drops the owner reference at teardown.
// Limitations: the pool's memory is not available to the rest of the program
// while it is reserved; empty_cache() returns it once it is unused.

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>

#include <cstdint>

namespace prefire::detail {

/// The pool of `device`, created on first use.
c10::MempoolId_t session_pool(c10::DeviceIndex device);


}  // namespace prefire::detail
