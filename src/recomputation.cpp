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
//
// Note [Counting recomputed bytes]
// A recomputation holds what autograd saved inside the checkpoint. Some of it
// is not new memory: parameters the function captures (leaves that require
// grad, and views of them such as the transposed weight a linear saves) and
// the checkpoint's own inputs are saved as aliases of tensors that live
// anyway (aliases_a_leaf). Only the other storages count, once per storage however many
// slots alias it, from the moment a slot is stored until the last slot using
// the storage is handed out for good or dropped. The same rule, applied to
// forward's saves, gives Frame::expected_bytes(), which a session budget
// compares before a prefire; with the inputs forward saved added back it
// gives Frame::kept_bytes(), what the block would hold unchecked (a plan's
// cost of keeping it).

#include "recomputation.h"

#include <prefire/errors.h>

#include <prefire/stats.h>

#include <algorithm>
#include <atomic>

namespace prefire::detail {

void ByteGauge::add(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  current_ += bytes;
  peak_ = std::max(peak_, current_);
}

void ByteGauge::sub(int64_t bytes) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  current_ -= bytes;
}

int64_t ByteGauge::current() const {
  std::lock_guard<std::mutex> lock(mu_);
  return current_;
}

int64_t ByteGauge::peak() const {
  std::lock_guard<std::mutex> lock(mu_);
  return peak_;
}

void ByteGauge::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  peak_ = current_;
}

namespace {
std::atomic<int64_t> g_recomputations{0};
}

ByteGauge& global_recomputed_bytes() {
  static ByteGauge gauge;
  return gauge;
}

ByteGauge& global_held_bytes() {
  static ByteGauge gauge;
  return gauge;
}

bool aliases_a_leaf(const at::Tensor& t) {
  auto is_leaf_requiring_grad = [](const at::TensorBase& x) { return x.is_leaf() && x.requires_grad(); };
  if (is_leaf_requiring_grad(t)) return true;
  return t.is_view() && is_leaf_requiring_grad(t._base());
}

void count_recomputation() { g_recomputations.fetch_add(1, std::memory_order_relaxed); }

Recomputation::~Recomputation() { release_all(); }

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
    release_all();
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
  release_all();
  in_pool_ = false;
  ready_.reset();
  tensors_.assign(num_slots, at::Tensor());
  consumed_.assign(num_slots, 0);
  taken_.assign(num_slots, 0);
  counted_.assign(num_slots, 0);
}

void Recomputation::store(size_t slot, at::Tensor tensor, bool counted) {
  std::lock_guard<std::mutex> lock(mu_);
  release(slot);
  if (counted && tensor.has_storage()) {
    const c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
    if (storages_[storage]++ == 0) {
      auto nbytes = static_cast<int64_t>(tensor.storage().nbytes());
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
  release(slot);
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
    release(slot);
    consumed_[slot] = 1;
    taken_[slot] = 0;
  }
}

void Recomputation::drop(size_t slot) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  if (slot < tensors_.size()) release(slot);
}

void Recomputation::release(size_t slot) noexcept {
  at::Tensor& t = tensors_[slot];
  if (!t.defined()) return;
  if (counted_[slot]) {
    auto it = storages_.find(t.storage().unsafeGetStorageImpl());
    if (it != storages_.end() && --it->second == 0) {
      auto nbytes = static_cast<int64_t>(t.storage().nbytes());
      global_recomputed_bytes().sub(nbytes);
      global_held_bytes().sub(nbytes);
      if (owner_) owner_->sub(nbytes);
      if (in_pool_) pool_->sub(nbytes);
      storages_.erase(it);
    }
    counted_[slot] = 0;
  }
  t.reset();
}

void Recomputation::release_all() noexcept {
  for (size_t slot = 0; slot < tensors_.size(); ++slot) release(slot);
}

}  // namespace prefire::detail

namespace prefire {

RuntimeStats runtime_stats() {
  RuntimeStats s;
  s.recomputations = detail::g_recomputations.load(std::memory_order_relaxed);
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
