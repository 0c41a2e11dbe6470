#include "offload/host_file_store.h"

#include <prefire/errors.h>

#include <c10/core/CPUAllocator.h>
#include <c10/util/StringUtil.h>

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <thread>
#include <unistd.h>
#include <utility>
#include <vector>

namespace prefire::detail {
namespace {

std::string reason(int error) { return std::strerror(error); }

c10::Storage cpu_storage(int64_t nbytes) {
  return c10::Storage(c10::Storage::use_byte_size_t(), nbytes, c10::GetCPUAllocator(), /*resizable=*/false);
}

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

// A prefetch's reads: an unpack waits for them before it hands a tensor out.
class WorkerReady final : public ReadyEvent {
 public:
  explicit WorkerReady(std::vector<std::shared_ptr<Copy>> reads) : reads_(std::move(reads)) {}
  void hand_over(const at::Tensor&) override {
    for (const auto& read : reads_) read->wait();
  }

 private:
  std::vector<std::shared_ptr<Copy>> reads_;
};

}  // namespace

HostFileStore::HostFileStore(const std::string& directory, int64_t capacity, double bytes_per_second)
    : TierStore(capacity, c10::str("in \"", directory, '"')), directory_(directory),
      bytes_per_second_(bytes_per_second) {
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
  if (const int error = posix_fallocate(fd_, 0, space().capacity())) {
    close(fd_);
    throw CheckpointError(c10::str("prefire: cannot reserve ", space().capacity(), " bytes for the offload tier in \"",
                                   directory, "\": ", reason(error), ". Free space there, name another "
                                   "directory or ask for less"));
  }
}

HostFileStore::~HostFileStore() {
  // The worker's destructor (a member, destroyed after this body) would run
  // the queued copies on a closed file: they are run here first.
  synchronize();
  close(fd_);
}

void HostFileStore::synchronize() { worker_.enqueue([] {})->wait(); }

const char* HostFileStore::refuses_device(const at::Tensor& t) const {
  return t.is_cpu() ? nullptr : "it is not on the CPU (the host file tier takes CPU tensors)";
}

c10::Storage HostFileStore::scratch_storage(int64_t nbytes) {
  c10::Storage storage = cpu_storage(nbytes);
  std::memset(storage.mutable_data(), 0, static_cast<size_t>(nbytes));
  return storage;
}

void HostFileStore::pace(std::chrono::steady_clock::time_point begin, int64_t nbytes) const {
  if (bytes_per_second_ <= 0) return;
  std::this_thread::sleep_until(begin + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                            std::chrono::duration<double>(nbytes / bytes_per_second_)));
}

void HostFileStore::write_now(const c10::Storage& storage, const Region& region) {
  const auto begin = std::chrono::steady_clock::now();
  transfer(pwrite, fd_, static_cast<const char*>(storage.data()), region.nbytes, region.offset,
           [&] { return c10::str("writing ", region.nbytes, " bytes into the offload tier in \"", directory_, '"'); });
  pace(begin, region.nbytes);
  count_written(region.nbytes);
}

void HostFileStore::read_region(const Region& region, c10::Storage& storage) {
  const auto begin = std::chrono::steady_clock::now();
  transfer(pread, fd_, static_cast<char*>(storage.mutable_data()), region.nbytes, region.offset, [&] {
    return c10::str("reading ", region.nbytes, " bytes back from the offload tier in \"", directory_, '"');
  });
  pace(begin, region.nbytes);
  count_read(region.nbytes);
}

std::shared_ptr<Copy> HostFileStore::write(c10::Storage storage, std::shared_ptr<Region> region) {
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

// Note [A lazy fetch waits before it allocates]
// A backward may reach an offloaded block while the block's copies into the
// tier are still queued (a slow tier, or forward just before). Its lazy fetch
// then waits for those copies, and only after them allocates the storages it
// reads into and forgets the copies as pending (settle()): the worker marks a
// copy done, and wakes its waiters, before it settles, so without the settle
// here the census would count the copy as pending and the fetched storage
// as held at once, a block twice (seen as a plan's census over its budget by
// a small saved tensor whose copy had just finished); and a storage made
// before the wait would be held beside the one its copy still holds. A
// prefetch (queued) allocates at once: its storages must exist when it
// returns, beside whatever copies are still queued.
TierStore::ReadBack HostFileStore::read(const std::vector<StorageCopy>& copies, bool queued) {
  ReadBack back;
  if (!queued) {  // Note [A lazy fetch waits before it allocates]
    for (const StorageCopy& copy : copies) {
      if (copy.region) copy.written->wait();  // rethrows its error
    }
    settle();
    for (const StorageCopy& copy : copies) {
      back.storages.push_back(cpu_storage(copy.nbytes));
      if (copy.region) read_region(*copy.region, back.storages.back());
    }
    return back;
  }
  std::vector<std::shared_ptr<Copy>> reads;
  for (const StorageCopy& copy : copies) {
    back.storages.push_back(cpu_storage(copy.nbytes));
    if (!copy.region) continue;
    // Queued after the copy into the region: that one is done when this runs.
    reads.push_back(worker_.enqueue(
        [this, region = copy.region, storage = back.storages.back(), written = copy.written]() mutable {
          written->wait();  // rethrows its error
          read_region(*region, storage);
        }));
  }
  if (!reads.empty()) back.ready = std::make_shared<WorkerReady>(std::move(reads));
  return back;
}

}  // namespace prefire::detail
