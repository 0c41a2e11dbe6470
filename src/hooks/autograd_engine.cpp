// Note [How C++ gets saved-tensor hooks]
// LibTorch has no public C++ `saved_tensors_hooks`. SavedVariable asks the
// default autograd engine for hooks every time autograd saves a tensor
// (Engine::get_default_saved_variable_hooks, a virtual), and
// set_default_engine_stub() replaces the default engine. prefire installs a
// subclass whose override hands out hooks while a checkpoint is active on the
// calling thread (see Note [One stack of hook contexts]) and nullptr
// otherwise, so a saved tensor outside checkpoints costs one thread-local read.
//
// Limitations: the engine must be installed before the first backward (the
// base engine's worker threads keep serving the base engine). It replaces
// only torch's base engine: when another engine is the default (PyTorch's
// Python engine, installed when torch is imported into a Python process, or
// another library's), install() refuses. Replacing it would silently switch
// off everything that engine does; Python's saved_tensors_hooks, for one.

#include <prefire/install.h>

#include "hooks/autograd_engine.h"
#include "hooks/hook_stack.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>

#include <atomic>
#include <mutex>
#include <stdexcept>

namespace prefire {
namespace detail {
namespace {

// Adapts the frame logic's PackedTensor to autograd's SavedVariableHooks.
class EngineHooks final : public torch::autograd::SavedVariableHooks {
 public:
  explicit EngineHooks(HookContext* context) : context_(context) {}

  // SavedVariable calls this once, right after asking for the hooks, on the
  // same thread: `context_` is still the innermost context.
  void call_pack_hook(const at::Tensor& tensor) override {
    TORCH_INTERNAL_ASSERT(context_ != nullptr && !packed_);
    packed_ = context_->pack(tensor);
    context_ = nullptr;
  }

  at::Tensor call_unpack_hook() override {
    TORCH_INTERNAL_ASSERT(packed_, "unpack before pack");
    return packed_->unpack();
  }

 private:
  HookContext* context_;
  std::unique_ptr<PackedTensor> packed_;
};

class PrefireEngine final : public torch::autograd::Engine {
 public:
  static PrefireEngine& instance() {
    static PrefireEngine engine;
    return engine;
  }
  static torch::autograd::Engine& stub() { return instance(); }

  ~PrefireEngine() override { stop(); }  // the base engine's rule for subclasses

  std::unique_ptr<torch::autograd::SavedVariableHooks> get_default_saved_variable_hooks() override {
    HookContext* context = current_hook_context();
    if (context == nullptr) return nullptr;
    return std::make_unique<EngineHooks>(context);
  }

 private:
  PrefireEngine() = default;
};

std::atomic<bool> g_installed{false};

}  // namespace

void queue_graph_task_callback(std::function<void()> callback) {
  torch::autograd::Engine::get_default_engine().queue_callback(std::move(callback));
}

int64_t current_graph_task_id() { return torch::autograd::get_current_graph_task_id(); }

}  // namespace detail

void install() {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (detail::g_installed.load(std::memory_order_relaxed)) return;
  using torch::autograd::Engine;
  if (&Engine::get_default_engine() != &Engine::get_base_engine()) {
    throw std::logic_error(
        "prefire::install: the process's default autograd engine is not torch's base engine (inside a Python "
        "process it is PyTorch's Python engine); prefire will not replace it, since that would switch off what "
        "it does. In Python, use the prefire Python package; in C++, call prefire::install() before anything "
        "else installs an engine");
  }
  torch::autograd::set_default_engine_stub(&detail::PrefireEngine::stub);
  detail::g_installed.store(true, std::memory_order_release);
}

bool is_installed() {
  if (detail::hook_source() != nullptr) return true;  // the Python package's hooks
  return detail::g_installed.load(std::memory_order_acquire) &&
         &torch::autograd::Engine::get_default_engine() == &detail::PrefireEngine::instance();
}

}  // namespace prefire
