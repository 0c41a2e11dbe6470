#pragma once

// A checkpoint frame: one call of prefire::checkpoint() and everything needed
// to recompute it. See Note [Frame lifetime] and Note [Recomputation keys] in
// frame.cpp.

#include <prefire/checkpoint.h>
#include <prefire/observer.h>

#include "hook_stack.h"
#include "recomputation.h"
#include "session_entry.h"
#include "state_capture.h"

#include <c10/core/SafePyObject.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/SmallVector.h>
#include <c10/util/flat_hash_map.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace prefire::detail {

/// What the determinism check compares per saved tensor.
struct SlotMetadata {
  c10::SmallVector<int64_t, 5> sizes;
  at::ScalarType dtype = at::kFloat;
  c10::Device device = c10::Device(c10::kCPU);
  std::optional<uint64_t> checksum;  // determinism_check = checksum only; compared on its own

  static SlotMetadata of(const at::Tensor& t);
  /// Whether `t` has this shape, dtype and device (no allocation: the recompute path's check).
  bool matches(const at::Tensor& t) const;
  std::string to_string() const;
};

/// Whether a recomputation runs on this thread.
bool recomputing_on_this_thread();

/// While it lives, an unpack on this thread of a checkpoint registered to
/// `session` is served from the session even when no scope binds it: the
/// inputs of a nested checkpoint that a prefire of `session` recomputes come
/// from its parent's recomputation in the same session.
class PrefireSessionScope {
 public:
  explicit PrefireSessionScope(const SessionCore* session) noexcept;
  ~PrefireSessionScope();
  PrefireSessionScope(const PrefireSessionScope&) = delete;
  PrefireSessionScope& operator=(const PrefireSessionScope&) = delete;

 private:
  const SessionCore* previous_;
};

class Frame final : public HookContext, public std::enable_shared_from_this<Frame> {
 public:
  /// Captures RNG/autocast/device/thread state and saves `inputs` through
  /// autograd (see Note [Save frame inputs through autograd] in frame.cpp).
  /// Must run before the frame is pushed, so that an enclosing context packs
  /// the inputs.
  Frame(CheckpointFn fn, const TensorList& inputs, const CheckpointOptions& options);
  ~Frame();

  // ---- forward: the thread running checkpoint() ----
  /// Runs `fn` with this frame receiving the saves, then freezes the slots.
  /// A checkpoint whose forward runs inside another's becomes its child.
  /// Returns the outputs and whether this frame is nested in another.
  std::pair<TensorList, bool> forward(const TensorList& inputs);
  std::unique_ptr<PackedTensor> pack(const at::Tensor& tensor) override;
  /// Number of tensors autograd saved inside the forward run.
  size_t num_slots() const { return num_slots_; }
  /// Bytes a recomputation of this frame holds; see Note [Counting recomputed bytes].
  int64_t expected_bytes() const { return expected_bytes_; }
  /// Bytes the forward saved unchecked would hold: expected_bytes() and the
  /// inputs it saved (leaves that require grad not counted).
  int64_t kept_bytes() const { return expected_bytes_ + saved_input_bytes_; }
  /// This frame and the checkpoints nested in its forward whose graphs are
  /// alive, recursively, every parent before its children.
  std::vector<std::shared_ptr<Frame>> with_nested();

  // ---- backward: any thread ----
  /// The recomputed tensor of `slot`; see Note [Recomputation keys].
  at::Tensor unpack(size_t slot);
  /// Autograd released the saved tensor of `slot`: never store it again.
  void release_slot(size_t slot) noexcept;

  // ---- sessions: called by the session layer (see Note [Session binding] in session.h) ----
  /// Registers the frame to `session` with a new, empty entry, or returns the
  /// entry it has there (second: whether it is new). Raises CheckpointError
  /// when the frame is registered to another session.
  std::pair<std::shared_ptr<SessionEntry>, bool> register_to(const std::shared_ptr<SessionCore>& session);
  /// Drops the registration to `session` (no-op when registered elsewhere or
  /// nowhere). An unpack that already holds the entry finishes with it.
  void unregister_from(const SessionCore& session) noexcept;
  /// Whether unpacks are served from the registered session (a scope of it is open).
  void bind(bool bound) noexcept;
  /// A pass of `session` with retain_on_unpack=false ended: releases what it
  /// handed out (no-op when registered elsewhere or nowhere).
  void end_pass(const SessionCore& session) noexcept;
  /// Recomputes into `entry` now, as a prefire, unless it is done; returns
  /// whether this call recomputed.
  bool prefire(SessionEntry& entry);

  /// How much of `fn` one recomputation redoes: the slots it fills, and
  /// whether it stops once the last of them is saved (Note [Early stop]).
  struct Extent {
    size_t slots = 0;
    bool stop_at_last = false;
  };

  /// Called from the recomputation's pack hook with the tensor recompute
  /// saved as slot `index` (an alias; see Note [Aliases of recomputed
  /// tensors]): checks and stores it. Returns whether recomputation may stop.
  bool store_recomputed(Recomputation& r, size_t index, const at::Tensor& tensor, const Extent& extent);

 private:
  struct SessionUnpack {
    std::shared_ptr<SessionEntry> entry;
    bool retain = false;
    bool for_nested_prefire = false;  // see Note [A nested prefire takes its inputs on the prefire stream]
  };
  std::optional<SessionUnpack> session_for_unpack() const;
  /// The recomputation of every slot, once forward is done.
  Extent full_extent() const { return {num_slots_, stop_at_last_slot_}; }
  /// An unpack while forward still runs; see Note [Backward inside the checkpointed function].
  at::Tensor unpack_in_forward(size_t slot);
  at::Tensor unpack_by_graph_task(size_t slot, const Extent& extent);
  /// compute_once() of a lazy recomputation outside sessions, telling the observer.
  void compute_lazily(Recomputation& r, const Extent& extent);
  std::shared_ptr<Recomputation> recomputation_for(int64_t graph_task);
  std::shared_ptr<Recomputation> recomputation_for(const c10::SafePyObject& group);
  void drop(int64_t graph_task) noexcept;
  /// Runs the recomputation of `r` unless it is done; returns the observer's
  /// event when this call ran it. See Note [Single-flight recomputation].
  std::optional<RecomputeEvent> compute_once(Recomputation& r, RecomputeEvent::Kind kind,
                                             std::optional<SessionId> session, const Extent& extent);
  RecomputeEvent recompute(Recomputation& r, RecomputeEvent::Kind kind, std::optional<SessionId> session,
                           const Extent& extent);
  TensorList recompute_inputs() const;
  at::Tensor take(Recomputation& r, size_t slot, bool retain, std::optional<SessionId> session,
                  bool in_group = false, bool hand_over = true);

  const CheckpointFn fn_;
  const CheckpointOptions options_;
  CapturedState state_;  // its generator snapshot may be dropped after forward; read-only after
  std::optional<c10::Device> prefire_device_;  // the first CUDA input's; see Note [Stream ordering of prefire]
  std::vector<torch::autograd::SavedVariable> saved_inputs_;
  std::vector<c10::VariableVersion> input_versions_;  // counters of the inputs, to detect in-place changes
  std::vector<uint32_t> input_saved_versions_;

  // Written by the forward thread before forward_done_, read-only after.
  std::atomic<bool> forward_done_{false};
  size_t num_slots_ = 0;
  // Per-slot vectors keep a few slots inline: most checkpoints save a handful
  // of tensors, and these are filled on the forward's hot path.
  c10::SmallVector<SlotMetadata, 4> metadata_;  // by slot
  c10::SmallVector<uint8_t, 8> counted_;        // by slot: its storage counts as recomputed bytes
  int64_t expected_bytes_ = 0;
  int64_t saved_input_bytes_ = 0;
  bool stop_at_last_slot_ = false;  // See Note [Early stop] in frame.cpp
  uint64_t last_pack_sequence_nr_ = 0;
  bool last_pack_was_output_ = false;    // the last save came after its op's kernel; Note [Early stop]
  int64_t last_node_input_elements_ = 0;  // the largest input the last saving node saved, in elements
  std::vector<std::weak_ptr<Frame>> nested_;  // checkpoints created inside the forward run
  // Forward only: storages that do not count (inputs) and storages counted,
  // pinned so that their addresses stay unique until the forward ends.
  ska::flat_hash_set<const c10::StorageImpl*> forward_uncounted_, forward_counted_;
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> forward_pins_;

  std::atomic<bool> bound_{false};  // the hot path's first read; see Note [Session binding]

  mutable std::mutex mu_;  // guards the fields below; never held while anything is recomputed
  c10::SmallVector<uint8_t, 8> alive_;  // by slot: autograd still holds it
  std::vector<std::pair<int64_t, std::shared_ptr<Recomputation>>> graph_tasks_;
  // torch.utils.checkpoint.GraphExecGroup objects (held, so that an address
  // is never reused for another group while keyed here) and their
  // recomputations; see Note [Recomputation keys].
  std::vector<std::pair<c10::SafePyObject, std::shared_ptr<Recomputation>>> groups_;
  std::shared_ptr<SessionEntry> registered_;
};

}  // namespace prefire::detail
