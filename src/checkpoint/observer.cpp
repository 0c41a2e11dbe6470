#include <prefire/observer.h>

#include "checkpoint/observer.h"

#include <atomic>
#include <mutex>

namespace prefire {
namespace detail {
namespace {
std::mutex g_mu;
RecomputeObserver g_observer;  // guarded by g_mu
std::atomic<bool> g_has_observer{false};
}  // namespace

bool has_recompute_observer() { return g_has_observer.load(std::memory_order_acquire); }

void notify_recompute(const RecomputeEvent& event) noexcept {
  if (!has_recompute_observer()) return;
  RecomputeObserver observer;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    observer = g_observer;
  }
  if (!observer) return;
  try {
    observer(event);
  } catch (...) {  // documented: observers must not throw; never let one break a backward
  }
}

}  // namespace detail

void set_recompute_observer(RecomputeObserver observer) {
  std::lock_guard<std::mutex> lock(detail::g_mu);
  detail::g_observer = std::move(observer);
  detail::g_has_observer.store(static_cast<bool>(detail::g_observer), std::memory_order_release);
}

}  // namespace prefire
