#pragma once

// The one error type prefire raises for contract violations a user can cause.
// Bad arguments raise std::invalid_argument (or c10::Error from TORCH_CHECK);
// broken internal invariants raise c10::Error from TORCH_INTERNAL_ASSERT.

#include <stdexcept>
#include <string>

namespace prefire {

/// A checkpoint's contract was violated: the engine is not installed, the
/// recomputation saved a different number of tensors or tensors of different
/// metadata than forward, a saved slot was unpacked twice in one backward, or
/// an input of the checkpoint was modified in place after forward. The message
/// names the slot or input, the value seen and what to do.
class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace prefire
