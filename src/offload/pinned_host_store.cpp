// See Note [The pinned host tier] in offload/pinned_host_store.h.

#include "offload/pinned_host_store.h"

#include <prefire/cuda.h>
#include <prefire/errors.h>

#include <c10/util/StringUtil.h>

#if PREFIRE_WITH_CUDA
#include "cuda/prefire_stream.h"

#include <c10/core/Event.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda_runtime_api.h>

#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>
#endif

namespace prefire::detail {

#if PREFIRE_WITH_CUDA
namespace {

// The copy stream of a device: made once per process and never destroyed
// (the caching allocator records events on it when a storage marked as used
// there is freed, which may be after every tier is gone).
c10::cuda::CUDAStream copy_stream(c10::DeviceIndex index) {
  static std::mutex mu;
  static auto* streams = new std::map<c10::DeviceIndex, c10::cuda::CUDAStream>();  // never destroyed
  std::lock_guard<std::mutex> lock(mu);
  auto found = streams->find(index);
  if (found != streams->end()) return found->second;
  c10::cuda::CUDAGuard device(index);
  cudaStream_t raw = nullptr;
  C10_CUDA_CHECK(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking));
  return streams->emplace(index, c10::cuda::getStreamFromExternal(raw, index)).first->second;
}

// A copy queued on a stream: done when the event recorded after it is.
class StreamCopy final : public Copy {
 public:
  explicit StreamCopy(const c10::cuda::CUDAStream& stream) { event_.record(stream.unwrap()); }
  void wait() const override { event_.synchronize(); }
  bool done() const override { return event_.query(); }
  /// Makes `stream` wait for the copy.
  void order_before(const c10::cuda::CUDAStream& stream) const { event_.block(stream.unwrap()); }

 private:
  c10::Event event_{c10::DeviceType::CUDA};
};

class PinnedHostStore final : public TierStore {
 public:
  explicit PinnedHostStore(int64_t capacity) : TierStore(capacity, "of pinned host memory") {
    if (!cuda_available()) {
      throw CheckpointError("prefire: the pinned host offload tier takes CUDA tensors, and no CUDA device is "
                            "visible to this process. Use OffloadTier::host_file for CPU tensors");
    }
    void* base = nullptr;
    const cudaError_t error = cudaHostAlloc(&base, static_cast<size_t>(space().capacity()), cudaHostAllocPortable);
    if (error != cudaSuccess) {
      (void)cudaGetLastError();  // not sticky: clear it for the next call
      throw CheckpointError(c10::str("prefire: cannot pin ", space().capacity(), " bytes of host memory for the "
                                     "offload tier: ", cudaGetErrorString(error), ". Ask for less"));
    }
    base_ = static_cast<char*>(base);
  }

  ~PinnedHostStore() override {
    try {
      reclaim(/*wait=*/true);
    } catch (...) {  // teardown never throws; the memory is freed below whatever the device says
    }
    (void)cudaFreeHost(base_);  // waits for the device; fails harmlessly once the runtime is unloading
  }

  ReadBack read(const std::vector<StorageCopy>& copies, bool queued) override {
    ReadBack back;
    if (copies.empty()) return back;
    std::optional<PrefireRun> run;  // a prefetch: on the prefire stream (Note [The pinned host tier])
    if (queued) run.emplace(copies.front().device, std::vector<at::Tensor>{});
    back.in_pool = run && run->in_pool();
    for (const StorageCopy& copy : copies) {
      const c10::DeviceIndex index = copy.device.index();
      c10::cuda::CUDAGuard device(index);
      const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(index);
      back.storages.emplace_back(c10::Storage::use_byte_size_t(), copy.nbytes,
                                 c10::cuda::CUDACachingAllocator::get(), /*resizable=*/false);
      if (!copy.region) continue;
      static_cast<const StreamCopy&>(*copy.written).order_before(stream);
      C10_CUDA_CHECK(cudaMemcpyAsync(back.storages.back().mutable_data(), base_ + copy.region->offset,
                                     static_cast<size_t>(copy.nbytes), cudaMemcpyHostToDevice, stream.stream()));
      count_read(copy.nbytes);
      remember(std::make_shared<StreamCopy>(stream), copy.region);
    }
    if (run) back.ready = run->finish();
    return back;
  }

  void synchronize() override { reclaim(/*wait=*/true); }

 protected:
  const char* refuses_device(const at::Tensor& t) const override {
    return t.is_cuda() ? nullptr : "it is not on a CUDA device (the pinned host tier takes CUDA tensors)";
  }

  std::shared_ptr<Copy> write(c10::Storage storage, std::shared_ptr<Region> region) override {
    const c10::DeviceIndex index = storage.device().index();
    c10::cuda::CUDAGuard device(index);
    const c10::cuda::CUDAStream copier = copy_stream(index);
    c10::Event produced(c10::DeviceType::CUDA);
    produced.record(c10::cuda::getCurrentCUDAStream(index).unwrap());
    produced.block(copier.unwrap());
    C10_CUDA_CHECK(cudaMemcpyAsync(base_ + region->offset, storage.data(), static_cast<size_t>(region->nbytes),
                                   cudaMemcpyDeviceToHost, copier.stream()));
    auto written = std::make_shared<StreamCopy>(copier);
    count_written(region->nbytes);
    if (prefire_running_here(index)) {  // a use recorded in this thread's window would not outlive it
      remember(written, std::move(region), std::move(storage));
    } else {
      record_stream_use(storage, copier.unwrap());  // its memory is reused once the copy is done
      remember(written, std::move(region));
    }
    return written;
  }

  // In queue order, up to the first copy not done (without `wait`): a
  // forward's pack pays for the copies done since the last one, not for every
  // copy still queued.
  void reclaim(bool wait) override {
    std::deque<Pending> finished;  // their regions go back to the space as this goes
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (wait) {
        finished.swap(pending_);
      } else {
        while (!pending_.empty() && pending_.front().copy->done()) {
          finished.push_back(std::move(pending_.front()));
          pending_.pop_front();
        }
      }
    }
    for (const Pending& p : finished) p.copy->wait();
  }

  c10::Storage scratch_storage(int64_t nbytes) override {
    const c10::DeviceIndex index = c10::cuda::current_device();
    c10::cuda::CUDAGuard device(index);
    c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, c10::cuda::CUDACachingAllocator::get(),
                         /*resizable=*/false);
    C10_CUDA_CHECK(cudaMemsetAsync(storage.mutable_data(), 0, static_cast<size_t>(nbytes),
                                   c10::cuda::getCurrentCUDAStream(index).stream()));
    return storage;
  }

 private:
  struct Pending {  // a copy not known to be done, the region it uses, and the storage it reads, if held
    std::shared_ptr<StreamCopy> copy;
    std::shared_ptr<Region> region;
    c10::Storage storage;
  };

  void remember(std::shared_ptr<StreamCopy> copy, std::shared_ptr<Region> region, c10::Storage storage = {}) {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.push_back(Pending{std::move(copy), std::move(region), std::move(storage)});
  }

  char* base_ = nullptr;
  std::mutex mu_;  // guards pending_
  std::deque<Pending> pending_;
};

}  // namespace

std::unique_ptr<TierStore> make_pinned_host_store(int64_t capacity) {
  return std::make_unique<PinnedHostStore>(capacity);
}

#else  // !PREFIRE_WITH_CUDA

std::unique_ptr<TierStore> make_pinned_host_store(int64_t) {
  throw CheckpointError("prefire: the pinned host offload tier needs prefire's CUDA parts, and this build has none "
                        "(configure with a CUDA build of torch and nvcc, PREFIRE_CUDA=ON). Use "
                        "OffloadTier::host_file for CPU tensors");
}

#endif

}  // namespace prefire::detail
