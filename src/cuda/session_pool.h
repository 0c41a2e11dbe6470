#pragma once

// Note [Session buffer pool]
// Rationale: tensors a prefire creates live from the prefire until their
// unpack in backward, across other work of the step. A private pool of the
// caching allocator keeps them apart from the rest of the step's memory, so
// that they cannot fragment it. Prefire's allocations are per stream in the
// caching allocator anyway (a block freed on the prefire stream is reused
// only by that stream), so whether a private pool buys anything beyond that is
// measured (docs/benchmarks.md, prefire-bench --device cuda --session-pool),
// and the pool is an option, off by default.
// Approach: one private pool per device (an id from graph_pool_handle()).
// A prefire routes allocations there with beginAllocateToPool(device, pool,
// filter), the filter matching the prefire stream only, and ends the routing
// as soon as the recomputation's function returns (Note [Stream ordering of
// prefire] says what happens outside that window). Prefire holds one
// reference on the pool (createOrIncrefPool) while anything uses it: a
// prefire running, or a session's recomputation that was prefired into it
// (its ReadyEvent holds a PoolLease, dropped with the recomputation: when its
// session is cleared or its checkpoint's graph freed). When the last lease
// goes, prefire
// releases the pool: the allocator moves it to its freeable pools, whose
// unused memory empty_cache() and the out-of-memory retry give back to the
// device. The next prefire creates a new pool: the allocator cannot take a
// released pool back (createOrIncrefPool asserts a live use count).
// Limitations: while a routing window is open, the allocator treats the
// device as capturing, for every thread: malloc skips processing cross-stream
// events and the out-of-memory retry that frees cached blocks, and frees of
// blocks with stream uses are deferred. prefire keeps its own recordStream
// calls and event waits out of the window, but another library's
// recordStream during a window is booked as a capture use. Pool memory is
// held from one step to the next only while some session holds pool memory
// across the step boundary; otherwise each step starts a new pool and the old
// one is freed by the next empty_cache() or out-of-memory retry.

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>

#include <memory>

namespace prefire::detail {

/// A reference on `device`'s session buffer pool, for the lifetime of the
/// object (see Note [Session buffer pool]).
class PoolLease {
 public:
  ~PoolLease();
  PoolLease(const PoolLease&) = delete;
  PoolLease& operator=(const PoolLease&) = delete;

  /// A lease on `device`'s current pool, created when there is none.
  static std::shared_ptr<PoolLease> acquire(c10::DeviceIndex device);

  c10::DeviceIndex device() const { return device_; }
  c10::MempoolId_t pool() const { return pool_; }

 private:
  PoolLease(c10::DeviceIndex device, c10::MempoolId_t pool) : device_(device), pool_(pool) {}
  const c10::DeviceIndex device_;
  const c10::MempoolId_t pool_;
};

}  // namespace prefire::detail
