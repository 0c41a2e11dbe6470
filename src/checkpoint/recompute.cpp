// Note [Aliases of recomputed tensors]
// Autograd hands a pack hook the saved tensor itself, which may carry the
// throw-away graph's grad_fn (an output saved by its own op); kept as it is,
// the slot would hold that graph and the graph itself. So the recomputation
// keeps an alias without autograd metadata: tensor_data(), which shares
// storage, metadata and version counter, as detach() does, but is a plain
// shallow copy rather than an op through the dispatcher (callgrind: ~1,100
// instructions fewer each, five per call of a four-slot checkpoint). What
// autograd later hands to backward is its own variable over that alias
// (SavedVariable::unpack), so the alias is never seen by user code. A saved
// tensor that needs no gradient and has no history (an input or a constant
// that does not require grad) has no graph to drop: the slot keeps the tensor
// itself, so backward unpacks the object forward saved, as torch's
// checkpoint does.

#include "checkpoint/recompute.h"

#include <prefire/errors.h>

#include "checkpoint/checksum.h"
#include "checkpoint/observer.h"
#include "cuda/prefire_stream.h"
#include "hooks/hook_stack.h"
#include "hooks/thread_state.h"
#include "profiling/nvtx.h"

#include <c10/core/GradMode.h>
#include <c10/util/StringUtil.h>

#include <chrono>
#include <mutex>

namespace prefire::detail {
namespace {

// Whether a tensor a recomputation saves carries autograd state its slot must
// not keep; see Note [Aliases of recomputed tensors].
bool needs_alias(const at::Tensor& t) { return t.requires_grad(); }

// The context on top of the stack while a checkpoint recomputes: checks each
// saved tensor against forward's slot and stores it.
class RecomputeCapture final : public HookContext {
 public:
  RecomputeCapture(const RecomputeSource& source, Recomputation& r, const Extent& extent)
      : source_(source), r_(r), extent_(extent) {}

  std::unique_ptr<PackedTensor> pack(const at::Tensor& tensor) override {
    // One alias for the slot and for the throw-away graph; see Note [Aliases of recomputed tensors].
    at::Tensor detached = needs_alias(tensor) ? tensor.tensor_data() : tensor;
    if (store(count_++, detached)) {
      stopped_ = true;
      throw StopRecompute{};
    }
    return std::make_unique<KeptTensor>(std::move(detached));
  }

  size_t count() const { return count_; }
  bool stopped() const { return stopped_; }

 private:
  // Checks and stores the tensor the recomputation saved as slot `index`;
  // returns whether the recomputation may stop.
  bool store(size_t index, const at::Tensor& tensor);

  const RecomputeSource& source_;
  Recomputation& r_;
  const Extent extent_;
  size_t count_ = 0;
  bool stopped_ = false;
};

bool RecomputeCapture::store(size_t index, const at::Tensor& tensor) {
  const CheckpointOptions& options = source_.options;
  const bool check = options.determinism_check != DeterminismCheck::kNone;
  if (index >= extent_.slots) {
    if (options.early_stop) return true;  // See Note [Early stop]: nothing after forward's count is unpacked
    if (check) {
      throw CheckpointError(c10::str(
          "prefire::checkpoint: the recomputation saved more tensors than forward did (forward saved ",
          extent_.slots, "; recompute is saving tensor ", index + 1,
          "): the checkpointed function does not do the same work when called again"));
    }
    return false;  // nothing to store it as
  }
  const SlotTable& slots = source_.slots;
  if (check) {
    const SlotMetadata& forward = slots.metadata(index);
    if (!forward.matches(tensor)) {
      throw CheckpointError(c10::str(
          "prefire::checkpoint: saved tensor ", index, " (slot ", index, " of ", extent_.slots,
          ") differs between forward and recomputation: forward ", forward.to_string(), ", recompute ",
          SlotMetadata::of(tensor).to_string(),
          ". The checkpointed function is not deterministic in its shapes, dtypes or devices; make it so, "
          "or turn the check off (determinism_check=\"none\"; C++: DeterminismCheck::kNone)"));
    }
    if (forward.checksum) {
      const uint64_t recomputed_sum = tensor_checksum(tensor);
      if (recomputed_sum != *forward.checksum) {
        throw CheckpointError(c10::str(
            "prefire::checkpoint: saved tensor ", index, " (slot ", index, " of ", extent_.slots,
            ") has other values in the recomputation than in forward: checksum 0x", std::hex, *forward.checksum,
            " at forward, 0x", recomputed_sum, std::dec, " at recompute, ", forward.to_string(),
            ". The function draws random numbers without preserve_rng_state, reads state that changed since "
            "forward, or is not deterministic"));
      }
    }
  }
  if (slots.alive(index)) {
    r_.store(index, tensor, slots.counted(index));
    // The saved tensor may have gone meanwhile; Frame::release() dropped
    // before the store, or drops after this check.
    if (!slots.alive(index)) r_.drop(index);
  }
  return extent_.stop_at_last && index + 1 == extent_.slots;
}

// Marks this thread as recomputing. Checkpoints created inside a
// recomputation are nested in nothing: they belong to the recomputation's
// throw-away graph, not to a forward.
class RecomputingGuard {
 public:
  RecomputingGuard() : forward_(this_thread().forward, nullptr) { ++this_thread().recompute_depth; }
  ~RecomputingGuard() { --this_thread().recompute_depth; }
  RecomputingGuard(const RecomputingGuard&) = delete;
  RecomputingGuard& operator=(const RecomputingGuard&) = delete;

 private:
  ThreadStateGuard<Frame*> forward_;
};

RecomputeEvent recompute(const RecomputeSource& source, Recomputation& r, RecomputeEvent::Kind kind,
                         std::optional<SessionId> session, const Extent& extent) {
  const bool prefiring = kind == RecomputeEvent::Kind::kPrefire;
  PREFIRE_NVTX_RANGE(prefiring ? "prefire::recompute(prefire)" : "prefire::recompute(lazy)", session.value_or(-1));
  const auto begin = std::chrono::steady_clock::now();
  r.reset(extent.slots);
  RecomputeCapture capture(source, r, extent);
  {
    RecomputingGuard recomputing;
    TensorList args = source.inputs.unpack();
    // A prefire runs on the device's prefire stream; see Note [Stream ordering of prefire].
    std::optional<PrefireRun> run;
    if (prefiring) {
      run.emplace(source.inputs.cuda_device(), args);
      if (run->in_pool()) r.count_in_pool();
    }
    {
      StateRestoreGuard state(source.state);  // See Note [Restoring state for recompute]
      c10::AutoGradMode grad_mode(true);
      ContextGuard user = source.options.context_fn.recompute ? source.options.context_fn.recompute() : nullptr;
      HookContextScope scope(&capture);
      try {
        source.fn(args);
      } catch (const StopRecompute&) {
      }
    }
    if (run) r.set_ready(run->finish());
  }
  count_recomputation(session.has_value());
  if (!capture.stopped() && capture.count() < extent.slots &&
      source.options.determinism_check != DeterminismCheck::kNone) {
    throw CheckpointError(c10::str(
        "prefire::checkpoint: the recomputation saved fewer tensors than forward did (forward saved ",
        extent.slots, ", recompute ", capture.count(),
        "): the checkpointed function does not do the same work when called again"));
  }
  return RecomputeEvent{kind, session.value_or(-1), begin, std::chrono::steady_clock::now()};
}

// See Note [Offloading a checkpoint] in checkpoint/offloaded_slots.cpp.
RecomputeEvent fetch(const RecomputeSource& source, Recomputation& r, RecomputeEvent::Kind kind,
                     std::optional<SessionId> session, const Extent& extent) {
  const bool prefetch = kind == RecomputeEvent::Kind::kPrefire;
  PREFIRE_NVTX_RANGE(prefetch ? "prefire::fetch(prefetch)" : "prefire::fetch(lazy)", session.value_or(-1));
  const auto begin = std::chrono::steady_clock::now();
  source.offloaded->fetch(r, source.slots, extent.slots, prefetch);
  count_offload_fetch(session.has_value());
  return RecomputeEvent{kind, session.value_or(-1), begin, std::chrono::steady_clock::now()};
}

}  // namespace

bool recomputing_on_this_thread() { return this_thread().recompute_depth > 0; }

std::optional<RecomputeEvent> recompute_once(const RecomputeSource& source, Recomputation& r,
                                             RecomputeEvent::Kind kind, std::optional<SessionId> session,
                                             const Extent& extent) {
  if (r.done()) return std::nullopt;
  std::optional<RecomputeEvent> event;
  if (source.offloaded) {
    r.ensure([&] { event = fetch(source, r, kind, session, extent); });
    return event;
  }
  // Taken before the single flight is claimed; see Note [Recomputations that
  // restore generators] in checkpoint/state_capture.h.
  std::unique_lock<std::recursive_mutex> generators;
  if (source.state.rng) generators = lock_generators();
  r.ensure([&] { event = recompute(source, r, kind, session, extent); });
  return event;
}

}  // namespace prefire::detail
