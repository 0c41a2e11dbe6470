#pragma once

// Bytes of saved-tensor memory: which storages count, each counted once, and
// the gauges that hold the totals. See Note [Counting saved bytes].

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/flat_hash_map.h>

#include <cstdint>
#include <mutex>

namespace prefire::detail {

/// Bytes held, with a peak. Thread-safe.
class ByteGauge {
 public:
  void add(int64_t bytes);
  void sub(int64_t bytes) noexcept;
  int64_t current() const;
  int64_t peak() const;
  void reset_peak();

 private:
  mutable std::mutex mu_;
  int64_t current_ = 0;  // bytes
  int64_t peak_ = 0;     // bytes
};

/// The gauges behind RuntimeStats: every recomputation, any key; and that
/// plus the bytes SavedTensorMeters count ("held": all saved-tensor memory
/// the runtime sees).
ByteGauge& global_recomputed_bytes();
ByteGauge& global_held_bytes();

/// Whether `t`'s storage is activation memory: it has one, and `t` does not
/// alias a tensor that lives anyway (a leaf that requires grad, such as a
/// parameter or a stage input, or a view of one: the w.t() a linear saves).
/// Only such storages are ever counted.
bool is_activation(const at::Tensor& t);

/// Counts each storage once, however many saved tensors use it. Not
/// thread-safe: its owner locks. A storage's address identifies it while it
/// is counted, so the owner keeps it alive (or pinned) until it is removed.
class StorageCensus {
 public:
  /// One more tensor uses `storage`: returns `nbytes` when it is the first
  /// (the storage is now counted), else 0.
  int64_t add(const c10::StorageImpl* storage, int64_t nbytes);
  int64_t add(const c10::Storage& storage) { return add(storage.unsafeGetStorageImpl(), nbytes_of(storage)); }
  /// One tensor less uses `storage`: returns `nbytes` when it was the last
  /// (the storage is no longer counted), else 0; 0 for a storage not counted.
  int64_t remove(const c10::StorageImpl* storage, int64_t nbytes) noexcept;
  int64_t remove(const c10::Storage& storage) noexcept {
    return remove(storage.unsafeGetStorageImpl(), nbytes_of(storage));
  }
  /// Forgets every storage (and its memory).
  void clear() noexcept { users_ = {}; }

  static int64_t nbytes_of(const c10::Storage& storage) { return static_cast<int64_t>(storage.nbytes()); }

 private:
  ska::flat_hash_map<const c10::StorageImpl*, int64_t> users_;  // storage -> tensors using it
};

}  // namespace prefire::detail
