#pragma once

// The host file tier (OffloadTier::host_file): CPU tensors copied into a
// file that is reserved at once and unlinked at once, by a worker thread that
// stands in for a copy stream.

#include "offload/copy_worker.h"
#include "offload/tier_store.h"

#include <chrono>
#include <string>

namespace prefire::detail {

class HostFileStore final : public TierStore {
 public:
  /// Creates the file in `directory`, reserves `capacity` bytes and unlinks
  /// it; raises CheckpointError naming the directory and the reason.
  /// `bytes_per_second` > 0: each copy takes at least nbytes / bytes_per_second.
  HostFileStore(const std::string& directory, int64_t capacity, double bytes_per_second = 0);
  /// Runs the queued copies, then closes the file.
  ~HostFileStore() override;

  ReadBack read(const std::vector<StorageCopy>& copies, bool queued) override;
  void synchronize() override;

 protected:
  const char* refuses_device(const at::Tensor& t) const override;
  /// The copy holds the storage and releases it once written; a storage that
  /// has a Python object is written on this thread instead.
  std::shared_ptr<Copy> write(c10::Storage storage, std::shared_ptr<Region> region) override;
  c10::Storage scratch_storage(int64_t nbytes) override;

 private:
  void write_now(const c10::Storage& storage, const Region& region);
  void read_region(const Region& region, c10::Storage& storage);
  /// Sleeps what is left of `nbytes`' time at bytes_per_second_ since `begin`.
  void pace(std::chrono::steady_clock::time_point begin, int64_t nbytes) const;

  const std::string directory_;
  const double bytes_per_second_;
  int fd_ = -1;
  CopyWorker worker_{[this] { settle(); }};  // last: joined before the file closes
};

}  // namespace prefire::detail
