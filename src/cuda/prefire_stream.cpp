// See Note [Stream ordering of prefire] in prefire_stream.h.

#include "prefire_stream.h"

#include <prefire/cuda.h>

#include "../../profiling/nvtx.h"
#include "session_pool.h"

#include <atomic>

#if PREFIRE_WITH_CUDA
#include <c10/core/Event.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <vector>
#endif

namespace prefire {
namespace detail {
namespace {
std::atomic<int> g_stream_priority{0};
}

#if PREFIRE_WITH_CUDA

namespace {

struct DeviceStreams {
  std::mutex run_mu;  // one prefire at a time per device: pool routing cannot nest
  std::optional<c10::cuda::CUDAStream> stream;
};

// Devices with a prefire run open on this thread: a prefire started from
// inside another's recomputation (its function prefires another checkpoint)
// runs inside the outer run's stream and pool window.
thread_local std::vector<c10::DeviceIndex> tls_open_runs;

DeviceStreams& streams_of(c10::DeviceIndex device) {
  static std::mutex mu;
  static auto* all = new std::map<c10::DeviceIndex, DeviceStreams>();  // never destroyed
  std::lock_guard<std::mutex> lock(mu);
  return (*all)[device];
}

class CudaReadyEvent final : public ReadyEvent {
 public:
  explicit CudaReadyEvent(const c10::cuda::CUDAStream& producer) { event_.record(producer.unwrap()); }

  void hand_over(const at::Tensor& t) override {
    if (!t.is_cuda()) return;
    PREFIRE_NVTX_RANGE("prefire::wait_prefire_event", -1);
    auto consumer = c10::cuda::getCurrentCUDAStream(t.device().index());
    event_.block(consumer.unwrap());
    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), consumer);
  }

 private:
  c10::Event event_{c10::DeviceType::CUDA};
};

}  // namespace

struct PrefireRun::Impl {
  c10::DeviceIndex device;
  DeviceStreams& streams;
  const bool nested;
  std::unique_lock<std::mutex> run_lock;
  c10::MempoolId_t pool;
  std::optional<c10::cuda::CUDAStreamGuard> guard;
  bool routing = false;

  explicit Impl(c10::DeviceIndex d)
      : device(d),
        streams(streams_of(d)),
        nested(std::find(tls_open_runs.begin(), tls_open_runs.end(), d) != tls_open_runs.end()) {
    if (nested) {  // the outer run's stream, guard and pool window serve this one
      tls_open_runs.push_back(device);
      return;
    }
    run_lock = std::unique_lock<std::mutex>(streams.run_mu);
    if (!streams.stream) streams.stream = c10::cuda::getStreamFromPool(g_stream_priority.load(), device);
    c10::cuda::CUDAStream prefire_stream = *streams.stream;
    // The inputs the caller produced are ready once the caller's stream reaches this point.
    c10::Event inputs_ready(c10::DeviceType::CUDA);
    inputs_ready.record(c10::cuda::getCurrentCUDAStream(device).unwrap());
    inputs_ready.block(prefire_stream.unwrap());
    pool = session_pool(device);
    cudaStream_t raw = prefire_stream.stream();
    c10::cuda::CUDACachingAllocator::beginAllocateToPool(device, pool, [raw](cudaStream_t s) { return s == raw; });
    routing = true;
    guard.emplace(prefire_stream);
    tls_open_runs.push_back(device);
  }

  ~Impl() {
    tls_open_runs.erase(std::find(tls_open_runs.begin(), tls_open_runs.end(), device));
    guard.reset();
    if (routing) {
      try {
        c10::cuda::CUDACachingAllocator::endAllocateToPool(device, pool);
        c10::cuda::CUDACachingAllocator::releasePool(device, pool);  // this run's reference
      } catch (...) {  // teardown never throws
      }
    }
  }
};

PrefireRun::PrefireRun(std::optional<c10::Device> device) {
  if (device && device->is_cuda()) impl_ = std::make_unique<Impl>(device->index());
}

PrefireRun::~PrefireRun() = default;

void PrefireRun::use(const at::Tensor& t) {
  if (!impl_ || !t.defined() || !t.is_cuda() || !t.has_storage()) return;
  c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), *impl_->streams.stream);
}

std::shared_ptr<ReadyEvent> PrefireRun::finish() {
  if (!impl_) return nullptr;
  return std::make_shared<CudaReadyEvent>(*impl_->streams.stream);
}

#else  // !PREFIRE_WITH_CUDA

struct PrefireRun::Impl {};
PrefireRun::PrefireRun(std::optional<c10::Device>) {}
PrefireRun::~PrefireRun() = default;
void PrefireRun::use(const at::Tensor&) {}
std::shared_ptr<ReadyEvent> PrefireRun::finish() { return nullptr; }

#endif

}  // namespace detail

void set_prefire_stream_priority(int priority) { detail::g_stream_priority.store(priority); }

}  // namespace prefire
