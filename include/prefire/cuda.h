#pragma once

// CUDA knobs of prefire. All of them work (as no-ops, or returning 0) in a
// build without CUDA or on a machine without a GPU. The prefire stream itself
// is in <prefire/cuda_stream.h> (CUDA builds only).
//
// What a prefire on a GPU orders, and what it does not:
// * The recomputation runs on the device's prefire stream (owned by prefire,
//   see cuda_stream.h), after an event recorded on the caller's current
//   stream when prefire() is called: everything the caller enqueued there
//   before (the checkpoint's inputs, the parameters' last update) is ready.
//   Tensors produced on other streams are not covered: make the caller's
//   stream wait for them first (as for any cross-stream use in torch).
// * Every unpack of a prefired tensor makes the unpacking thread's current
//   stream wait for the prefire, and tells the caching allocator the storage
//   is used there (recordStream), so its memory is reused only after that
//   stream is done with it.
// * Recomputations that restore generator state (preserve_rng_state, CPU and
//   CUDA Philox) run one at a time in the process: lazy ones, prefires, and
//   recomputations on autograd's device threads. Forward passes drawing
//   random numbers on other threads meanwhile are the user's business, as in
//   torch: the generator is process-wide.
// * A recomputation under autocast neither reads nor fills autocast's
//   process-wide weight-cast cache, and never clears it: casts made on the
//   prefire stream cannot reach another stream unordered, and another
//   thread's autocast region keeps its cache.

#include <cstdint>

namespace prefire {

/// Whether prefire was built with its CUDA parts and a CUDA device is present.
bool cuda_available();

/// Priority of the prefire streams prefire creates (0 default, negative
/// higher, as CUDA counts; clamped to the device's range). Takes effect for
/// devices whose prefire stream is created after the call: call it before the
/// first prefire (or the first prefire_stream()).
void set_prefire_stream_priority(int priority);

/// Whether prefires allocate from the session buffer pool, a private pool of
/// the CUDA caching allocator (off by default; see Note [Session buffer pool]
/// in src/cuda/session_pool.h for what it costs and buys). Set it before the
/// first prefire; prefires already running keep the setting they started with.
void set_session_pool_enabled(bool enabled);
bool session_pool_enabled();

/// Bytes the CUDA caching allocator has reserved for prefire's session
/// buffer pools, as its snapshot reports them (0 with the pool off). Cost: one
/// allocator snapshot; call it for reporting, not per step in hot loops.
int64_t session_pool_reserved_bytes();

/// Drops prefire's reference on the session buffer pools now, also while
/// sessions still hold pool memory; prefire creates a new pool when needed.
/// Without it the reference goes with the last recomputation prefired into
/// the pool (when its session is cleared or its checkpoint's graph freed).
/// Either way, c10's empty_cache() then gives the pool's unused memory back
/// to the device.
void release_session_pools();

}  // namespace prefire
