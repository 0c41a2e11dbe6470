#include "session_pool.h"

#include <prefire/cuda.h>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <mutex>

#if PREFIRE_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>

#include <map>
#endif

namespace prefire {

#if PREFIRE_WITH_CUDA

namespace detail {
namespace {

std::mutex g_pools_mu;
std::map<c10::DeviceIndex, c10::MempoolId_t>& pools() {
  static auto* p = new std::map<c10::DeviceIndex, c10::MempoolId_t>();  // never destroyed
  return *p;
}

}  // namespace

c10::MempoolId_t session_pool(c10::DeviceIndex device) {
  std::lock_guard<std::mutex> lock(g_pools_mu);
  auto it = pools().find(device);
  if (it != pools().end()) return it->second;
  c10::MempoolId_t id = at::cuda::graph_pool_handle();
  // The owner reference: the pool exists with use count 1 (see Note [Session buffer pool]).
  c10::cuda::CUDACachingAllocator::createOrIncrefPool(device, id);
  pools().emplace(device, id);
  return id;
}

}  // namespace detail

bool cuda_available() {
  if (!c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA)) return false;
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->deviceCount() > 0;
}

int64_t session_pool_reserved_bytes() {
  std::map<c10::DeviceIndex, c10::MempoolId_t> snapshot_of;
  {
    std::lock_guard<std::mutex> lock(detail::g_pools_mu);
    snapshot_of = detail::pools();
  }
  if (snapshot_of.empty()) return 0;
  int64_t bytes = 0;
  auto info = c10::cuda::CUDACachingAllocator::snapshot({0, 0}, /*include_traces=*/false);
  for (const auto& segment : info.segments) {
    auto it = snapshot_of.find(segment.device);
    if (it != snapshot_of.end() && segment.owner_private_pool_id == it->second) {
      bytes += static_cast<int64_t>(segment.total_size);
    }
  }
  return bytes;
}

void release_session_pools() {
  std::lock_guard<std::mutex> lock(detail::g_pools_mu);
  for (const auto& [device, id] : detail::pools()) {
    try {
      c10::cuda::CUDACachingAllocator::releasePool(device, id);
    } catch (...) {  // teardown never throws
    }
  }
  detail::pools().clear();
}

#else  // !PREFIRE_WITH_CUDA

namespace detail {
c10::MempoolId_t session_pool(c10::DeviceIndex) {
  TORCH_CHECK(false, "prefire was built without CUDA: no session buffer pool");
}
}  // namespace detail

bool cuda_available() { return false; }
int64_t session_pool_reserved_bytes() { return 0; }
void release_session_pools() {}

#endif

}  // namespace prefire
