#pragma once

#include <cstdint>

namespace prefire {

/// Process-wide counters of prefire's recomputations, for programs and
/// benchmarks that show what checkpointing costs.
struct RuntimeStats {
  int64_t recomputations = 0;         // count: recomputations of a checkpoint, any key, since start
  int64_t offload_fetches = 0;        // count: fetches of an offloaded checkpoint's saved tensors, any key
  int64_t unshared_recomputations = 0;  // count: recomputations and fetches no session kept (per backward graph task)
  int64_t wasted_prefires = 0;        // count: prefired checkpoints released before any pass used them
  int64_t recomputed_bytes = 0;       // bytes: storages prefire holds now for recomputed tensors
  int64_t peak_recomputed_bytes = 0;  // bytes: largest recomputed_bytes since start or reset_runtime_peak()
  int64_t held_bytes = 0;             // bytes: recomputed_bytes plus what active SavedTensorMeters count
  int64_t peak_held_bytes = 0;        // bytes: largest held_bytes since start or reset_runtime_peak()
};

/// A consistent snapshot; any thread.
RuntimeStats runtime_stats();
/// Starts new peak windows at the current values.
void reset_runtime_peak();

}  // namespace prefire
