// Note [Single-flight recomputation]
// One key (a graph task, a session) gets one recomputation, whichever thread
// needs it first: the autograd device threads of one backward, a prefire and
// a lazy unpack racing for a session's checkpoint. The first caller computes;
// the others wait on a condition variable and share the result. No lock is
// held while `compute` runs: it runs user code (the checkpointed function,
// context hooks) which may call any public function, including prefire() of
// another checkpoint or session_stats() of this session. The only thing a
// caller waits for is the computation it needs; a computation that needs
// itself (a function that prefires its own checkpoint) is a CheckpointError,
// not a hang.

#include "checkpoint/recomputation.h"

#include <prefire/errors.h>
#include <prefire/stats.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>

namespace prefire::detail {

namespace {
std::atomic<int64_t> g_recomputations{0};
std::atomic<int64_t> g_unshared_recomputations{0};
std::atomic<int64_t> g_offload_fetches{0};
std::atomic<int64_t> g_wasted_prefires{0};
}  // namespace

void count_recomputation(bool in_session) {
  g_recomputations.fetch_add(1, std::memory_order_relaxed);
  if (!in_session) g_unshared_recomputations.fetch_add(1, std::memory_order_relaxed);
}

void count_offload_fetch(bool in_session) {
  g_offload_fetches.fetch_add(1, std::memory_order_relaxed);
  if (!in_session) g_unshared_recomputations.fetch_add(1, std::memory_order_relaxed);
}

int64_t unshared_recomputations() { return g_unshared_recomputations.load(std::memory_order_relaxed); }

void count_wasted_prefire(int64_t session) noexcept {
  g_wasted_prefires.fetch_add(1, std::memory_order_relaxed);
  try {
    TORCH_WARN_ONCE("prefire: a checkpoint prefired into session ", session, " was released before any backward pass "
                    "used its recomputation (the passes ran outside a session scope of ", session, ", or the session "
                    "was cleared first): that recomputation was wasted and the backward recomputed again. Run the "
                    "passes inside the session's scope (prefire::SessionScope; Python: with prefire.session(", session,
                    ")). RuntimeStats::wasted_prefires counts these.");
  } catch (...) {  // a warning handler that throws must not escape a release
  }
}

Recomputation::~Recomputation() { drop_all_locked(); }

bool Recomputation::ensure(c10::function_ref<void()> compute) {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    const State state = state_.load(std::memory_order_relaxed);
    if (state == State::kDone) return false;
    if (state == State::kEmpty) break;
    if (runner_ == std::this_thread::get_id()) {
      throw CheckpointError(
          "prefire: a checkpoint's recomputation needs its own result (the checkpointed function, a context hook "
          "or a recompute observer called prefire() of this checkpoint, or unpacked one of its saved tensors, while "
          "it is being recomputed); call it after the recomputation instead");
    }
    finished_.wait(lock);
  }
  state_.store(State::kRunning, std::memory_order_relaxed);
  runner_ = std::this_thread::get_id();
  lock.unlock();
  try {
    compute();
  } catch (...) {
    lock.lock();
    drop_all_locked();
    ready_.reset();
    in_pool_ = false;
    runner_ = std::thread::id();
    state_.store(State::kEmpty, std::memory_order_relaxed);
    finished_.notify_all();
    throw;
  }
  lock.lock();
  runner_ = std::thread::id();
  state_.store(State::kDone, std::memory_order_release);
  finished_.notify_all();
  return true;
}

void Recomputation::reset(size_t num_slots) {
  std::lock_guard<std::mutex> lock(mu_);
  drop_all_locked();
  in_pool_ = false;
  ready_.reset();
  tensors_.assign(num_slots, at::Tensor());
  consumed_.assign(num_slots, 0);
  taken_.assign(num_slots, 0);
  counted_.assign(num_slots, 0);
  trimmed_.assign(num_slots, 0);
  any_trimmed_.store(false, std::memory_order_release);
}

void Recomputation::store(size_t slot, at::Tensor tensor, bool counted) {
  std::lock_guard<std::mutex> lock(mu_);
  drop_locked(slot);
  if (counted && tensor.has_storage()) {
    if (const int64_t nbytes = census_.add(tensor.storage())) {
      global_recomputed_bytes().add(nbytes);
      global_held_bytes().add(nbytes);
      if (owner_) owner_->add(nbytes);
      if (in_pool_) pool_->add(nbytes);
    }
    counted_[slot] = 1;
  }
  tensors_[slot] = std::move(tensor);
}

std::optional<at::Tensor> Recomputation::take(size_t slot, bool retain) {
  std::lock_guard<std::mutex> lock(mu_);
  if (consumed_.at(slot)) return std::nullopt;
  if (retain) return tensors_[slot];
  at::Tensor t = tensors_[slot];
  drop_locked(slot);
  consumed_[slot] = 1;
  return t;
}

std::optional<at::Tensor> Recomputation::take_for_pass(size_t slot) {
  std::lock_guard<std::mutex> lock(mu_);
  if (consumed_.at(slot)) return std::nullopt;
  taken_[slot] = 1;
  return tensors_[slot];
}

void Recomputation::end_pass() noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t slot = 0; slot < taken_.size(); ++slot) {
    if (!taken_[slot]) continue;
    drop_locked(slot);
    consumed_[slot] = 1;
    taken_[slot] = 0;
  }
}

std::optional<at::Tensor> Recomputation::take_and_trim(size_t slot) {
  std::lock_guard<std::mutex> lock(mu_);
  if (consumed_.at(slot)) return std::nullopt;
  at::Tensor t = tensors_[slot];
  trim_locked(slot);
  return t;
}

void Recomputation::keep_only(const std::vector<bool>& keep) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t slot = 0; slot < tensors_.size() && slot < keep.size(); ++slot) {
    if (!keep[slot]) trim_locked(slot);
  }
}

void Recomputation::trim_locked(size_t slot) noexcept {
  drop_locked(slot);
  trimmed_[slot] = 1;
  any_trimmed_.store(true, std::memory_order_release);
}

bool Recomputation::trimmed(size_t slot) {
  if (!any_trimmed_.load(std::memory_order_acquire)) return false;
  std::lock_guard<std::mutex> lock(mu_);
  return slot < trimmed_.size() && trimmed_[slot];
}

void Recomputation::drop(size_t slot) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  if (slot < tensors_.size()) drop_locked(slot);
}

void Recomputation::drop_locked(size_t slot) noexcept {
  at::Tensor& t = tensors_[slot];
  if (!t.defined()) return;
  if (counted_[slot]) {
    if (const int64_t nbytes = census_.remove(t.storage())) {
      global_recomputed_bytes().sub(nbytes);
      global_held_bytes().sub(nbytes);
      if (owner_) owner_->sub(nbytes);
      if (in_pool_) pool_->sub(nbytes);
    }
    counted_[slot] = 0;
  }
  t.reset();
}

void Recomputation::drop_all_locked() noexcept {
  for (size_t slot = 0; slot < tensors_.size(); ++slot) drop_locked(slot);
}

}  // namespace prefire::detail

namespace prefire {

RuntimeStats runtime_stats() {
  RuntimeStats s;
  s.recomputations = detail::g_recomputations.load(std::memory_order_relaxed);
  s.unshared_recomputations = detail::g_unshared_recomputations.load(std::memory_order_relaxed);
  s.offload_fetches = detail::g_offload_fetches.load(std::memory_order_relaxed);
  s.wasted_prefires = detail::g_wasted_prefires.load(std::memory_order_relaxed);
  s.recomputed_bytes = detail::global_recomputed_bytes().current();
  s.peak_recomputed_bytes = detail::global_recomputed_bytes().peak();
  s.held_bytes = detail::global_held_bytes().current();
  s.peak_held_bytes = detail::global_held_bytes().peak();
  return s;
}

void reset_runtime_peak() {
  detail::global_recomputed_bytes().reset_peak();
  detail::global_held_bytes().reset_peak();
}

}  // namespace prefire
