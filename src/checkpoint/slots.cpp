#include "checkpoint/slots.h"

#include <c10/util/StringUtil.h>

namespace prefire::detail {

SlotMetadata SlotMetadata::of(const at::Tensor& t) {
  SlotMetadata m;
  m.sizes.assign(t.sizes().begin(), t.sizes().end());
  m.dtype = t.scalar_type();
  m.device = t.device();
  return m;
}

bool SlotMetadata::matches(const at::Tensor& t) const {
  return t.sizes().equals(sizes) && t.scalar_type() == dtype && t.device() == device;
}

std::string SlotMetadata::to_string() const {
  return c10::str("{shape ", c10::IntArrayRef(sizes), ", dtype ", dtype, ", device ", device, "}");
}

size_t SlotTable::add(SlotMetadata metadata, bool counted) {
  metadata_.push_back(std::move(metadata));
  counted_.push_back(counted ? 1 : 0);
  std::lock_guard<std::mutex> lock(mu_);
  alive_.push_back(1);
  return alive_.size() - 1;
}

size_t SlotTable::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return alive_.size();
}

void SlotTable::release(size_t slot) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  alive_[slot] = 0;
}

bool SlotTable::alive(size_t slot) const {
  std::lock_guard<std::mutex> lock(mu_);
  return alive_[slot] != 0;
}

}  // namespace prefire::detail
