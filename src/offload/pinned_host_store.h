#pragma once

// The pinned host tier (OffloadTier::pinned_host): CUDA tensors copied into
// page-locked host memory of prefire's, on streams, overlapped with compute.
//
// Note [The pinned host tier]
// Memory: one block of page-locked host memory (cudaHostAlloc, portable: any
// device copies to and from it), pinned once when the tier is made, so no copy
// pays for pinning and the tier's size is known up front; regions are handed
// out in pages as in any tier (offload/space.h).
// Into the tier (forward, on the saving thread, which never waits): the copy
// stream of the storage's device (one per device and process, made by prefire,
// never one of c10's pool streams) waits on an event recorded on the device's
// current stream (the saved tensor was produced by work queued there before the
// pack), the device-to-host copy is queued on it and an event records its end
// (the copy that a read waits on). The storage is then marked as used on the
// copy stream (record_stream_use in cuda/prefire_stream.h) and let go: the
// caching allocator reuses its memory once the copy is done, not before.
// Inside a prefire on this thread (an offloaded checkpoint nested in a
// prefired recomputation), where the allocator does not keep such a mark
// past the prefire's window, the tier holds the storage instead until its
// copy is seen done (see Regions).
// Back (a fetch): the storage is allocated on the stream that reads, which
// waits on the copy's event and then copies host to device. A lazy fetch reads
// on the unpacking thread's current stream (backward's), so what follows on it
// is ordered after the copy. A prefetch reads inside a PrefireRun: on the
// device's prefire stream, ordered after the caller's stream, in the session
// buffer pool when it is on, and every unpack's stream waits on the run's event
// (Note [Stream ordering of prefire], step 4).
// Regions: a freed region may still be read (a prefetch queued on a stream
// that has not run yet) or written; each copy records an event and holds its
// region until that event is done, so a region returns to the space only once
// no copy uses it. Finished copies are collected at every allocation, in
// queue order up to the first not done, and all of them are waited for before
// the tier calls itself full and at synchronize().
// Errors: a copy that cannot be queued raises at the call (forward or the
// fetch); an error of the device while copying surfaces as CUDA errors do, at
// the next call that synchronizes. Without CUDA in the build or without a
// device, making the tier raises CheckpointError.
// Limitations: CUDA tensors only (CPU tensors go to the host file tier); a
// prefetch runs on the device of the block's first offloaded storage, reads
// for other devices on their current streams.

#include "offload/tier_store.h"

#include <cstdint>
#include <memory>

namespace prefire::detail {

/// The store of OffloadTier::pinned_host. Raises CheckpointError when prefire
/// was built without CUDA, no CUDA device is visible, or `capacity` bytes
/// cannot be pinned.
std::unique_ptr<TierStore> make_pinned_host_store(int64_t capacity);

}  // namespace prefire::detail
