#include <prefire/checkpoint.h>
#include <prefire/errors.h>
#include <prefire/install.h>

#include "checkpoint/frame.h"
#include "checkpoint/handle_collector.h"
#include "checkpoint/recompute.h"
#include "hooks/autograd_engine.h"
#include "hooks/thread_state.h"
#include "profiling/nvtx.h"

#include <c10/core/GradMode.h>

#include <stdexcept>

namespace prefire {

DeterminismCheck parse_determinism_check(const std::string& name) {
  if (name == "none") return DeterminismCheck::kNone;
  if (name == "metadata") return DeterminismCheck::kMetadata;
  if (name == "checksum") return DeterminismCheck::kChecksum;
  throw std::invalid_argument("prefire: determinism_check must be \"none\", \"metadata\" or \"checksum\", got \"" +
                              name + "\"");
}

const char* to_string(DeterminismCheck check) {
  switch (check) {
    case DeterminismCheck::kNone:
      return "none";
    case DeterminismCheck::kMetadata:
      return "metadata";
    case DeterminismCheck::kChecksum:
      return "checksum";
  }
  return "invalid";
}

namespace {

void validate(const CheckpointFn& fn, const CheckpointOptions& options) {
  if (!fn) throw std::invalid_argument("prefire::checkpoint: fn is empty; pass the function to checkpoint");
  switch (options.determinism_check) {
    case DeterminismCheck::kNone:
    case DeterminismCheck::kMetadata:
    case DeterminismCheck::kChecksum:
      break;
    default:
      throw std::invalid_argument("prefire::checkpoint: options.determinism_check has the invalid value " +
                                  std::to_string(static_cast<int>(options.determinism_check)) +
                                  "; use DeterminismCheck::kNone, kMetadata or kChecksum");
  }
  if (options.offload_inputs_only && !options.offload_to) {
    throw std::invalid_argument("prefire::checkpoint: options.offload_inputs_only needs options.offload_to, the "
                                "tier to offload the inputs to");
  }
  if (!is_installed()) {
    throw CheckpointError(
        "prefire::checkpoint: prefire's autograd engine is not the default engine. Call prefire::install() "
        "once at start-up, before the first backward (inside a Python process the C++ engine cannot be "
        "installed: import the prefire Python package instead)");
  }
}

}  // namespace

TensorList checkpoint(const CheckpointFn& fn, const TensorList& inputs, const CheckpointOptions& options) {
  validate(fn, options);
  if (!c10::GradMode::is_enabled()) return fn(inputs);
  // Inside a recomputation a checkpoint belongs to the recomputation's own
  // graph (a nested checkpoint being recomputed), not to the user's forward;
  // so does one created inside a backward (another library's recomputation,
  // e.g. torch.utils.checkpoint's around this one, run by a session's pass).
  if (detail::this_thread().session_scope != nullptr && !detail::recomputing_on_this_thread() &&
      detail::current_graph_task_id() < 0) {
    throw CheckpointError(
        "prefire::checkpoint: a checkpoint was created while a SessionScope is open on this thread; a session "
        "scope is for the backward passes of checkpoints made before it. Run this forward outside the "
        "SessionScope");
  }

  PREFIRE_NVTX_RANGE("prefire::checkpoint", -1);
  auto frame = std::make_shared<detail::Frame>(fn, inputs, options);
  auto [outputs, nested] = frame->forward(inputs);
  // A frame that saved nothing is owned by nothing and goes away here. A
  // nested one is scheduled with its outermost checkpoint; see Note [Nested
  // checkpoints in sessions] in session/prefire.cpp.
  if (frame->num_slots() > 0 && !nested && !detail::recomputing_on_this_thread()) detail::collect(frame);
  return outputs;
}

}  // namespace prefire
