#pragma once

// What a recomputation must see exactly as forward saw it: generator states,
// autocast settings and the current CUDA device.
//
// Note [Restoring state for recompute]
// Captured when the checkpoint's forward starts (before the user's forward
// context), applied around every recomputation, and the caller's state is put
// back afterwards, on success and on exception. Generators are read and
// written under their own mutex. The CPU generator is process-wide: two threads
// recomputing random functions at once race on it as they would without
// prefire. Autocast settings are thread-local and need no lock; a
// recomputation under autocast counts as an autocast region (nesting), so the
// casts it caches are cleared when it ends, as at the end of forward's region.

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <optional>
#include <utility>
#include <vector>

namespace prefire::detail {

struct AutocastState {
  bool cpu_enabled = false;
  at::ScalarType cpu_dtype = at::kBFloat16;
  bool cuda_enabled = false;
  at::ScalarType cuda_dtype = at::kHalf;
  bool cache_enabled = true;

  static AutocastState current();
  void apply() const;
};

struct RngState {
  at::Tensor cpu;                                        // CPU generator state
  std::vector<std::pair<c10::Device, at::Tensor>> devices;  // per CUDA device of the inputs

  /// Captures the CPU generator and the generators of the devices of `inputs`.
  static RngState capture(const std::vector<at::Tensor>& inputs);
  /// Captures the same generators as `like`, as they are now.
  static RngState capture_like(const RngState& like);
  void apply() const;
};

struct CapturedState {
  std::optional<RngState> rng;  // empty without preserve_rng_state
  AutocastState autocast;
  std::optional<c10::Device> cuda_device;  // current CUDA device, when CUDA has devices

  static CapturedState capture(const std::vector<at::Tensor>& inputs, bool preserve_rng);
};

/// Applies a captured state for its lifetime and restores the caller's state
/// afterwards. Never throws from its destructor.
class StateRestoreGuard {
 public:
  explicit StateRestoreGuard(const CapturedState& state);
  ~StateRestoreGuard();
  StateRestoreGuard(const StateRestoreGuard&) = delete;
  StateRestoreGuard& operator=(const StateRestoreGuard&) = delete;

 private:
  void restore() noexcept;

  std::optional<RngState> saved_rng_;
  AutocastState saved_autocast_;
  std::optional<c10::Device> saved_device_;
  bool autocast_nested_ = false;  // entered an autocast region; leave it in restore()
};

}  // namespace prefire::detail
