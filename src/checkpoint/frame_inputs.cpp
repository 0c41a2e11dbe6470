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

#include "checkpoint/frame_inputs.h"

#include <prefire/errors.h>

#include <torch/csrc/autograd/variable.h>

#include <string>

namespace prefire::detail {

FrameInputs::FrameInputs(const TensorList& inputs) {
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
