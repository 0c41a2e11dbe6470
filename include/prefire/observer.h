#pragma once

// A programmatic view of recomputations, for schedule traces and tests
// (Nsight users get the same events as NVTX ranges).

#include <chrono>
#include <cstdint>
#include <functional>

namespace prefire {

struct RecomputeEvent {
  enum class Kind {
    kLazy,     ///< inside backward, on first need (graph-task or session key)
    kPrefire,  ///< by prefire(), ahead of backward
  };
  Kind kind;
  int64_t session;  ///< the session recomputed into, or -1 (graph-task or private key)
  std::chrono::steady_clock::time_point begin, end;  ///< host time around the recomputation
};

using RecomputeObserver = std::function<void(const RecomputeEvent&)>;

/// Calls `observer` after every successful recomputation, on the thread that
/// ran it (an autograd worker thread for lazy recomputation on CUDA). An empty
/// function removes it. The observer must be thread-safe and must not throw.
/// With CUDA, `begin`/`end` bound the host side: kernels may still run.
void set_recompute_observer(RecomputeObserver observer);

}  // namespace prefire
