// The public OffloadTier (prefire/offload.h) over its store.

#include <prefire/offload.h>

#include "offload/host_file_store.h"
#include "offload/pinned_host_store.h"

#include <c10/util/StringUtil.h>

#include <cmath>
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

std::shared_ptr<OffloadTier> OffloadTier::host_file(const std::string& directory, int64_t capacity_bytes,
                                                    double bytes_per_second) {
  check_capacity(capacity_bytes);
  if (!(bytes_per_second >= 0) || std::isinf(bytes_per_second)) {
    throw std::invalid_argument(c10::str("prefire: an offload tier's bytes_per_second must be a finite number >= 0 "
                                         "(0: as fast as the file goes), got ", bytes_per_second));
  }
  return std::shared_ptr<OffloadTier>(
      new OffloadTier(std::make_unique<detail::HostFileStore>(directory, capacity_bytes, bytes_per_second)));
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
void OffloadTier::synchronize() {
  store_->synchronize();
  store_->settle();
}
int64_t OffloadTier::pending_bytes() const { return store_->pending_bytes(); }
int64_t OffloadTier::max_pending_bytes() const { return store_->max_pending_bytes(); }
void OffloadTier::set_max_pending_bytes(int64_t bytes) {
  if (bytes < 0) {
    throw std::invalid_argument(c10::str("prefire: an offload tier's max_pending_bytes must be >= 0 (0: every copy "
                                         "written before forward goes on), got ", bytes));
  }
  store_->set_max_pending_bytes(bytes);
}
double OffloadTier::measure_copy_seconds(int64_t nbytes) { return store_->measure_copy_seconds(nbytes); }

}  // namespace prefire
