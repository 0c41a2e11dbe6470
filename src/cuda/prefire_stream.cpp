// See Note [Stream ordering of prefire] in prefire_stream.h.

#include "cuda/prefire_stream.h"

#include <prefire/cuda.h>

#include "cuda/session_pool.h"
#include "profiling/nvtx.h"

#include <atomic>

#if PREFIRE_WITH_CUDA
#include <prefire/cuda_stream.h>

#include <ATen/ops/mm.h>
#include <ATen/ops/ones.h>
#include <c10/core/Event.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/macros/Export.h>

#include <algorithm>
#include <map>
#include <mutex>

// Declared as in <ATen/cuda/CUDAContextLight.h>, which cannot be included
// here: it needs the CUDA toolkit's cuSPARSE and cuSOLVER headers, and a build
// against torch's wheels has only the runtime's. libtorch_cuda exports it with
// this signature in every torch prefire builds against (2.11 to 2.14).
namespace at::cuda {
TORCH_CUDA_CPP_API void* getCUDABlasLtWorkspace();
}  // namespace at::cuda
#endif

namespace prefire {
namespace detail {
namespace {
std::atomic<int> g_stream_priority{0};
}

#if PREFIRE_WITH_CUDA

namespace {

struct Device {
  std::once_flag created;
  std::optional<c10::cuda::CUDAStream> stream;
  // Held while allocations are routed to the session pool; recordStream
  // calls of unpacks take it too (see the Note, step 4).
  std::mutex window_mu;
};

// Runs open on this thread, by device: a prefire started from inside
// another's recomputation (its function prefires another checkpoint) runs
// inside the outermost run's stream and window and shares its pool lease, and
// an unpack there must not wait for its own window.
struct OpenRun {
  c10::DeviceIndex device;
  std::shared_ptr<PoolLease> lease;
};
thread_local std::vector<OpenRun> tls_open_runs;

const OpenRun* open_here(c10::DeviceIndex d) {
  auto it = std::find_if(tls_open_runs.begin(), tls_open_runs.end(), [&](const OpenRun& r) { return r.device == d; });
  return it == tls_open_runs.end() ? nullptr : &*it;
}

Device& device_state(c10::DeviceIndex index) {
  static std::mutex mu;
  static auto* all = new std::map<c10::DeviceIndex, Device>();  // never destroyed
  std::lock_guard<std::mutex> lock(mu);
  return (*all)[index];
}

c10::cuda::CUDAStream create_stream(c10::DeviceIndex index) {
  c10::cuda::CUDAGuard device(index);
  int least = 0, greatest = 0;
  C10_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  const int priority = std::clamp(g_stream_priority.load(), greatest, least);
  cudaStream_t raw = nullptr;
  C10_CUDA_CHECK(cudaStreamCreateWithPriority(&raw, cudaStreamNonBlocking, priority));
  return c10::cuda::getStreamFromExternal(raw, index);  // lives as long as the process
}

// cuBLAS and cuBLASLt keep a workspace per (handle, stream), and handles are
// per thread: the first GEMM of a thread on the prefire stream allocates them.
// Made here, before the thread's first window, they land in the general pool
// instead of a session pool, which they would pin for good. The cuBLASLt
// workspace is asked for by name: whether a linear layer's addmm takes
// cuBLASLt depends on its shapes and the torch version, so a warm-up GEMM
// might not create it.
void warm_cublas(const c10::cuda::CUDAStream& stream) {
  thread_local std::vector<c10::DeviceIndex> warmed;
  if (std::find(warmed.begin(), warmed.end(), stream.device_index()) != warmed.end()) return;
  c10::cuda::CUDAStreamGuard on(stream);
  auto a = at::ones({16, 16}, at::TensorOptions().device(at::kCUDA, stream.device_index()));
  at::mm(a, a);                        // cuBLAS: this thread's handle and its workspace for the stream
  at::cuda::getCUDABlasLtWorkspace();  // cuBLASLt's (or cuBLAS's, where torch unifies the two)
  warmed.push_back(stream.device_index());
}

Device& ready_device(c10::DeviceIndex index) {
  Device& d = device_state(index);
  std::call_once(d.created, [&] { d.stream = create_stream(index); });
  return d;
}

// Marks `storage` as used on `stream` (step 4 of the Note), under `device`'s
// window lock unless this thread has that window open.
void record_use(const c10::Storage& storage, const c10::cuda::CUDAStream& stream, Device& device) {
  std::unique_lock<std::mutex> window;
  if (!open_here(storage.device().index())) window = std::unique_lock<std::mutex>(device.window_mu);
  c10::cuda::CUDACachingAllocator::recordStream(storage.data_ptr(), stream);
}

class CudaReadyEvent final : public ReadyEvent {
 public:
  CudaReadyEvent(const c10::cuda::CUDAStream& producer, Device& device, std::shared_ptr<PoolLease> lease)
      : device_(device), lease_(std::move(lease)) {
    event_.record(producer.unwrap());
  }

  void hand_over(const at::Tensor& t) override {
    if (!t.is_cuda()) return;
    PREFIRE_NVTX_RANGE("prefire::wait_prefire_event", -1);
    const c10::DeviceIndex index = t.device().index();
    auto consumer = c10::cuda::getCurrentCUDAStream(index);
    event_.block(consumer.unwrap());
    record_use(t.storage(), consumer, device_);  // the prefire's tensors live on its stream's device
  }

 private:
  c10::Event event_{c10::DeviceType::CUDA};
  Device& device_;                     // never destroyed (device_state)
  std::shared_ptr<PoolLease> lease_;  // the pool the tensors live in, while they are held
};

}  // namespace

bool prefire_running_here(c10::DeviceIndex device) { return open_here(device) != nullptr; }

void record_stream_use(const c10::Storage& storage, const c10::Stream& stream) {
  record_use(storage, c10::cuda::CUDAStream(stream), device_state(storage.device().index()));
}

struct PrefireRun::Impl {
  c10::DeviceIndex index;
  Device& device;
  c10::cuda::CUDAStream stream;
  std::shared_ptr<PoolLease> lease;  // set while the window routes to the pool
  std::unique_lock<std::mutex> window;
  std::optional<c10::cuda::CUDAStreamGuard> guard;
  bool routing = false;
  bool registered = false;

  Impl(c10::DeviceIndex i, const std::vector<at::Tensor>& inputs)
      : index(i), device(ready_device(i)), stream(*device.stream) {
    if (const OpenRun* outer = open_here(index)) {  // nested: the outer run's stream and window serve this one
      lease = outer->lease;
      tls_open_runs.push_back(OpenRun{index, lease});
      registered = true;
      return;
    }
    // (1) Ordered after the caller's stream; inputs used on the prefire stream.
    c10::Event inputs_ready(c10::DeviceType::CUDA);
    inputs_ready.record(c10::cuda::getCurrentCUDAStream(index).unwrap());
    inputs_ready.block(stream.unwrap());
    for (const auto& t : inputs) {
      if (t.defined() && t.is_cuda() && t.has_storage()) {
        c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream);
      }
    }
    // (2) The window.
    if (session_pool_enabled()) {
      warm_cublas(stream);
      lease = PoolLease::acquire(index);
      window = std::unique_lock<std::mutex>(device.window_mu);
      cudaStream_t raw = stream.stream();
      c10::cuda::CUDACachingAllocator::beginAllocateToPool(index, lease->pool(),
                                                           [raw](cudaStream_t s) { return s == raw; });
      routing = true;
    }
    guard.emplace(stream);
    tls_open_runs.push_back(OpenRun{index, lease});
    registered = true;
  }

  void close() noexcept {
    if (registered) {
      auto last = std::find_if(tls_open_runs.rbegin(), tls_open_runs.rend(),
                               [&](const OpenRun& r) { return r.device == index; });
      tls_open_runs.erase(std::next(last).base());
      registered = false;
    }
    guard.reset();
    if (routing) {
      routing = false;
      try {
        c10::cuda::CUDACachingAllocator::endAllocateToPool(index, lease->pool());
        c10::cuda::CUDACachingAllocator::releasePool(index, lease->pool());  // beginAllocateToPool's reference
      } catch (...) {  // teardown never throws
      }
    }
    if (window.owns_lock()) window.unlock();
  }

  ~Impl() { close(); }
};

PrefireRun::PrefireRun(std::optional<c10::Device> device, const std::vector<at::Tensor>& inputs) {
  if (device && device->is_cuda()) impl_ = std::make_unique<Impl>(device->index(), inputs);
}

PrefireRun::~PrefireRun() = default;

bool PrefireRun::in_pool() const { return impl_ && impl_->lease != nullptr; }

std::shared_ptr<ReadyEvent> PrefireRun::finish() {
  if (!impl_) return nullptr;
  impl_->close();  // (3)
  return std::make_shared<CudaReadyEvent>(impl_->stream, impl_->device, impl_->lease);
}

#else  // !PREFIRE_WITH_CUDA

void record_stream_use(const c10::Storage&, const c10::Stream&) {}
bool prefire_running_here(c10::DeviceIndex) { return false; }
struct PrefireRun::Impl {};
PrefireRun::PrefireRun(std::optional<c10::Device>, const std::vector<at::Tensor>&) {}
PrefireRun::~PrefireRun() = default;
bool PrefireRun::in_pool() const { return false; }
std::shared_ptr<ReadyEvent> PrefireRun::finish() { return nullptr; }

#endif

}  // namespace detail

#if PREFIRE_WITH_CUDA
c10::cuda::CUDAStream prefire_stream(c10::DeviceIndex device) { return *detail::ready_device(device).stream; }
#endif

void set_prefire_stream_priority(int priority) { detail::g_stream_priority.store(priority); }

}  // namespace prefire
