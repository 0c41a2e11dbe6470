#pragma once

// A checkpoint frame: one call of prefire::checkpoint() and everything needed
// to recompute it. See Note [Frame lifetime] in frame.cpp.

#include <prefire/checkpoint.h>

#include "hook_stack.h"
#include "recomputation.h"
#include "state_capture.h"

#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <atomic>
#include <optional>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

namespace prefire::detail {

class Session;
class PrefireRun;

/// What the determinism check compares per saved tensor.
struct SlotMetadata {
  std::vector<int64_t> sizes;
  at::ScalarType dtype = at::kFloat;
  c10::Device device = c10::Device(c10::kCPU);
  std::optional<uint64_t> checksum;  // determinism_check = checksum only; not part of ==

  static SlotMetadata of(const at::Tensor& t);
  bool operator==(const SlotMetadata& other) const;
  bool operator!=(const SlotMetadata& other) const { return !(*this == other); }
  std::string to_string() const;
};

/// Whether recomputation runs on this thread, and whether into a session.
bool recomputing_on_this_thread();
bool scheduled_recompute_on_this_thread();

class Frame final : public HookContext, public std::enable_shared_from_this<Frame> {
 public:
  /// Captures RNG/autocast/device state and saves `inputs` through autograd
  /// (see Note [Save frame inputs through autograd] in frame.cpp). Must run
  /// before the frame is pushed, so that an enclosing context packs the inputs.
  Frame(CheckpointFn fn, const TensorList& inputs, const CheckpointOptions& options);
  ~Frame();

  // ---- forward: the thread running checkpoint(), frame on top of the stack ----
  std::unique_ptr<PackedTensor> pack(const at::Tensor& tensor) override;
  /// Freezes the slot count.
  void finish_forward();
  /// Number of tensors autograd saved inside the forward run.
  size_t num_slots() const { return num_slots_; }
  /// Bytes a recomputation of this frame holds; see Note [Counting recomputed bytes].
  int64_t expected_bytes() const { return expected_bytes_; }

  // ---- backward: any thread ----
  /// The recomputed tensor of `slot`: from the bound session, else from this
  /// graph task's recomputation, else (outside backward) from a private one.
  at::Tensor unpack(size_t slot);
  /// Autograd released the saved tensor of `slot`: never store it again.
  void release_slot(size_t slot) noexcept;

  // ---- sessions (see Note [Session binding] in session.h) ----
  /// Raises CheckpointError when the frame is registered to another session.
  void check_registrable_to(const Session& session) const;
  /// Registers the frame to `session`. False when it already was; raises
  /// like check_registrable_to.
  bool attach(Session& session);
  /// Unregisters from `session` and drops its recomputation (no-op otherwise).
  void detach(Session& session) noexcept;
  void bind(Session* session) noexcept { bound_.store(session, std::memory_order_release); }
  void unbind() noexcept { bound_.store(nullptr, std::memory_order_release); }
  /// Whether `session` holds a finished recomputation of this frame.
  bool resident_in(Session& session) const;
  /// Recomputes into the registered session now; false when already done.
  bool prefire();

  /// Called from the recomputation's pack hook: checks and stores the tensor
  /// recompute saved as slot `index`. Returns whether recomputation may stop.
  bool store_recomputed(Recomputation& r, size_t index, const at::Tensor& tensor);

 private:
  struct SessionEntry {
    Session* session = nullptr;
    std::shared_ptr<Recomputation> recomputation;
  };

  at::Tensor unpack_from_session(Session& session, size_t slot);
  std::shared_ptr<Recomputation> recomputation_for(int64_t graph_task);
  void drop(int64_t graph_task) noexcept;
  /// `session`: the session recomputed into, or -1. `run`: set for a prefire.
  void recompute(Recomputation& r, int64_t session, PrefireRun* run);
  TensorList recompute_inputs() const;
  at::Tensor take(Recomputation& r, size_t slot, bool retain, const Session* session);
  SessionEntry session_entry() const;

  const CheckpointFn fn_;
  const CheckpointOptions options_;
  const CapturedState state_;
  std::optional<c10::Device> prefire_device_;  // the first CUDA input's; see Note [Stream ordering of prefire]
  std::vector<torch::autograd::SavedVariable> saved_inputs_;
  std::vector<c10::VariableVersion> input_versions_;  // counters of the inputs, to detect in-place changes
  std::vector<uint32_t> input_saved_versions_;

  // Written by the forward thread before forward_done_, read-only after.
  std::atomic<bool> forward_done_{false};
  size_t num_slots_ = 0;
  std::vector<SlotMetadata> metadata_;  // by slot
  std::vector<uint8_t> counted_;        // by slot: its storage counts as recomputed bytes
  int64_t expected_bytes_ = 0;
  // Forward only: storages that do not count (inputs) and storages counted,
  // pinned so that their addresses stay unique until finish_forward().
  std::unordered_set<const c10::StorageImpl*> forward_uncounted_, forward_counted_;
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> forward_pins_;

  std::atomic<Session*> bound_{nullptr};  // the hot path's one read; see Note [Session binding]

  mutable std::mutex mu_;  // guards alive_, graph_tasks_, session_
  std::vector<uint8_t> alive_;  // by slot: autograd still holds it
  std::vector<std::pair<int64_t, std::shared_ptr<Recomputation>>> graph_tasks_;
  SessionEntry session_;
};

}  // namespace prefire::detail
