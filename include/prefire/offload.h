#pragma once

// Offloading a checkpoint: the tensors its forward saves are copied to a tier
// outside the device's memory as they are saved, and copied back (fetched)
// for backward instead of being recomputed. Scheduling is the one checkpoints
// have: prefire() on an offloaded checkpoint is a prefetch, attach() makes the
// first pass fetch it, and a session shares one fetched copy between its
// passes. See Note [Offloading a checkpoint] in src/checkpoint/offloaded_slots.cpp.

#include <prefire/schedule.h>

#include <cstdint>
#include <memory>
#include <string>

namespace prefire {

namespace detail {
class TierStore;
struct TierAccess;  // the offloaded checkpoints' way to a tier's internals (src/offload/tier_store.h)
}  // namespace detail

/// Where offloaded checkpoints keep their saved tensors between forward and
/// backward. Pass it as CheckpointOptions::offload_to; a tier serves any
/// number of checkpoints and threads, and lives as long as the checkpoints
/// that use it.
class OffloadTier {
 public:
  /// A host tier for CPU tensors: a file of `capacity_bytes` in `directory`,
  /// reserved on disk at once and unlinked at once (nothing is left behind,
  /// also when the process dies), so offloaded bytes leave the process's
  /// memory for the kernel's page cache and the disk. Copies into the file
  /// run on a worker thread of the tier (forward does not wait for them);
  /// the saved tensor's storage is released by the copy once it is written.
  /// `bytes_per_second` > 0 paces the tier: each copy (either way) takes at
  /// least nbytes / bytes_per_second seconds, so that a planner's choice
  /// between offloading and recomputing can be tried on any machine at
  /// another link's ratios (0: as fast as the file goes).
  /// Raises std::invalid_argument for capacity_bytes under one page (4096) or
  /// a negative or infinite bytes_per_second, and CheckpointError naming the
  /// directory and the reason when the file cannot be created or reserved (no
  /// such directory, no permission, no space).
  static std::shared_ptr<OffloadTier> host_file(const std::string& directory, int64_t capacity_bytes,
                                                double bytes_per_second = 0);
  /// A host tier for CUDA tensors: `capacity_bytes` of page-locked host
  /// memory, pinned at once. Copies to it run on a copy stream per device
  /// (forward does not wait; the saved tensor's device memory is reused once
  /// its copy is done), fetches on the stream that reads (a lazy fetch on
  /// backward's, a prefetch on the prefire stream). See Note [The pinned host
  /// tier] in src/offload/pinned_host_store.h. Raises std::invalid_argument for
  /// capacity_bytes under one page and CheckpointError when this build has no
  /// CUDA, no device is visible or the memory cannot be pinned.
  static std::shared_ptr<OffloadTier> pinned_host(int64_t capacity_bytes);

  ~OffloadTier();
  OffloadTier(const OffloadTier&) = delete;
  OffloadTier& operator=(const OffloadTier&) = delete;

  int64_t capacity_bytes() const;
  /// Bytes of the tier that offloaded tensors hold now (rounded up to pages).
  int64_t used_bytes() const;
  /// Largest used_bytes() since the tier was made or reset_peak().
  int64_t peak_used_bytes() const;
  void reset_peak();
  /// Copies into and out of the tier since it was made.
  int64_t bytes_written() const;
  int64_t bytes_read() const;

  /// Blocks until every copy queued so far (into the tier or out of it) is
  /// done: then every offloaded storage the tier alone holds has been
  /// released (on a device: given back to the caching allocator, which
  /// reuses it at its next allocation). Copy errors are not raised here but
  /// by the fetch that needs the copy.
  void synchronize();

  /// Bytes of storages queued into the tier and not yet written: held where
  /// they were (and counted as held by RuntimeStats::held_bytes) until then.
  int64_t pending_bytes() const;
  /// Backpressure: a forward that queues a copy while pending_bytes() would
  /// be over this waits for the oldest copies first (0: every copy is written
  /// before forward goes on). No limit by default; prefire's memory planners
  /// set it to their plan's headroom. See Note [Backpressure on copies into a
  /// tier] in src/offload/tier_store.cpp. std::invalid_argument when negative.
  void set_max_pending_bytes(int64_t bytes);
  int64_t max_pending_bytes() const;

  /// Seconds one copy of `nbytes` into the tier and one back take, measured
  /// now on a scratch region (the pinned host tier: from and to the current
  /// CUDA device), after one untimed pair (a region's first copy pays for
  /// the file's pages, which the regions of later steps reuse): what a
  /// planner charges an offloaded block, Note [Offloaded blocks in a plan]
  /// in src/plan/plan_bytes.cpp. Raises CheckpointError when the tier has no
  /// free run of `nbytes`.
  double measure_copy_seconds(int64_t nbytes);

 private:
  friend struct detail::TierAccess;
  explicit OffloadTier(std::unique_ptr<detail::TierStore> store);
  std::unique_ptr<detail::TierStore> store_;
};

/// Inside a backward (a hook that runs in it, on its thread): starts the
/// fetch of the handle's offloaded checkpoint for this backward now, queued
/// on its tier (the host file tier's worker, the prefire stream), so that its
/// unpacks in this backward wait for those reads instead of reading then: a
/// plain backward's reload schedule (Note [A reload schedule for a plain
/// backward] in src/plan/reload_schedule.cpp). Returns false, doing nothing,
/// when the handle is expired, its checkpoint is not offloaded or is
/// registered to a session (prefire() fetches those), or no backward runs on
/// this thread. std::invalid_argument for a default-made handle.
bool fetch_ahead(const CheckpointHandle& handle);

}  // namespace prefire
