#include "offload/tier_store.h"

#include <prefire/errors.h>
#include <prefire/offload.h>

#include <c10/core/CPUAllocator.h>
#include <c10/util/StringUtil.h>

#include <chrono>

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <stdexcept>
#include <unistd.h>
#include <utility>
#include <vector>

namespace prefire::detail {
namespace {

std::string reason(int error) { return std::strerror(error); }

}  // namespace

TierStore::TierStore(const std::string& directory, int64_t capacity) : directory_(directory), space_(capacity) {
  std::string path = directory + "/prefire-offload-XXXXXX";
  std::vector<char> name(path.begin(), path.end());
  name.push_back('\0');
  fd_ = mkstemp(name.data());
  if (fd_ < 0) {
    throw CheckpointError(c10::str("prefire: cannot create the offload tier's file in \"", directory,
                                   "\": ", reason(errno), ". Name a directory that exists and this process may "
                                   "write to"));
  }
  unlink(name.data());  // nothing is left behind, whatever happens to the process
  if (const int error = posix_fallocate(fd_, 0, space_.capacity())) {
    close(fd_);
    throw CheckpointError(c10::str("prefire: cannot reserve ", space_.capacity(), " bytes for the offload tier in \"",
                                   directory, "\": ", reason(error), ". Free space there, name another "
                                   "directory or ask for less"));
  }
}

TierStore::~TierStore() {
  // The worker's destructor (a member, destroyed after this body) would run
  // the queued copies on a closed file: they are run here first.
  synchronize();
  close(fd_);
}

void TierStore::synchronize() { worker_.enqueue([] {})->wait(); }

std::shared_ptr<Region> TierStore::allocate(int64_t nbytes, const std::string& what) {
  if (std::shared_ptr<Region> region = space_.allocate(nbytes)) return region;
  throw CheckpointError(c10::str(
      "prefire: the offload tier in \"", directory_, "\" is full: ", what, " needs ", nbytes, " bytes; the tier holds ",
      space_.used(), " of its ", space_.capacity(), " bytes and its longest free run is ", space_.largest_free(),
      " bytes. This forward fails, and what it offloaded so far is released with it; make the tier larger, "
      "offload fewer blocks, or free the graphs of earlier steps before this forward"));
}

namespace {

// Moves `nbytes` between `data` and the file at `offset` with `io` (pwrite or pread), however many calls it
// takes; raises CheckpointError saying what failed (`what()`, built only then).
template <typename Io, typename Data, typename What>
void transfer(Io io, int fd, Data* data, int64_t nbytes, int64_t offset, const What& what) {
  int64_t done = 0;
  while (done < nbytes) {
    const ssize_t n = io(fd, data + done, static_cast<size_t>(nbytes - done), offset + done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw CheckpointError(c10::str("prefire: ", what(), " failed: ", reason(n < 0 ? errno : EIO)));
    done += n;
  }
}

}  // namespace

void TierStore::write_now(const c10::Storage& storage, const Region& region) {
  transfer(pwrite, fd_, static_cast<const char*>(storage.data()), region.nbytes, region.offset,
           [&] { return c10::str("writing ", region.nbytes, " bytes into the offload tier in \"", directory_, '"'); });
  bytes_written_.fetch_add(region.nbytes, std::memory_order_relaxed);
}

void TierStore::read_now(const Region& region, c10::Storage& storage) {
  transfer(pread, fd_, static_cast<char*>(storage.mutable_data()), region.nbytes, region.offset, [&] {
    return c10::str("reading ", region.nbytes, " bytes back from the offload tier in \"", directory_, '"');
  });
  bytes_read_.fetch_add(region.nbytes, std::memory_order_relaxed);
}

std::shared_ptr<Copy> TierStore::write(c10::Storage storage, std::shared_ptr<Region> region) {
  // A storage with a Python object may need the GIL when its last reference
  // goes, and a Python thread holding the GIL may wait for this worker (a
  // fetch inside a saved-tensor unpack hook): such a storage is written here,
  // on the saving thread, and never reaches the worker.
  if (storage.unsafeGetStorageImpl()->pyobj_slot()->load_pyobj() != nullptr) {
    return CopyWorker::run_here([&] { write_now(storage, *region); });
  }
  return worker_.enqueue(
      [this, storage = std::move(storage), region = std::move(region)] { write_now(storage, *region); });
}

std::shared_ptr<Copy> TierStore::read_async(std::shared_ptr<Region> region, c10::Storage storage,
                                            std::shared_ptr<Copy> written) {
  return worker_.enqueue([this, storage = std::move(storage), region = std::move(region),
                          written = std::move(written)]() mutable {
    written->wait();  // done (queued before this read); rethrows its error
    read_now(*region, storage);
  });
}

}  // namespace prefire::detail

namespace prefire {

std::shared_ptr<OffloadTier> OffloadTier::host_file(const std::string& directory, int64_t capacity_bytes) {
  if (capacity_bytes < detail::Space::kPage) {
    throw std::invalid_argument(c10::str("prefire: an offload tier's capacity_bytes must be at least one page (",
                                         detail::Space::kPage, " bytes), got ", capacity_bytes));
  }
  return std::shared_ptr<OffloadTier>(
      new OffloadTier(std::make_unique<detail::TierStore>(directory, capacity_bytes)));
}

OffloadTier::OffloadTier(std::unique_ptr<detail::TierStore> store) : store_(std::move(store)) {}
OffloadTier::~OffloadTier() = default;

int64_t OffloadTier::capacity_bytes() const { return store_->space().capacity(); }
int64_t OffloadTier::used_bytes() const { return store_->space().used(); }
int64_t OffloadTier::peak_used_bytes() const { return store_->space().peak(); }
void OffloadTier::reset_peak() { store_->space().reset_peak(); }
void OffloadTier::synchronize() { store_->synchronize(); }

double OffloadTier::measure_copy_seconds(int64_t nbytes) {
  if (nbytes <= 0) return 0;
  std::shared_ptr<detail::Region> region = store_->allocate(nbytes, "measuring its copies");
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, c10::GetCPUAllocator(), /*resizable=*/false);
  std::memset(storage.mutable_data(), 0, static_cast<size_t>(nbytes));
  const auto begin = std::chrono::steady_clock::now();
  store_->write(storage, region)->wait();
  store_->read_now(*region, storage);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
}
int64_t OffloadTier::bytes_written() const { return store_->bytes_written(); }
int64_t OffloadTier::bytes_read() const { return store_->bytes_read(); }

}  // namespace prefire
