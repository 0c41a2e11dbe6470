#include "offload/space.h"

#include <algorithm>
#include <iterator>

namespace prefire::detail {

Space::Space(int64_t capacity) : capacity_(capacity / kPage * kPage) {
  if (capacity_ > 0) free_.emplace(0, capacity_);
}

std::shared_ptr<Region> Space::allocate(int64_t nbytes) {
  const int64_t reserved = (nbytes + kPage - 1) / kPage * kPage;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = std::find_if(free_.begin(), free_.end(), [&](const auto& run) { return run.second >= reserved; });
  if (it == free_.end()) return nullptr;
  const int64_t offset = it->first;
  const int64_t rest = it->second - reserved;
  free_.erase(it);
  if (rest > 0) free_.emplace(offset + reserved, rest);
  used_ += reserved;
  peak_ = std::max(peak_, used_);
  return std::shared_ptr<Region>(new Region{offset, nbytes, reserved}, [this](Region* region) {
    free(*region);
    delete region;
  });
}

void Space::free(const Region& region) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  used_ -= region.reserved;
  int64_t offset = region.offset;
  int64_t length = region.reserved;
  auto next = free_.lower_bound(offset);
  if (next != free_.end() && next->first == offset + length) {  // merge with the run after it
    length += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto before = std::prev(next);
    if (before->first + before->second == offset) {  // and with the run before it
      before->second += length;
      return;
    }
  }
  free_.emplace(offset, length);
}

int64_t Space::used() const {
  std::lock_guard<std::mutex> lock(mu_);
  return used_;
}

int64_t Space::peak() const {
  std::lock_guard<std::mutex> lock(mu_);
  return peak_;
}

void Space::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  peak_ = used_;
}

int64_t Space::largest_free() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t largest = 0;
  for (const auto& [offset, length] : free_) largest = std::max(largest, length);
  return largest;
}

}  // namespace prefire::detail
