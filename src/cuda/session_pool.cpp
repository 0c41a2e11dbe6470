// See Note [Session buffer pool] in session_pool.h.

#include "cuda/session_pool.h"

#include <prefire/cuda.h>

#include <c10/util/Exception.h>

#include <atomic>
#include <mutex>

#if PREFIRE_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>
#include <map>
#include <vector>
#endif

namespace prefire {
namespace detail {
namespace {
std::atomic<bool> g_pool_enabled{false};
}  // namespace
}  // namespace detail

void set_session_pool_enabled(bool enabled) { detail::g_pool_enabled.store(enabled); }
bool session_pool_enabled() { return detail::g_pool_enabled.load(); }

#if PREFIRE_WITH_CUDA

namespace detail {
namespace {

struct DevicePool {
  std::optional<c10::MempoolId_t> id;  // the current pool, while leased
  int64_t leases = 0;
};

struct Pools {
  std::mutex mu;
  std::map<c10::DeviceIndex, DevicePool> current;
  // The pools prefire created that may still have memory, for the
  // reserved-bytes report: a released pool keeps its memory until the
  // allocator frees it. Pruned by the report, and capped.
  std::vector<std::pair<c10::DeviceIndex, c10::MempoolId_t>> created;
};

Pools& pools() {
  static auto* p = new Pools();  // never destroyed: leases may end during static destruction
  return *p;
}

void release(c10::DeviceIndex device, c10::MempoolId_t id) noexcept {
  try {
    c10::cuda::CUDACachingAllocator::releasePool(device, id);
  } catch (...) {  // teardown never throws
  }
}

}  // namespace

std::shared_ptr<PoolLease> PoolLease::acquire(c10::DeviceIndex device) {
  auto& all = pools();
  std::lock_guard<std::mutex> lock(all.mu);
  DevicePool& p = all.current[device];
  if (!p.id) {
    c10::MempoolId_t id = at::cuda::graph_pool_handle();
    c10::cuda::CUDACachingAllocator::createOrIncrefPool(device, id);  // prefire's reference
    p.id = id;
    constexpr size_t kMaxRemembered = 1024;
    if (all.created.size() >= kMaxRemembered) all.created.erase(all.created.begin());
    all.created.emplace_back(device, id);
  }
  ++p.leases;
  return std::shared_ptr<PoolLease>(new PoolLease(device, *p.id));
}

PoolLease::~PoolLease() {
  auto& all = pools();
  std::lock_guard<std::mutex> lock(all.mu);
  DevicePool& p = all.current[device_];
  if (!p.id || *p.id != pool_) return;  // released early by release_session_pools()
  if (--p.leases > 0) return;
  release(device_, pool_);
  p.id.reset();
}

}  // namespace detail

// Note [Asking ATen, not the device guard, whether CUDA is here]
// On a machine without a CUDA device, torch's FakeTensorMode (torch.compile
// enters it) registers a fake CUDA device guard that counts 8 devices, for
// the rest of the process. The registry's guard is no evidence of a device:
// prefire asks c10's count of real ones here (what torch.cuda.is_available
// reads), and ATen's CUDA hooks (at::hasCUDA, the same count) where it does
// not link CUDA.
bool cuda_available() { return c10::cuda::device_count() > 0; }

int64_t session_pool_reserved_bytes() {
  std::vector<std::pair<c10::DeviceIndex, c10::MempoolId_t>> created;
  {
    std::lock_guard<std::mutex> lock(detail::pools().mu);
    created = detail::pools().created;
  }
  if (created.empty()) return 0;
  int64_t bytes = 0;
  std::vector<std::pair<c10::DeviceIndex, c10::MempoolId_t>> with_memory;
  auto info = c10::cuda::CUDACachingAllocator::snapshot({0, 0}, /*include_traces=*/false);
  for (const auto& segment : info.segments) {
    const std::pair<c10::DeviceIndex, c10::MempoolId_t> key{segment.device, segment.owner_private_pool_id};
    if (std::find(created.begin(), created.end(), key) != created.end()) {
      bytes += static_cast<int64_t>(segment.total_size);
      with_memory.push_back(key);
    }
  }
  // Forget released pools that hold nothing any more.
  auto& all = detail::pools();
  std::lock_guard<std::mutex> lock(all.mu);
  auto gone = [&](const auto& key) {
    const auto& p = all.current[key.first];
    const bool current = p.id && *p.id == key.second;
    return !current && std::find(with_memory.begin(), with_memory.end(), key) == with_memory.end();
  };
  all.created.erase(std::remove_if(all.created.begin(), all.created.end(), gone), all.created.end());
  return bytes;
}

void release_session_pools() {
  auto& all = detail::pools();
  std::lock_guard<std::mutex> lock(all.mu);
  for (auto& [device, p] : all.current) {
    if (!p.id) continue;
    detail::release(device, *p.id);
    p.id.reset();
    p.leases = 0;  // the remaining leases find another id and do nothing
  }
}

#else  // !PREFIRE_WITH_CUDA

namespace detail {
PoolLease::~PoolLease() = default;
std::shared_ptr<PoolLease> PoolLease::acquire(c10::DeviceIndex) {
  TORCH_CHECK(false, "prefire was built without CUDA: no session buffer pool");
}
}  // namespace detail

bool cuda_available() { return false; }
int64_t session_pool_reserved_bytes() { return 0; }
void release_session_pools() {}

#endif

}  // namespace prefire
