#pragma once

// What an OffloadTier is made of: the space it hands out, the bytes behind
// it (a reserved, unlinked file for the host tier) and the worker that copies
// into and out of it. Offloaded checkpoints (checkpoint/offloaded_slots.h)
// use it; nothing here knows checkpoints.

#include "offload/copy_worker.h"
#include "offload/space.h"

#include <c10/core/Storage.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

namespace prefire::detail {

class TierStore {
 public:
  /// Creates the file in `directory`, reserves `capacity` bytes and unlinks
  /// it; raises CheckpointError naming the directory and the reason.
  TierStore(const std::string& directory, int64_t capacity);
  /// Runs the queued copies, then closes the file.
  ~TierStore();
  TierStore(const TierStore&) = delete;
  TierStore& operator=(const TierStore&) = delete;

  /// A region for `nbytes` (> 0). Raises CheckpointError, saying how full
  /// the tier is and what asked (`what`), when no free run is long enough.
  std::shared_ptr<Region> allocate(int64_t nbytes, const std::string& what);
  /// Queues a copy of `storage`'s first region->nbytes bytes into `region`.
  /// The copy holds both and releases the storage once it is written; a
  /// storage that has a Python object is written on this thread instead.
  std::shared_ptr<Copy> write(c10::Storage storage, std::shared_ptr<Region> region);
  /// Queues a copy of `region` into `storage` (after every copy queued before
  /// it); raises, on the worker, what `written` (the copy into `region`) raised.
  std::shared_ptr<Copy> read_async(std::shared_ptr<Region> region, c10::Storage storage,
                                   std::shared_ptr<Copy> written);
  /// Waits for every copy queued so far.
  void synchronize();
  /// Copies `region` into `storage` on this thread.
  void read_now(const Region& region, c10::Storage& storage);

  const Space& space() const { return space_; }
  Space& space() { return space_; }
  int64_t bytes_written() const { return bytes_written_.load(std::memory_order_relaxed); }
  int64_t bytes_read() const { return bytes_read_.load(std::memory_order_relaxed); }
  const std::string& directory() const { return directory_; }

 private:
  void write_now(const c10::Storage& storage, const Region& region);

  const std::string directory_;
  int fd_ = -1;
  Space space_;
  std::atomic<int64_t> bytes_written_{0};
  std::atomic<int64_t> bytes_read_{0};
  CopyWorker worker_;  // last: joined before the file closes
};

}  // namespace prefire::detail
