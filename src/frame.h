#pragma once

// A checkpoint frame: one call of prefire::checkpoint() and everything needed
// to recompute it. See Note [Frame lifetime] in frame.cpp.

#include <prefire/checkpoint.h>

#include "hook_stack.h"
#include "state_capture.h"

#include <torch/csrc/autograd/saved_variable.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace prefire::detail {

/// What the determinism check compares per saved tensor.
struct SlotMetadata {
  std::vector<int64_t> sizes;
  at::ScalarType dtype = at::kFloat;
  c10::Device device = c10::Device(c10::kCPU);

  static SlotMetadata of(const at::Tensor& t);
  bool operator==(const SlotMetadata& other) const;
  bool operator!=(const SlotMetadata& other) const { return !(*this == other); }
  std::string to_string() const;
};

/// Which recomputation an unpack is served from: the backward graph task
/// running it. (A private key, for an unpack outside backward, is never
/// stored.)
struct RecomputeKey {
  int64_t graph_task_id = -1;
  bool operator==(const RecomputeKey& other) const { return graph_task_id == other.graph_task_id; }
};

struct Recomputation;

class Frame final : public HookContext, public std::enable_shared_from_this<Frame> {
 public:
  /// Captures RNG/autocast/device state and saves `inputs` through autograd
  /// (see Note [Save frame inputs through autograd] in frame.cpp). Must run
  /// before the frame is pushed, so that an enclosing context packs the inputs.
  Frame(CheckpointFn fn, const TensorList& inputs, const CheckpointOptions& options);
  ~Frame();

  // ---- forward: the thread running checkpoint(), frame on top of the stack ----
  std::unique_ptr<PackedTensor> pack(const at::Tensor& tensor) override;
  /// Freezes the slot count; saves after this are a bug.
  void finish_forward();
  /// Number of tensors autograd saved inside the forward run.
  size_t num_slots() const { return num_slots_; }

  // ---- backward: any thread ----
  /// The recomputed tensor of `slot` for the current key; recomputes first if
  /// this key has not yet.
  at::Tensor unpack(size_t slot);
  /// Autograd released the saved tensor of `slot`: never store it again.
  void release_slot(size_t slot) noexcept;

  /// Called from the recomputation's pack hook: checks and stores the tensor
  /// recompute saved as slot `index`. Returns whether recomputation may stop.
  bool store_recomputed(Recomputation& r, size_t index, const at::Tensor& tensor);

 private:
  std::shared_ptr<Recomputation> recomputation_for(RecomputeKey key);
  void drop(RecomputeKey key) noexcept;
  void recompute(Recomputation& r);
  TensorList recompute_inputs() const;
  at::Tensor take(Recomputation& r, size_t slot, const char* where);

  const CheckpointFn fn_;
  const CheckpointOptions options_;
  const CapturedState state_;
  std::vector<torch::autograd::SavedVariable> saved_inputs_;
  std::vector<c10::VariableVersion> input_versions_;  // counters of the inputs, to detect in-place changes
  std::vector<uint32_t> input_saved_versions_;

  std::atomic<bool> forward_done_{false};
  size_t num_slots_ = 0;                // valid once forward_done_
  std::vector<SlotMetadata> metadata_;  // by slot, written in forward only

  mutable std::mutex mu_;                // guards alive_ and recomputations_
  std::vector<uint8_t> alive_;           // by slot: autograd still holds it
  std::vector<std::pair<RecomputeKey, std::shared_ptr<Recomputation>>> recomputations_;
};

}  // namespace prefire::detail
