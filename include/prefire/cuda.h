#pragma once

// CUDA knobs of prefire. All of them work (as no-ops, or returning 0) in a
// build without CUDA or on a machine without a GPU.

#include <cstdint>

namespace prefire {

/// Whether prefire was built with its CUDA parts and a CUDA device is present.
bool cuda_available();

/// Priority of the prefire streams taken from the c10 stream pool (0 default,
/// negative higher, as CUDA counts). Takes effect for devices whose prefire
/// stream is created after the call; call it before the first prefire.
void set_prefire_stream_priority(int priority);

/// Bytes the CUDA caching allocator has reserved for prefire's session buffer
/// pools (one per device), as its snapshot reports them. Cost: one allocator
/// snapshot; call it for reporting, not per step in hot loops.
int64_t session_pool_reserved_bytes();

/// Returns the session pools' memory to the allocator once nothing uses it.
/// For teardown; prefire creates the pools again when needed.
void release_session_pools();

}  // namespace prefire
