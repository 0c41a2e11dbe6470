#pragma once

// A checkpoint's inputs, kept for its recomputations. See Note [Save frame
// inputs through autograd] and Note [Recomputation inputs are forward's
// tensors] in checkpoint/frame_inputs.cpp.

#include <prefire/checkpoint.h>
#include <prefire/offload.h>

#include <c10/core/Device.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace prefire::detail {

class FrameInputs {
 public:
  /// Saves `inputs` through autograd: an enclosing hook context (the
  /// checkpoint this one is nested in) packs them. Made before the frame's
  /// own context is pushed.
  ///
  /// With `offload_to`, the inputs are packed into that tier instead (Note
  /// [Offloading only a checkpoint's inputs]), and unpack() reads them back.
  explicit FrameInputs(const TensorList& inputs, const std::shared_ptr<OffloadTier>& offload_to = nullptr);

  /// What a recomputation runs on: the saved inputs, unpacked. Raises
  /// CheckpointError when one was modified in place since forward.
  TensorList unpack() const;
  /// The device of the first CUDA input, if any: where a prefire runs.
  const std::optional<c10::Device>& cuda_device() const { return cuda_device_; }

 private:
  std::vector<torch::autograd::SavedVariable> saved_;
  std::vector<c10::VariableVersion> versions_;  // counters of the inputs, to detect in-place changes
  std::vector<uint32_t> saved_versions_;
  std::optional<c10::Device> cuda_device_;
};

}  // namespace prefire::detail
