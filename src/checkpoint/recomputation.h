#pragma once

// The tensors one recomputation of a checkpoint saved, by slot, the bytes
// they hold (see Note [Counting saved bytes] in memory/storage_census.cpp),
// and the single flight that makes every user of one key share one
// recomputation (see Note [Single-flight recomputation]).

#include "memory/storage_census.h"

#include <ATen/core/Tensor.h>
#include <c10/util/FunctionRef.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

namespace prefire::detail {

/// Counts one recomputation in RuntimeStats; `in_session`: keyed by a
/// session (else by a backward graph task, a GraphExecGroup, or no key).
void count_recomputation(bool in_session);
/// Counts one fetch of an offloaded checkpoint in RuntimeStats (Note
/// [Offloading a checkpoint] in checkpoint/offloaded_slots.cpp); `in_session` as above.
void count_offload_fetch(bool in_session);
/// Recomputations and offload fetches since start that no session kept (RuntimeStats::unshared_recomputations).
int64_t unshared_recomputations();
/// A checkpoint prefired into session `session` was let go with no pass
/// having used its recomputation: counts it in RuntimeStats and warns (once
/// per process). Never throws. See Note [A session shares what is registered to it]
/// in session/session.h.
void count_wasted_prefire(int64_t session) noexcept;

class ReadyEvent;

class Recomputation {
 public:
  /// `owner` (a session's gauge) sees the same byte changes as the global
  /// one; `pool` (its buffer-pool gauge) too, once count_in_pool() is called.
  explicit Recomputation(std::shared_ptr<ByteGauge> owner = nullptr, std::shared_ptr<ByteGauge> pool = nullptr)
      : owner_(std::move(owner)), pool_(std::move(pool)) {}
  ~Recomputation();
  Recomputation(const Recomputation&) = delete;
  Recomputation& operator=(const Recomputation&) = delete;

  // ---- single flight: any thread ----
  /// Runs `compute` unless the recomputation is done; returns whether this
  /// call ran it. Callers on other threads wait for a running `compute` and
  /// then share its result. When `compute` throws, everything it stored is
  /// dropped, the recomputation is empty again (a waiter or a later caller
  /// computes afresh) and the exception reaches this caller only. Raises
  /// CheckpointError when `compute` itself asks for the recomputation it is
  /// computing (it would wait for itself).
  bool ensure(c10::function_ref<void()> compute);
  /// Whether a computation finished and its result is held.
  bool done() const { return state_.load(std::memory_order_acquire) == State::kDone; }

  // ---- inside `compute`, on the computing thread ----
  /// Drops everything and makes room for `num_slots` tensors.
  void reset(size_t num_slots);
  /// Keeps `tensor` as `slot`. `counted`: its storage is new memory (not a
  /// parameter or a checkpoint input) and counts in the gauges.
  void store(size_t slot, at::Tensor tensor, bool counted);

  // ---- any thread, any time ----
  /// Drops the tensor of `slot`, if held: nothing will unpack it any more.
  void drop(size_t slot) noexcept;
  /// The tensors of this computation come from the session buffer pool:
  /// their bytes count in the pool gauge too. Before any store.
  void count_in_pool() { in_pool_ = pool_ != nullptr; }
  /// When the tensors are ready on the device (a prefire on a prefire stream).
  void set_ready(std::shared_ptr<ReadyEvent> ready) { ready_ = std::move(ready); }

  // ---- once done: any thread ----
  /// Hands out `slot`: a copy of the reference when `retain`, else moved out
  /// and the slot marked consumed. std::nullopt when the slot was consumed
  /// already; an undefined tensor when it was never stored.
  std::optional<at::Tensor> take(size_t slot, bool retain);
  /// Hands out `slot` to a session pass that lets go when it ends (a scope
  /// with retain_on_unpack=false): a copy, kept until end_pass() or drop().
  /// See Note [The last pass lets go when it ends] in session/session.h.
  std::optional<at::Tensor> take_for_pass(size_t slot);
  /// Drops, for good, every slot take_for_pass() handed out.
  void end_pass() noexcept;
  /// Hands out `slot` and drops it as keep_only() would: a later unpack is
  /// a trim miss, not a second unpack. std::nullopt when it was consumed.
  std::optional<at::Tensor> take_and_trim(size_t slot);
  /// Drops, for the rest of this computation, every slot `keep` (by slot)
  /// leaves out (Note [A session keeps what the next pass reads] in
  /// session/keep_only.cpp); a computation not run yet has nothing to drop.
  void keep_only(const std::vector<bool>& keep) noexcept;
  /// Whether keep_only() dropped `slot` (no lock unless keep_only() ran: the unpack path asks).
  bool trimmed(size_t slot);
  /// Slots this computation was reset to hold.
  size_t num_slots() const { return tensors_.size(); }
  /// Set when a prefire ran on a device's prefire stream: unpacks wait on it.
  const std::shared_ptr<ReadyEvent>& ready() const { return ready_; }

 private:
  enum class State { kEmpty, kRunning, kDone };
  // Caller holds mu_.
  void drop_locked(size_t slot) noexcept;
  /// Drops `slot` for the rest of this computation: a later unpack is a trim miss.
  void trim_locked(size_t slot) noexcept;
  void drop_all_locked() noexcept;

  std::mutex mu_;  // guards the single flight and the slots (the computing thread holds it only briefly)
  std::condition_variable finished_;
  std::atomic<State> state_{State::kEmpty};
  std::thread::id runner_;  // the thread running `compute` (kRunning)

  std::vector<at::Tensor> tensors_;  // by slot
  std::vector<uint8_t> consumed_;    // by slot
  std::vector<uint8_t> taken_;       // by slot: handed out by take_for_pass() since the last end_pass()
  std::vector<uint8_t> counted_;     // by slot
  std::vector<uint8_t> trimmed_;     // by slot: dropped by keep_only() or take_and_trim()
  std::atomic<bool> any_trimmed_{false};
  StorageCensus census_;             // the storages of counted slots
  const std::shared_ptr<ByteGauge> owner_;
  const std::shared_ptr<ByteGauge> pool_;
  bool in_pool_ = false;  // set by `compute` before anything is stored
  std::shared_ptr<ReadyEvent> ready_;      // written by `compute`, read-only once done
};

}  // namespace prefire::detail
