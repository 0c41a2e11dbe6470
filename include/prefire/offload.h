#pragma once

// Offloading a checkpoint: the tensors its forward saves are copied to a tier
// outside the device's memory as they are saved, and copied back (fetched)
// for backward instead of being recomputed. Scheduling is the one checkpoints
// have: prefire() on an offloaded checkpoint is a prefetch, attach() makes the
// first pass fetch it, and a session shares one fetched copy between its
// passes. See Note [Offloading a checkpoint] in src/checkpoint/offloaded_slots.cpp.

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
  /// Raises std::invalid_argument for capacity_bytes under one page (4096) and CheckpointError
  /// naming the directory and the reason when the file cannot be created or
  /// reserved (no such directory, no permission, no space).
  static std::shared_ptr<OffloadTier> host_file(const std::string& directory, int64_t capacity_bytes);
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

}  // namespace prefire
