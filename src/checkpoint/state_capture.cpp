#include "checkpoint/state_capture.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <type_traits>

namespace prefire::detail {
namespace {

at::Generator generator_for(c10::Device device) {
  return at::globalContext().defaultGenerator(device);
}

at::Tensor read_state(c10::Device device) {
  auto gen = generator_for(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void write_state(c10::Device device, const at::Tensor& state) {
  auto gen = generator_for(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

CpuRngState read_cpu_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  auto* impl = at::check_generator<at::CPUGeneratorImpl>(gen);
  return CpuRngState{impl->engine(), impl->next_float_normal_sample(), impl->next_double_normal_sample()};
}

void write_cpu_state(const CpuRngState& state) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  auto* impl = at::check_generator<at::CPUGeneratorImpl>(gen);
  impl->set_engine(state.engine);
  impl->set_next_float_normal_sample(state.next_float_normal);
  impl->set_next_double_normal_sample(state.next_double_normal);
}

// Asked once: c10 counts the devices once per process too
// (c10::cuda::device_count() caches its answer). ATen says whether a device
// is here; the guard registry's may be a fake (Note [Asking ATen, not the
// device guard, whether CUDA is here] in src/cuda/session_pool.cpp).
const c10::impl::DeviceGuardImplInterface* cuda_guard_impl() {
  static const c10::impl::DeviceGuardImplInterface* const impl = []() -> const c10::impl::DeviceGuardImplInterface* {
    if (!at::hasCUDA() || !c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA)) return nullptr;
    return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  }();
  return impl;
}

std::optional<c10::Device> current_cuda_device() {
  const auto* impl = cuda_guard_impl();
  if (impl == nullptr) return std::nullopt;
  return impl->getDevice();
}

}  // namespace

AutocastState AutocastState::current() {
  AutocastState s;
  s.cpu_enabled = at::autocast::is_autocast_enabled(at::kCPU);
  s.cpu_dtype = at::autocast::get_autocast_dtype(at::kCPU);
  s.cuda_enabled = at::autocast::is_autocast_enabled(at::kCUDA);
  s.cuda_dtype = at::autocast::get_autocast_dtype(at::kCUDA);
  s.cache_enabled = at::autocast::is_autocast_cache_enabled();
  return s;
}

void AutocastState::apply() const {
  at::autocast::set_autocast_enabled(at::kCPU, cpu_enabled);
  at::autocast::set_autocast_dtype(at::kCPU, cpu_dtype);
  at::autocast::set_autocast_enabled(at::kCUDA, cuda_enabled);
  at::autocast::set_autocast_dtype(at::kCUDA, cuda_dtype);
  at::autocast::set_autocast_cache_enabled(cache_enabled);
}

bool CpuRngState::same_as(const CpuRngState& other) const {
  static_assert(std::is_trivially_copyable_v<at::mt19937>);
  return std::memcmp(&engine, &other.engine, sizeof(at::mt19937)) == 0 &&
         next_float_normal == other.next_float_normal && next_double_normal == other.next_double_normal;
}

// RngState's are built around the state read, never default-constructed
// first: a default at::mt19937 seeds itself (624 multiplications, ~1 us).
std::shared_ptr<const RngState> RngState::capture(const std::vector<at::Tensor>& inputs) {
  RngState s{read_cpu_state(), {}};
  for (const auto& t : inputs) {
    if (!t.defined() || !t.is_cuda()) continue;
    c10::Device d = t.device();
    bool seen = std::any_of(s.devices.begin(), s.devices.end(),
                            [&](const auto& entry) { return entry.first == d; });
    if (!seen) s.devices.emplace_back(d, read_state(d));
  }
  if (!s.devices.empty()) return std::make_shared<const RngState>(std::move(s));
  // See Note [Generator snapshots].
  thread_local std::shared_ptr<const RngState> last;
  if (!last || !last->cpu.same_as(s.cpu)) last = std::make_shared<const RngState>(std::move(s));
  return last;
}

RngState RngState::capture_like(const RngState& like) {
  RngState s{read_cpu_state(), {}};
  for (const auto& entry : like.devices) s.devices.emplace_back(entry.first, read_state(entry.first));
  return s;
}

void RngState::apply() const {
  write_cpu_state(cpu);
  for (const auto& [device, state] : devices) write_state(device, state);
}

CapturedState CapturedState::capture(const std::vector<at::Tensor>& inputs, bool preserve_rng) {
  CapturedState s;
  if (preserve_rng) s.rng = RngState::capture(inputs);
  s.autocast = AutocastState::current();
  s.cuda_device = current_cuda_device();
  s.intra_op_threads = at::get_num_threads();
  return s;
}

void CapturedState::drop_rng_if_unused() {
  if (rng && rng->devices.empty() && rng->cpu.same_as(read_cpu_state())) rng.reset();
}

std::unique_lock<std::recursive_mutex> lock_generators() {
  static std::recursive_mutex mu;
  return std::unique_lock<std::recursive_mutex>(mu);
}

StateRestoreGuard::StateRestoreGuard(const CapturedState& state)
    : saved_autocast_(AutocastState::current()) {
  if (state.rng) saved_rng_ = RngState::capture_like(*state.rng);
  if (state.cuda_device) saved_device_ = current_cuda_device();
  try {
    if (state.rng) state.rng->apply();
    if (state.cuda_device) cuda_guard_impl()->setDevice(*state.cuda_device);
    if (const int threads = at::get_num_threads(); threads != state.intra_op_threads) {
      saved_threads_ = threads;
      at::set_num_threads(state.intra_op_threads);
    }
    state.autocast.apply();
    // See Note [Autocast's cast cache in recomputation].
    at::autocast::set_autocast_cache_enabled(false);
  } catch (...) {
    restore();
    throw;
  }
}

StateRestoreGuard::~StateRestoreGuard() { restore(); }

void StateRestoreGuard::restore() noexcept {
  // Teardown never throws: try every step, report what failed.
  saved_autocast_.apply();  // thread-local setters; cannot fail
  if (saved_device_) cuda_guard_impl()->uncheckedSetDevice(*saved_device_);
  if (saved_threads_) {
    try {
      at::set_num_threads(*saved_threads_);
    } catch (...) {  // a positive count it read itself: cannot fail in practice
    }
  }
  if (saved_rng_) {
    try {
      saved_rng_->apply();
    } catch (const std::exception& e) {
      try {
        TORCH_WARN("prefire: could not restore the generator state after a recomputation: ", e.what());
      } catch (...) {  // a warning handler that throws must not escape a restore
      }
    } catch (...) {
    }
  }
}

}  // namespace prefire::detail
