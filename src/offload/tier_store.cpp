#include "offload/tier_store.h"

#include <prefire/errors.h>

#include <c10/util/StringUtil.h>

#include <chrono>
#include <utility>

namespace prefire::detail {

const char* TierStore::refuses(const at::Tensor& t) const {
  if (!t.has_storage() || t.layout() != at::kStrided) return "it is not a dense tensor";
  if (t.unsafeGetTensorImpl()->is_python_dispatch()) return "it is a tensor subclass";
  if (const char* why = refuses_device(t)) return why;
  if (t.is_quantized()) return "it is quantized";
  if (t.is_conj() || t.is_neg()) return "it is a conjugate or negative view";
  return nullptr;
}

std::shared_ptr<Region> TierStore::allocate(int64_t nbytes, const std::string& what) {
  reclaim(/*wait=*/false);
  if (std::shared_ptr<Region> region = space_.allocate(nbytes)) return region;
  reclaim(/*wait=*/true);
  if (std::shared_ptr<Region> region = space_.allocate(nbytes)) return region;
  throw CheckpointError(c10::str(
      "prefire: the offload tier ", where_, " is full: ", what, " needs ", nbytes, " bytes; the tier holds ",
      space_.used(), " of its ", space_.capacity(), " bytes and its longest free run is ", space_.largest_free(),
      " bytes. This forward fails, and what it offloaded so far is released with it; make the tier larger, "
      "offload fewer blocks, or free the graphs of earlier steps before this forward"));
}

StorageCopy TierStore::copy_in(const c10::Storage& storage, const std::string& what) {
  StorageCopy copy;
  copy.nbytes = static_cast<int64_t>(storage.nbytes());
  copy.device = storage.device();
  if (copy.nbytes > 0) {
    copy.region = allocate(copy.nbytes, what);
    copy.written = write(storage, copy.region);
  }
  return copy;
}

c10::Storage TierStore::read_now(const StorageCopy& copy) {
  return std::move(read({copy}, /*queued=*/false).storages.front());
}

double TierStore::measure_copy_seconds(int64_t nbytes) {
  if (nbytes <= 0) return 0;
  StorageCopy copy;
  copy.nbytes = nbytes;
  copy.region = allocate(nbytes, "measuring its copies");
  c10::Storage storage = scratch_storage(nbytes);
  copy.device = storage.device();
  auto both_ways = [&] {
    copy.written = write(storage, copy.region);
    copy.written->wait();
    read({copy}, /*queued=*/false);
    synchronize();  // a device tier's read is only queued on the stream
  };
  // Untimed first: the first copy into a region pays for what the tier makes
  // on first touch (a file's pages, a stream), which the regions of later
  // steps, reused, do not.
  both_ways();
  const auto begin = std::chrono::steady_clock::now();
  both_ways();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
}

}  // namespace prefire::detail
