#pragma once

// The tensors one recomputation of a checkpoint saved, by slot, and the bytes
// they hold. See Note [Counting recomputed bytes].

#include <ATen/core/Tensor.h>
#include <c10/core/StorageImpl.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

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
/// Whether `t` aliases a tensor that lives anyway: a leaf that requires grad
/// (a parameter, a stage input) or a view of one (the w.t() a linear saves).
/// Such storages are not activation memory and are never counted.
bool aliases_a_leaf(const at::Tensor& t);

/// Counts one recomputation in RuntimeStats.
void count_recomputation();

class ReadyEvent;

class Recomputation {
 public:
  /// `owner` (a session's gauge) sees the same byte changes as the global one.
  explicit Recomputation(std::shared_ptr<ByteGauge> owner = nullptr) : owner_(std::move(owner)) {}
  ~Recomputation();
  Recomputation(const Recomputation&) = delete;
  Recomputation& operator=(const Recomputation&) = delete;

  /// The first unpacker recomputes under it; the others wait for the result.
  std::mutex mu;
  bool done = false;  // guarded by mu
  /// Set when a prefire ran on a device's prefire stream: unpacks wait on it.
  std::shared_ptr<ReadyEvent> ready;  // guarded by mu

  /// Bytes count in `pool_gauge` too (a session's pool bytes, for a prefire
  /// whose allocations go to the session buffer pool). Before any store.
  void count_pool_bytes_in(std::shared_ptr<ByteGauge> pool_gauge) { pool_owner_ = std::move(pool_gauge); }

  /// Drops everything and makes room for `num_slots` tensors.
  void reset(size_t num_slots);
  /// Keeps `tensor` as `slot`. `counted`: its storage is new memory (not a
  /// parameter or a checkpoint input) and counts in the gauges.
  void store(size_t slot, at::Tensor tensor, bool counted);
  /// Hands out `slot`: moved out (and marked consumed) unless `retain`.
  /// Undefined when the slot was never stored.
  at::Tensor take(size_t slot, bool retain);
  bool consumed(size_t slot) const { return consumed_.at(slot) != 0; }
  int64_t bytes() const { return bytes_; }

 private:
  void release(size_t slot) noexcept;

  std::vector<at::Tensor> tensors_;  // by slot
  std::vector<uint8_t> consumed_;    // by slot
  std::vector<uint8_t> counted_;     // by slot
  std::unordered_map<const c10::StorageImpl*, int> storages_;  // counted storages -> slots holding them
  int64_t bytes_ = 0;  // bytes of counted storages held
  std::shared_ptr<ByteGauge> owner_;
  std::shared_ptr<ByteGauge> pool_owner_;  // set before anything is stored, never changed
};

}  // namespace prefire::detail
