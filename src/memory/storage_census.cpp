// Note [Counting saved bytes]
// What a checkpoint saves is not all new memory: parameters the function
// captures (leaves that require grad, and views of them such as the
// transposed weight a linear saves) and the checkpoint's own inputs are saved
// as aliases of tensors that live anyway (is_activation says no). Only the other
// storages count, once per storage however many saved tensors alias it
// (StorageCensus), from the moment the first of them is held until the last
// is let go. Three counts follow the one rule:
//  * a recomputation's (checkpoint/recomputation.cpp): from a slot's store
//    until the last slot using the storage is handed out for good or dropped;
//    the session's and the process's gauges see the same changes;
//  * forward's (Frame::pack): what a recomputation of the frame will hold,
//    Frame::expected_bytes(), which a session budget compares before a
//    prefire; with the inputs forward saved added back, Frame::kept_bytes(),
//    what the block would hold unchecked (a plan's cost of keeping it);
//  * a SavedTensorMeter's (memory/saved_tensor_meter.cpp): what autograd's
//    saved tensors outside checkpoints hold, until autograd releases them.

#include "memory/storage_census.h"

#include <algorithm>

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

ByteGauge& global_recomputed_bytes() {
  static ByteGauge gauge;
  return gauge;
}

ByteGauge& global_held_bytes() {
  static ByteGauge gauge;
  return gauge;
}

bool is_activation(const at::Tensor& t) {
  if (!t.has_storage()) return false;
  auto is_leaf_requiring_grad = [](const at::TensorBase& x) { return x.is_leaf() && x.requires_grad(); };
  return !is_leaf_requiring_grad(t) && !(t.is_view() && is_leaf_requiring_grad(t._base()));
}

int64_t StorageCensus::add(const c10::StorageImpl* storage, int64_t nbytes) {
  return users_[storage]++ == 0 ? nbytes : 0;
}

int64_t StorageCensus::remove(const c10::StorageImpl* storage, int64_t nbytes) noexcept {
  auto it = users_.find(storage);
  if (it == users_.end() || --it->second > 0) return 0;
  users_.erase(it);
  return nbytes;
}

}  // namespace prefire::detail
