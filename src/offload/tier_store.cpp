// Note [Backpressure on copies into a tier]
// A copy into a tier holds its storage until it is written (the host file
// tier's worker; the pinned host tier's copy stream, through the caching
// allocator's stream use), so while copies lag behind forward the device (or
// the CPU heap) holds the offloaded bytes *and* everything forward allocates
// meanwhile: a plan that counts an offloaded block as gone from its forward on
// would be exceeded, by as much as the queue holds (on a first step, where
// the file's pages are fresh, by up to twice the budget). So:
//  1. Every copy into the tier is pending from its queueing until it is seen
//     done, and its bytes count as held in the runtime's census
//     (RuntimeStats::held_bytes, the gauge the planners measure with) while
//     pending, whoever else holds the storage (counted once per copy: an
//     over-count where the storage lives on anyway, never an under-count).
//  2. copy_in() holds back after queueing: while its copy would take the
//     pending bytes over max_pending_bytes() it waits for the oldest pending
//     copy, and a copy over the limit by itself is waited for at once (never
//     pending: the storage was forward's anyway). With a limit of 0 every
//     copy is written before forward goes on; the default (no limit) never
//     waits. The memory planners set the limit to their plan's headroom (the
//     budget less the plan's peak), so a planned step holds its budget from
//     the first step on (Note [Offloaded blocks in a plan], rule 6, in
//     src/plan/plan_bytes.cpp).
//  3. A copy is seen done when the store says so (the host file tier's worker
//     after each copy, once the storage is let go) or when pending_bytes(),
//     copy_in() or synchronize() looks (the pinned host tier's events).
//     Waiting never raises a copy's error: the fetch that needs it does.
//
// Note [One copy per storage]
// Several checkpoints may save the same storage (GPT-2's causal mask goes
// into every block): each would write it into the tier again and hold a
// region of its own. The tier remembers, per storage, its copy while that
// copy's region lives and the storage lives; a later save of the same storage
// shares the copy when it is still the same bytes: the same version counter
// (tested as the same object) at the same version. A storage written to in
// place since, or saved through a tensor with a counter of its own, is copied
// again. Each checkpoint's slots still check their own versions at fetch.

#include "offload/tier_store.h"

#include <prefire/errors.h>

#include "memory/storage_census.h"

#include <c10/util/StringUtil.h>

#include <chrono>
#include <cstring>
#include <utility>

namespace prefire::detail {
namespace {

// VariableVersion is one intrusive pointer to its counter and has no way to
// ask for that pointer; two of them name the same counter when their bytes are
// equal (Note [One copy per storage]). Fails to compile where torch changes that.
static_assert(sizeof(c10::VariableVersion) == sizeof(void*),
              "c10::VariableVersion is no longer one pointer: same_counter() must change");
bool same_counter(const c10::VariableVersion& a, const c10::VariableVersion& b) {
  return std::memcmp(static_cast<const void*>(&a), static_cast<const void*>(&b), sizeof(a)) == 0;
}

}  // namespace

TierStore::~TierStore() {
  std::lock_guard<std::mutex> lock(pending_mu_);
  global_held_bytes().sub(pending_bytes_);
}

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

StorageCopy TierStore::copy_in(const at::Tensor& tensor, const std::string& what) {
  const c10::Storage& storage = tensor.storage();
  StorageCopy copy;
  copy.nbytes = static_cast<int64_t>(storage.nbytes());
  copy.device = storage.device();
  if (copy.nbytes > 0 && !find_written(tensor, copy)) {
    copy.region = allocate(copy.nbytes, what);
    copy.written = write(storage, copy.region);
    remember_written(tensor, copy);
    hold_back(copy.written, copy.nbytes);
  }
  return copy;
}

bool TierStore::find_written(const at::Tensor& tensor, StorageCopy& copy) {
  const c10::VariableVersion& counter = tensor.unsafeGetTensorImpl()->version_counter();
  if (!counter.enabled()) return false;
  std::lock_guard<std::mutex> lock(written_mu_);
  auto found = written_.find(tensor.storage().unsafeGetStorageImpl());
  if (found == written_.end()) return false;
  const Written& w = found->second;
  std::shared_ptr<Region> region = w.region.lock();
  if (!region || w.storage.expired() || region->nbytes != copy.nbytes || !same_counter(w.counter, counter) ||
      w.version != counter.current_version()) {
    return false;
  }
  copy.region = std::move(region);
  copy.written = w.written;
  return true;
}

void TierStore::remember_written(const at::Tensor& tensor, const StorageCopy& copy) {
  const c10::VariableVersion& counter = tensor.unsafeGetTensorImpl()->version_counter();
  if (!counter.enabled()) return;
  std::lock_guard<std::mutex> lock(written_mu_);
  if (written_.size() >= sweep_at_) {  // forget the copies whose region or storage is gone
    for (auto it = written_.begin(); it != written_.end();) {
      it = it->second.region.expired() || it->second.storage.expired() ? written_.erase(it) : std::next(it);
    }
    sweep_at_ = std::max<size_t>(64, 2 * written_.size());
  }
  Written entry{tensor.storage().getWeakStorageImpl(), counter, counter.current_version(), copy.region, copy.written};
  auto [it, added] = written_.emplace(tensor.storage().unsafeGetStorageImpl(), entry);
  if (!added) it->second = std::move(entry);
}

void TierStore::hold_back(const std::shared_ptr<Copy>& written, int64_t nbytes) {
  if (written->done()) return;  // written here (a storage with a Python object)
  auto wait_for = [](const Copy& copy) {
    try {
      copy.wait();
    } catch (...) {  // the fetch that needs this copy raises its error (Note [Backpressure on copies into a tier])
    }
  };
  const int64_t limit = max_pending_bytes();
  for (;;) {  // the oldest copies first, until this one fits
    std::shared_ptr<Copy> oldest;
    {
      std::lock_guard<std::mutex> lock(pending_mu_);
      if (pending_.empty() || pending_bytes_ + nbytes <= limit) break;
      oldest = pending_.front().first;
    }
    wait_for(*oldest);
    settle();
  }
  if (nbytes > limit) {  // written before forward goes on: never pending
    wait_for(*written);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(pending_mu_);
    pending_.emplace_back(written, nbytes);
    pending_bytes_ += nbytes;
  }
  global_held_bytes().add(nbytes);
  settle();  // it may have been written meanwhile, after the worker last looked
}

void TierStore::settle() noexcept {
  int64_t freed = 0;
  {
    std::lock_guard<std::mutex> lock(pending_mu_);
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (it->first->done()) {
        freed += it->second;
        it = pending_.erase(it);
      } else {
        ++it;
      }
    }
    pending_bytes_ -= freed;
  }
  if (freed > 0) global_held_bytes().sub(freed);
}

int64_t TierStore::pending_bytes() {
  settle();
  std::lock_guard<std::mutex> lock(pending_mu_);
  return pending_bytes_;
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
