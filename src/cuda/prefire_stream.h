#pragma once

// Running a prefire on a device's prefire stream, and handing its tensors to
// the stream that consumes them.
//
// Note [Stream ordering of prefire]
// Rationale: a prefire should overlap with the caller's work (a pipeline
// receive, another micro-batch), so it runs on a stream of its own per device.
// prefire creates that stream (cudaStreamCreateWithPriority) instead of taking
// one from c10's pool: the pool hands its 32 streams per priority out round
// robin to everyone (NCCL process groups, other libraries), and a shared
// stream would queue recomputation behind their work.
// Approach, in order:
// (1) outside any allocator window: the prefire stream waits on an event
//     recorded on the caller's current stream (the inputs the caller
//     produced are ready), and the inputs are marked as used on the prefire
//     stream (recordStream), so their memory outlives the recomputation;
// (2) the window: with the session buffer pool on, allocations on the prefire
//     stream are routed to the pool (Note [Session buffer pool]); the window
//     is the recomputation itself (state restore, context hooks, fn), under a
//     stream guard on the prefire stream;
// (3) the window closes and a completion event is recorded on the prefire
//     stream and kept with the session's recomputation (with the pool lease);
// (4) every unpack makes the consuming stream (the current stream of the
//     unpacking thread) wait on that event and calls recordStream for the
//     handed-out storage on it, so the caching allocator never reuses the
//     memory before the consumer is done. recordStream inside another
//     thread's window would be booked as a capture use and later stripped, so
//     unpacks take the device's window lock around it.
// Before a thread's first window on a device it makes cuBLAS's and
// cuBLASLt's workspaces for the prefire stream: each library keeps one per
// (per-thread handle, stream), allocated on first use; made inside a window
// it would sit in the session pool for good. Once per thread: after torch
// drops the workspaces (torch._C._cuda_clearCublasWorkspaces(), which
// inductor's CUDA graph trees call), the next window makes them in the pool,
// where they stay until the next such clear.
// Limitations: one device per prefire (the device of the checkpoint's first
// CUDA input); with the pool on, prefires on one device run one at a time (a
// pool's routing cannot nest), and an unpack on another thread waits while a
// prefire's function runs (the window lock). Lazy recomputation inside
// backward stays on the backward's stream and uses none of this.
// What is ordered and what is not: (1) orders the prefire after everything
// the caller's stream did before prefire() was called, and (4) orders every
// consumer of a recomputed tensor after the recomputation. Nothing else is:
// side effects of the function on tensors other than its outputs (a
// BatchNorm's running statistics updated in place, a counter a block
// increments) happen on the prefire stream, and a later kernel on the main
// stream that reads or writes them is not ordered with it. torch's own
// checkpoint updates running statistics again in its recomputation too;
// prefire only moves that update to another stream. A block with such side
// effects should keep them out of the recomputation (context_fn's second
// context, the one around the recomputation, can switch them off), or not
// be prefired.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Storage.h>
#include <c10/core/Stream.h>

#include <memory>
#include <optional>
#include <vector>

namespace prefire::detail {

/// When a prefire's tensors are ready.
class ReadyEvent {
 public:
  virtual ~ReadyEvent() = default;
  /// Makes the current stream of `t`'s device wait for the prefire and marks
  /// `t`'s storage as used on that stream.
  virtual void hand_over(const at::Tensor& t) = 0;
};

/// Marks `storage` (on a CUDA device) as used on `stream`, so that the
/// caching allocator reuses its memory only once the work queued there so far
/// is done (recordStream), outside other threads' allocator windows (step 4
/// of the Note). CUDA builds only.
void record_stream_use(const c10::Storage& storage, const c10::Stream& stream);

/// Whether this thread runs a prefire on `device` now (inside its window,
/// where a recordStream is not kept past the window's end). False in a build
/// without CUDA.
bool prefire_running_here(c10::DeviceIndex device);

/// One prefire on `device`'s prefire stream, for the lifetime of the object.
/// A no-op for std::nullopt, a CPU device, or a build without CUDA.
class PrefireRun {
 public:
  /// Steps (1) and (2) of the Note: orders the prefire stream after the
  /// caller's, marks `inputs` as used there, opens the window.
  PrefireRun(std::optional<c10::Device> device, const std::vector<at::Tensor>& inputs);
  ~PrefireRun();
  PrefireRun(const PrefireRun&) = delete;
  PrefireRun& operator=(const PrefireRun&) = delete;

  /// Whether the run is on a CUDA prefire stream.
  bool on_device() const { return impl_ != nullptr; }
  /// Whether its allocations go to the session buffer pool.
  bool in_pool() const;
  /// Step (3): closes the window and records the completion event; nullptr
  /// when not on a device.
  std::shared_ptr<ReadyEvent> finish();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace prefire::detail
