#pragma once

// What an OffloadTier is made of: the space it hands out and the copies into
// and out of it, behind one interface with a store per kind of tier (the host
// file tier's in offload/host_file_store.h, the pinned host tier's in
// offload/pinned_host_store.h). Offloaded checkpoints
// (checkpoint/offloaded_slots.h) and offloaded inputs use it; nothing here
// knows checkpoints.

#include <prefire/offload.h>

#include "cuda/prefire_stream.h"
#include "offload/copy_worker.h"
#include "offload/space.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Storage.h>

#include <c10/core/TensorImpl.h>
#include <c10/util/flat_hash_map.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace prefire::detail {

/// One saved storage's copy in a tier.
struct StorageCopy {
  std::shared_ptr<Region> region;  // null for 0 bytes
  std::shared_ptr<Copy> written;   // the copy into the region
  int64_t nbytes = 0;
  c10::Device device{c10::kCPU};  // where the storage was, and where its copy comes back to
};

class TierStore {
 public:
  /// Stops counting what is still pending (the store's destructor ran it).
  virtual ~TierStore();
  TierStore(const TierStore&) = delete;
  TierStore& operator=(const TierStore&) = delete;

  /// Why this tier cannot take `t`, or nullptr when it can.
  const char* refuses(const at::Tensor& t) const;
  /// Takes a region for `tensor`'s storage (CheckpointError, saying how full
  /// the tier is and what asked (`what`), when no free run is long enough)
  /// and queues the copy into it; the copy holds the storage until it is
  /// written. Then holds back while the bytes queued and not yet written are
  /// over max_pending_bytes() (Note [Backpressure on copies into a tier]). A
  /// storage whose copy is still in the tier and unchanged since (the same
  /// version of the same version counter) shares that copy instead (Note
  /// [One copy per storage]).
  StorageCopy copy_in(const at::Tensor& tensor, const std::string& what);
  /// What read() gives back.
  struct ReadBack {
    std::vector<c10::Storage> storages;  // one per copy, in order
    std::shared_ptr<ReadyEvent> ready;   // a queued read's: what an unpack hands each tensor over with
    bool in_pool = false;                // the storages come from the session buffer pool
  };
  /// Reads each of `copies` back into a new storage on its device, after its
  /// copy into the tier; raises what that copy raised. Not queued (a lazy
  /// fetch): the storages are ready for this thread (on a device: for its
  /// current stream) when this returns. Queued (a prefetch): returns at once.
  virtual ReadBack read(const std::vector<StorageCopy>& copies, bool queued) = 0;
  /// One copy read back, not queued.
  c10::Storage read_now(const StorageCopy& copy);
  /// Waits for every copy queued so far.
  virtual void synchronize() = 0;
  /// Seconds one copy of `nbytes` into the tier and one back take, measured
  /// now on a scratch region and storage.
  double measure_copy_seconds(int64_t nbytes);

  /// Bytes queued into the tier and not yet written; copies seen done are forgotten first.
  int64_t pending_bytes();
  /// Forgets the queued copies that are done (their storages are let go):
  /// what a store calls when it learns that one finished, and synchronize's caller.
  void settle() noexcept;
  void set_max_pending_bytes(int64_t bytes) { max_pending_.store(bytes, std::memory_order_relaxed); }
  int64_t max_pending_bytes() const { return max_pending_.load(std::memory_order_relaxed); }

  Space& space() { return space_; }
  const Space& space() const { return space_; }
  int64_t bytes_written() const { return bytes_written_.load(std::memory_order_relaxed); }
  int64_t bytes_read() const { return bytes_read_.load(std::memory_order_relaxed); }

 protected:
  /// `where` names the tier in errors ("in \"/tmp\"", "of pinned host memory").
  TierStore(int64_t capacity, std::string where) : where_(std::move(where)), space_(capacity) {}

  /// Why this tier cannot take `t`'s device, or nullptr.
  virtual const char* refuses_device(const at::Tensor& t) const = 0;
  /// Queues a copy of `storage`'s first region->nbytes bytes into `region`.
  virtual std::shared_ptr<Copy> write(c10::Storage storage, std::shared_ptr<Region> region) = 0;
  /// Gives back to the space the regions whose copies are done; with `wait`,
  /// after waiting for them. A tier whose freed regions stay in use until
  /// their copies finish (a stream's) overrides it; allocate() calls it.
  virtual void reclaim(bool wait) { (void)wait; }
  /// A zeroed storage of `nbytes` on the tier's scratch device, to measure with.
  virtual c10::Storage scratch_storage(int64_t nbytes) = 0;

  void count_written(int64_t n) { bytes_written_.fetch_add(n, std::memory_order_relaxed); }
  void count_read(int64_t n) { bytes_read_.fetch_add(n, std::memory_order_relaxed); }
  const std::string& where() const { return where_; }

 private:
  std::shared_ptr<Region> allocate(int64_t nbytes, const std::string& what);
  /// Counts a queued copy of `nbytes` as pending, then waits while over the limit.
  void hold_back(const std::shared_ptr<Copy>& written, int64_t nbytes);
  /// The copy of the same bytes that `tensor`'s storage already has in the tier, if any.
  bool find_written(const at::Tensor& tensor, StorageCopy& copy);
  void remember_written(const at::Tensor& tensor, const StorageCopy& copy);

  const std::string where_;
  Space space_;

  std::mutex pending_mu_;  // guards pending_ and pending_bytes_
  std::deque<std::pair<std::shared_ptr<Copy>, int64_t>> pending_;  // queued copies not seen done, and their bytes
  int64_t pending_bytes_ = 0;
  std::atomic<int64_t> max_pending_{std::numeric_limits<int64_t>::max()};

  struct Written {  // a storage's copy in the tier, for later saves of the same bytes (Note [One copy per storage])
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;  // pins the address while the entry lives
    c10::VariableVersion counter;
    uint32_t version = 0;
    std::weak_ptr<Region> region;
    std::shared_ptr<Copy> written;
  };
  std::mutex written_mu_;  // guards written_ and sweep_at_
  ska::flat_hash_map<const c10::StorageImpl*, Written> written_;
  size_t sweep_at_ = 64;
  std::atomic<int64_t> bytes_written_{0};
  std::atomic<int64_t> bytes_read_{0};
};

/// A tier's internals, for the offloaded checkpoints (OffloadTier keeps them private).
struct TierAccess {
  static TierStore& store(const OffloadTier& tier) { return *tier.store_; }
};

}  // namespace prefire::detail
