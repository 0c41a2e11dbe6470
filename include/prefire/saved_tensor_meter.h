#pragma once

// Measures the memory autograd's saved tensors hold: the number the
// checkpoint trade-off is about.

#include <cstdint>
#include <memory>

namespace prefire {

namespace detail {
class MeterContext;
class HookContextScope;
}  // namespace detail

/// Counts the bytes of the tensors autograd saves on this thread while the
/// meter is active, outside any checkpoint. Inside a checkpoint the frame
/// receives the saves and drops them; the checkpoint's inputs are saved
/// through the meter and counted. Bytes are counted per storage (a storage
/// saved by several ops counts once) and stay counted until autograd releases
/// every saved tensor that uses it. Leaves that require grad (parameters, a
/// pipeline stage's input) and views of them live anyway and are not counted. The bytes also
/// count in RuntimeStats::held_bytes.
///
/// Saved tensors keep autograd's in-place check: unpacking one that was
/// modified in place after it was saved raises as it would without the meter.
///
/// Threads: the meter is active on the thread that constructed it, from
/// construction until stop() (or destruction), which must happen on that
/// thread, in any order with other meters and collectors. The counters can be
/// read from any thread, also after stop(), and backward on any thread
/// updates them.
class SavedTensorMeter {
 public:
  SavedTensorMeter();
  ~SavedTensorMeter();
  SavedTensorMeter(const SavedTensorMeter&) = delete;
  SavedTensorMeter& operator=(const SavedTensorMeter&) = delete;

  /// Stops receiving saves (idempotent). Tensors already saved stay counted
  /// until autograd releases them. Raises std::logic_error on another thread
  /// than the one that made the meter (destroying it there is a fatal misuse).
  void stop();

  int64_t current_bytes() const;  // bytes of storages held by saved tensors now
  int64_t peak_bytes() const;     // the largest current_bytes() seen
  int64_t saved_tensors() const;  // tensors saved through this meter in total

 private:
  std::shared_ptr<detail::MeterContext> context_;
  std::unique_ptr<detail::HookContextScope> scope_;  // set while active
};

}  // namespace prefire
