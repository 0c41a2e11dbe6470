#pragma once

// Running a prefire on a device's dedicated stream, and handing its tensors
// to the stream that consumes them.
//
// Note [Stream ordering of prefire]
// Rationale: a prefire should overlap with the caller's work (a pipeline
// receive, another micro-batch), so it runs on a stream of its own per device,
// taken once from the c10 stream pool.
// Approach: (1) the prefire stream waits on an event recorded on the caller's
// current stream, so the inputs the caller produced are ready; (2) the
// recomputation runs under a stream guard on the prefire stream, its
// allocations routed to the session buffer pool (see Note [Session buffer
// pool] in session_pool.h); (3) a completion event is recorded and kept with
// the session's recomputation; (4) every unpack makes the consuming stream
// (the backward's current stream on that thread) wait on that event and calls
// recordStream for the handed-out storage on the consuming stream, so the
// caching allocator never reuses it before the consumer is done.
// Limitations: one device per prefire (the device of the checkpoint's first
// CUDA input); prefires on one device are serialized on the host (the pool
// routing of the caching allocator cannot nest). Lazy recomputation inside
// backward stays on the backward's stream and uses none of this.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <memory>
#include <optional>

namespace prefire::detail {

/// When a prefire's tensors are ready.
class ReadyEvent {
 public:
  virtual ~ReadyEvent() = default;
  /// Makes the current stream of `t`'s device wait for the prefire and marks
  /// `t`'s storage as used on that stream.
  virtual void hand_over(const at::Tensor& t) = 0;
};

/// One prefire on `device`'s prefire stream, for the lifetime of the object.
/// A no-op for std::nullopt, a CPU device, or a build without CUDA.
class PrefireRun {
 public:
  explicit PrefireRun(std::optional<c10::Device> device);
  ~PrefireRun();
  PrefireRun(const PrefireRun&) = delete;
  PrefireRun& operator=(const PrefireRun&) = delete;

  /// Whether the run is on a CUDA prefire stream.
  bool on_device() const { return impl_ != nullptr; }
  /// Marks `t` (a recomputation input) as used by the prefire stream.
  void use(const at::Tensor& t);
  /// Records the completion event; nullptr when not on a device.
  std::shared_ptr<ReadyEvent> finish();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace prefire::detail
