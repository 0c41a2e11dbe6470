// Note [Save frame inputs through autograd]
// The frame needs its inputs to recompute. Held as plain tensors, a checkpoint
// nested in another would keep the outer's intermediates alive and the outer
// would save nothing. Held as SavedVariables made while the enclosing context
// is on top of the stack, they are packed like any other saved tensor: an
// enclosing frame drops them and gives them back when recomputed. A top-level
// frame's SavedVariables simply hold the inputs. In-place changes are caught
// through the inputs' version counters, kept separately so the check works in
// both cases and raises CheckpointError rather than autograd's generic error.
//
// Note [Recomputation inputs are forward's tensors]
// The recomputation runs `fn` on exactly what its saved inputs unpack to: for
// a top-level checkpoint the very tensors forward received (same
// TensorImpl, so in Python the same object: its subclass type, its Python
// attributes, a DTensor's placements), for a nested one the tensors its
// parent's recomputation saved. Not aliases: a function whose behaviour
// depends on its input's type (a __torch_function__ subclass) would compute
// something else on a plain alias, and the metadata check cannot see it
// (shapes agree). The recomputation's ops thereby add nodes that point into
// forward's graph; nothing runs them, and they go with the recomputation's
// throw-away graph. torch.utils.checkpoint recomputes from its saved inputs
// the same way.

//
// Note [Offloading only a checkpoint's inputs]
// With CheckpointOptions::offload_inputs_only, a checkpoint recomputes what it
// saves, as any does, and offloads what a checkpoint otherwise keeps: its
// inputs (in a chain of checkpointed blocks, each block's input is the only
// activation held between forward and backward; transformers' offload option
// moves the same tensors). The inputs are saved through autograd as always,
// with a context of their own on top of the hook stack, which packs each into
// the tier (a parameter, which stays in memory anyway, by reference) and
// unpacks it by reading it back on the unpacking thread: a recomputation, lazy
// or prefired, reads its inputs first. What cannot be offloaded fails the
// forward, before anything is dropped. In-place changes are still caught by the
// version counters below. The context replaces the enclosing checkpoint's for
// these saves: an offloaded input is not also dropped by an enclosing
// checkpoint (it holds no memory there either).

#include "checkpoint/frame_inputs.h"

#include <prefire/errors.h>

#include "hooks/hook_stack.h"
#include "memory/storage_census.h"
#include "offload/tier_store.h"
#include "offload/view_geometry.h"

#include <c10/util/StringUtil.h>
#include <torch/csrc/autograd/variable.h>

#include <optional>
#include <string>

namespace prefire::detail {
namespace {

class OffloadedInput final : public PackedTensor {
 public:
  OffloadedInput(std::shared_ptr<OffloadTier> tier, StorageCopy copy, ViewGeometry view)
      : tier_(std::move(tier)), copy_(std::move(copy)), view_(std::move(view)) {}
  at::Tensor unpack() override { return view_.over(TierAccess::store(*tier_).read_now(copy_)); }

 private:
  std::shared_ptr<OffloadTier> tier_;
  StorageCopy copy_;
  ViewGeometry view_;
};

// See Note [Offloading only a checkpoint's inputs].
class InputOffload final : public HookContext {
 public:
  explicit InputOffload(std::shared_ptr<OffloadTier> tier) : tier_(std::move(tier)) {}

  std::unique_ptr<PackedTensor> pack(const at::Tensor& tensor) override {
    const size_t index = count_++;
    if (tensor.has_storage() && !is_activation(tensor)) {
      // a parameter: what a recomputation would find again
      return std::make_unique<KeptTensor>(tensor.requires_grad() ? tensor.tensor_data() : tensor);
    }
    if (const char* why = TierAccess::store(*tier_).refuses(tensor)) {
      throw CheckpointError(c10::str("prefire: input ", index, " of a checkpoint that offloads its inputs cannot go "
                                     "to its tier: ", why, ". Recompute this block without offloading"));
    }
    return std::make_unique<OffloadedInput>(
        tier_, TierAccess::store(*tier_).copy_in(tensor, c10::str("input ", index, " of a checkpoint")),
        ViewGeometry::of(tensor));
  }

 private:
  std::shared_ptr<OffloadTier> tier_;
  size_t count_ = 0;
};

}  // namespace

FrameInputs::FrameInputs(const TensorList& inputs, const std::shared_ptr<OffloadTier>& offload_to) {
  std::optional<InputOffload> offload;
  std::optional<HookContextScope> scope;
  if (offload_to) {
    offload.emplace(offload_to);
    scope.emplace(&*offload);
  }
  saved_.reserve(inputs.size());
  versions_.reserve(inputs.size());
  saved_versions_.reserve(inputs.size());
  for (const auto& input : inputs) {
    saved_.emplace_back(input, /*is_output=*/false);
    if (input.defined() && input.is_cuda() && !cuda_device_) cuda_device_ = input.device();
    if (input.defined()) {
      versions_.push_back(torch::autograd::impl::version_counter(input));
      saved_versions_.push_back(input._version());
    } else {
      versions_.emplace_back();
      saved_versions_.push_back(0);
    }
  }
}

TensorList FrameInputs::unpack() const {
  TensorList args;
  args.reserve(saved_.size());
  for (size_t i = 0; i < saved_.size(); ++i) {
    const auto& counter = versions_[i];
    if (counter.enabled() && counter.current_version() != saved_versions_[i]) {
      throw CheckpointError(
          "prefire::checkpoint: input " + std::to_string(i) + " of a checkpoint was modified in place after the "
          "checkpoint's forward (version " + std::to_string(saved_versions_[i]) + " at forward, " +
          std::to_string(counter.current_version()) + " now); recomputing from it would give wrong gradients. "
          "Modify a clone instead, or modify it only after backward");
    }
    args.push_back(saved_[i].unpack());  // See Note [Recomputation inputs are forward's tensors].
  }
  return args;
}

}  // namespace prefire::detail
