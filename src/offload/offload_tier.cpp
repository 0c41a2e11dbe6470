// The public OffloadTier (prefire/offload.h) over its store.

#include <prefire/offload.h>

#include "offload/host_file_store.h"
#include "offload/pinned_host_store.h"

#include <c10/util/StringUtil.h>

#include <stdexcept>
#include <utility>

namespace prefire {
namespace {

void check_capacity(int64_t capacity_bytes) {
  if (capacity_bytes < detail::Space::kPage) {
    throw std::invalid_argument(c10::str("prefire: an offload tier's capacity_bytes must be at least one page (",
                                         detail::Space::kPage, " bytes), got ", capacity_bytes));
  }
}

}  // namespace

std::shared_ptr<OffloadTier> OffloadTier::host_file(const std::string& directory, int64_t capacity_bytes) {
  check_capacity(capacity_bytes);
  return std::shared_ptr<OffloadTier>(
      new OffloadTier(std::make_unique<detail::HostFileStore>(directory, capacity_bytes)));
}

std::shared_ptr<OffloadTier> OffloadTier::pinned_host(int64_t capacity_bytes) {
  check_capacity(capacity_bytes);
  return std::shared_ptr<OffloadTier>(new OffloadTier(detail::make_pinned_host_store(capacity_bytes)));
}

OffloadTier::OffloadTier(std::unique_ptr<detail::TierStore> store) : store_(std::move(store)) {}
OffloadTier::~OffloadTier() = default;

int64_t OffloadTier::capacity_bytes() const { return store_->space().capacity(); }
int64_t OffloadTier::used_bytes() const { return store_->space().used(); }
int64_t OffloadTier::peak_used_bytes() const { return store_->space().peak(); }
void OffloadTier::reset_peak() { store_->space().reset_peak(); }
int64_t OffloadTier::bytes_written() const { return store_->bytes_written(); }
int64_t OffloadTier::bytes_read() const { return store_->bytes_read(); }
void OffloadTier::synchronize() { store_->synchronize(); }
double OffloadTier::measure_copy_seconds(int64_t nbytes) { return store_->measure_copy_seconds(nbytes); }

}  // namespace prefire
