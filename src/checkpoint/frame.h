#pragma once

// A checkpoint frame: one call of prefire::checkpoint(). Its forward runs the
// function and packs every tensor autograd saves into a slot (SlotTable);
// its unpacks find the recomputation that serves them (Note [Recomputation
// keys]) and have the recompute driver (checkpoint/recompute.h) fill it from
// what forward produced. See Note [Frame lifetime] in checkpoint/frame.cpp.

#include <prefire/checkpoint.h>
#include <prefire/observer.h>

#include "checkpoint/frame_inputs.h"
#include "checkpoint/offloaded_slots.h"
#include "checkpoint/recompute.h"
#include "checkpoint/recomputation.h"
#include "checkpoint/registration.h"
#include "checkpoint/slots.h"
#include "checkpoint/state_capture.h"
#include "hooks/hook_stack.h"
#include "memory/storage_census.h"

#include <c10/core/SafePyObject.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/flat_hash_map.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

namespace prefire::detail {

class Frame final : public HookContext, public std::enable_shared_from_this<Frame> {
 public:
  /// Captures RNG/autocast/device/thread state and saves `inputs` through
  /// autograd (see Note [Save frame inputs through autograd] in
  /// frame_inputs.cpp). Must run before the frame is pushed, so that an
  /// enclosing context packs the inputs.
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
  /// Bytes a recomputation of this frame holds; see Note [Counting saved bytes].
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
  /// Autograd released the saved tensor of `slot`: no recomputation keeps it.
  void release(size_t slot) noexcept;

  // ---- sessions: called by the session layer (see Note [Session binding] in session/session.h) ----
  /// Registers the frame to `session` with a new, empty registration, or
  /// returns the one it has there (second: whether it is new). Raises
  /// CheckpointError when the frame is registered to another session.
  std::pair<std::shared_ptr<Registration>, bool> register_to(const std::shared_ptr<SessionCore>& session);
  /// Drops the registration to `session` (no-op when registered elsewhere or
  /// nowhere). An unpack that already holds the registration finishes with it.
  void unregister(const SessionCore& session) noexcept;
  /// Whether unpacks are served from the registered session (a scope of it is open).
  void bind(bool bound) noexcept;
  /// A pass of `session` with retain_on_unpack=false ended: drops what it
  /// handed out (no-op when registered elsewhere or nowhere).
  void end_pass(const SessionCore& session) noexcept;
  /// The retaining pass of `session` that opens now keeps only the slots
  /// `keep` marks past their unpack; see Note [A pass lets go of what the
  /// next pass will not read] in session/keep_only.cpp.
  void keep_past_unpack(const SessionCore& session, std::vector<bool> keep);
  /// That pass ended: drops what it kept of the slots `keep` left out.
  void end_keeping_pass(const SessionCore& session) noexcept;
  /// Its registration to `session`, or nullptr when registered elsewhere or nowhere.
  std::shared_ptr<Registration> registration_in(const SessionCore& session) const;
  /// Recomputes into `registration` now, as a prefire, unless it is done;
  /// returns whether this call recomputed.
  bool prefire(Registration& registration);

  /// An offloaded frame, inside a backward on this thread, not registered to a
  /// session: queues its fetch for this backward's graph task now (prefire::fetch_ahead).
  bool fetch_ahead();

 private:
  /// What the recompute driver reads of this frame.
  RecomputeSource source() const { return {fn_, options_, state_, inputs_, slots_, offloaded_.get()}; }
  /// The recomputation of every slot, once forward is done.
  Extent full_extent() const { return {num_slots_, stop_at_last_slot_}; }
  /// How a session serves an unpack (key 1 of Note [Recomputation keys]).
  struct Serving {
    std::shared_ptr<Registration> registration;
    bool retain = false;
    bool let_go = false;  // retain, but not this slot: the next pass will not read it
    bool for_nested_prefire = false;  // see Note [A nested prefire takes its inputs on the prefire stream]
  };
  /// The session that serves an unpack of `slot` on this thread, if any.
  std::optional<Serving> session_for_unpack(size_t slot) const;
  /// An unpack while forward still runs; see Note [Backward inside the checkpointed function].
  at::Tensor unpack_in_forward(size_t slot);
  at::Tensor unpack_by_graph_task(size_t slot, const Extent& extent);
  /// recompute_once() of a lazy recomputation outside sessions, telling the observer.
  void compute_lazily(Recomputation& r, const Extent& extent);
  std::shared_ptr<Recomputation> recomputation_for(int64_t graph_task);
  std::shared_ptr<Recomputation> recomputation_for(const c10::SafePyObject& group);
  /// The graph task ended: drops its recomputation.
  void drop_graph_task(int64_t graph_task) noexcept;
  /// `let_go`: a session's retaining pass hands `slot` out for the last
  /// time (Recomputation::take_and_trim), whatever `retain` says.
  at::Tensor take(Recomputation& r, size_t slot, bool retain, std::optional<SessionId> session,
                  bool in_group = false, bool hand_over = true, bool let_go = false);

  const CheckpointFn fn_;
  const CheckpointOptions options_;
  CapturedState state_;  // its generator snapshot may be dropped after forward; read-only after
  const FrameInputs inputs_;
  SlotTable slots_;
  const std::unique_ptr<OffloadedSlots> offloaded_;  // set when offloaded; see Note [Offloading a checkpoint]

  // Written by the forward thread before forward_done_, read-only after.
  std::atomic<bool> forward_done_{false};
  size_t num_slots_ = 0;
  int64_t expected_bytes_ = 0;
  int64_t saved_input_bytes_ = 0;
  bool stop_at_last_slot_ = false;  // See Note [Early stop] in checkpoint/frame.cpp
  uint64_t last_pack_sequence_nr_ = 0;
  bool last_pack_was_output_ = false;    // the last save came after its op's kernel; Note [Early stop]
  int64_t last_node_input_elements_ = 0;  // the largest input the last saving node saved, in elements
  std::vector<std::weak_ptr<Frame>> nested_;  // checkpoints created inside the forward run
  // Forward only: storages that do not count (inputs), storages counted
  // (Note [Counting saved bytes]), pinned so that their addresses stay
  // unique until the forward ends.
  ska::flat_hash_set<const c10::StorageImpl*> forward_uncounted_;
  StorageCensus forward_census_;
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> forward_pins_;

  std::atomic<bool> bound_{false};  // the hot path's first read; see Note [Session binding]

  mutable std::mutex mu_;  // guards the fields below; never held while anything is recomputed
  std::vector<std::pair<int64_t, std::shared_ptr<Recomputation>>> graph_tasks_;
  // torch.utils.checkpoint.GraphExecGroup objects (held, so that an address
  // is never reused for another group while keyed here) and their
  // recomputations; see Note [Recomputation keys].
  std::vector<std::pair<c10::SafePyObject, std::shared_ptr<Recomputation>>> groups_;
  std::shared_ptr<Registration> registered_;
};

}  // namespace prefire::detail
