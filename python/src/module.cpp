// prefire._C: the C++ runtime in a Python process.
//
// Note [Hooks in a Python process]
// In a Python process the autograd engine is PyTorch's Python engine, and
// prefire must not replace it (install() refuses). That engine asks
// torch's stack of default saved-tensor hooks (what
// torch.autograd.graph.saved_tensors_hooks pushes) for the hooks of every
// saved tensor. So the module installs a HookSource (prefire/detail/hooks.h): whenever a
// hook context scope opens on a thread (a checkpoint's forward, a
// recomputation, a SavedTensorMeter), it pushes one pair of hooks onto torch's
// stack, and pops it when the scope ends. The pair is two C++ functions
// (Note [The hooks are plain CPython functions]): pack hands the tensor to
// current_hook_context() and returns the PackedTensor in a capsule (Note
// [Packed tensors as capsules]); unpack unwraps and unpacks it. No Python code of prefire's
// runs per saved tensor. Each scope's end pops the top pair of torch's
// stack: scopes end in LIFO order (the one exception, a SavedTensorMeter
// stopped out of order, is C++ API only), and hooks a user pushes inside a
// checkpoint are popped by the user first.
//
// The GIL: the checkpointed function is Python, run from C++ (forward, lazy
// recomputation inside an unpack hook, prefire) under the GIL. Everything that
// can wait for another thread (an unpack waiting for a recomputation another
// thread runs, prefire, a session's clear) releases the GIL while it waits,
// and the function's wrapper takes it again to call Python; otherwise a thread
// waiting in C++ with the GIL would block the thread it waits for.
//
// Early stop crosses Python frames: the pack hook turns StopRecompute into a
// Python exception of a private BaseException subclass (user code catching
// Exception lets it through), and the function's wrapper turns it back.

#include <prefire/prefire.h>

#include "bindings.h"

#include <prefire/detail/hooks.h>

#include <ATen/SavedTensorHooks.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <pybind11/functional.h>
#include <pybind11/stl.h>

#if PREFIRE_WITH_CUDA
#include <prefire/cuda_stream.h>
#endif

#include <chrono>
#include <initializer_list>

#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

namespace py = pybind11;

namespace prefire::python {
namespace {

// ---- hooks ------------------------------------------------------------------

// Note [Packed tensors as capsules]
// The pack hook returns the PackedTensor to autograd in a PyCapsule, whose
// destructor deletes it when autograd drops the saved tensor. A pybind11
// class did the same at more cost: every instance is allocated as a pybind11
// object and registered in pybind11's process-wide instance map, which a
// Python process shares with torch's own bindings. On a 2-core x86 machine
// the tiny block's per-call overhead was ~98 us with the class and ~90 us
// with capsules (eight packed tensors per call); perf had put ~3 us of it in
// the instance map's lookups alone.
constexpr const char* kPackedCapsule = "prefire._Packed";

void destroy_packed(PyObject* capsule) {
  delete static_cast<detail::PackedTensor*>(PyCapsule_GetPointer(capsule, kPackedCapsule));
}

PyObject* g_stop_type = nullptr;        // _RecomputationStopped, owned by the module
PyObject* g_checkpoint_error = nullptr;  // prefire.CheckpointError, owned by the module
py::function* g_pack = nullptr;          // the hook pair; leaked: hooks may run at exit
py::function* g_unpack = nullptr;

// Note [The hooks are plain CPython functions]
// torch calls the pair once per saved tensor, in forward and in every pass
// of backward. As pybind11 cpp_functions each call paid pybind11's
// dispatcher (its function_call record, argument loaders, the internals
// lookup): on a 2-core x86 machine about 0.6 us a call (a 20-tensor
// checkpoint packed once and unpacked in B and W: ~50 us less a step of
// ~980). They are METH_O functions instead; what pybind11 did for
// them is written out here: the argument's type checked, the errors turned
// into Python exceptions (early stop into _RecomputationStopped, a
// CheckpointError into prefire.CheckpointError, a Python error restored,
// anything else as torch's bindings turn it).
template <typename F>
PyObject* python_call(F&& f) noexcept {
  try {
    return f();
  } catch (const detail::StopRecompute&) {
    PyErr_SetNone(g_stop_type);
  } catch (const CheckpointError& e) {
    PyErr_SetString(g_checkpoint_error, e.what());
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (...) {
    torch::translate_exception_to_python(std::current_exception());
  }
  return nullptr;
}

PyObject* pack(PyObject* /*self*/, PyObject* arg) {
  return python_call([arg]() -> PyObject* {
    if (!THPVariable_Check(arg)) {
      PyErr_Format(PyExc_TypeError, "prefire: its pack hook takes a tensor, got %s", Py_TYPE(arg)->tp_name);
      return nullptr;
    }
    detail::HookContext* context = detail::current_hook_context();
    if (context == nullptr) {
      throw CheckpointError("prefire: its saved-tensor hook ran outside any checkpoint (hooks pushed by prefire "
                            "were left on torch's hook stack)");
    }
    std::unique_ptr<detail::PackedTensor> packed = context->pack(THPVariable_Unpack(arg));
    PyObject* capsule = PyCapsule_New(packed.get(), kPackedCapsule, &destroy_packed);
    if (capsule != nullptr) packed.release();  // the capsule owns it now
    return capsule;
  });
}

PyObject* unpack(PyObject* /*self*/, PyObject* arg) {
  return python_call([arg]() -> PyObject* {
    auto* packed = static_cast<detail::PackedTensor*>(PyCapsule_GetPointer(arg, kPackedCapsule));
    if (packed == nullptr) return nullptr;  // not what pack returned: PyCapsule_GetPointer set the error
    at::Tensor tensor;
    {
      py::gil_scoped_release no_gil;  // a recomputation may wait for another thread
      tensor = packed->unpack();
    }
    return THPVariable_Wrap(std::move(tensor));
  });
}

PyMethodDef g_hook_defs[] = {
    {"_pack_hook", pack, METH_O, "prefire's saved-tensor pack hook"},
    {"_unpack_hook", unpack, METH_O, "prefire's saved-tensor unpack hook"},
};

class PythonHooks final : public detail::HookSource {
 public:
  // What torch.autograd.graph.saved_tensors_hooks does on enter and exit
  // (SafePyObject steals a reference; dropping one takes the GIL itself).
  void enter() override {
    py::gil_scoped_acquire gil;
    at::SavedTensorDefaultHooks::lazy_initialize();
    at::SavedTensorDefaultHooks::push_hooks(c10::SafePyObject(g_pack->inc_ref().ptr(), getPyInterpreter()),
                                            c10::SafePyObject(g_unpack->inc_ref().ptr(), getPyInterpreter()));
  }
  void leave() noexcept override {
    try {
      at::SavedTensorDefaultHooks::pop_hooks();
    } catch (...) {  // teardown never throws
    }
  }
};

// ---- the checkpointed function and context hooks -----------------------------

// Note [A Python object released after Python ended]
// C++ keeps Python objects in places that outlive the interpreter: the
// recompute observer (prefire.set_recompute_observer) lives in a C++ static,
// destroyed by the process's exit handlers after Py_Finalize. Dropping the
// reference there took the GIL of an interpreter that no longer exists and
// crashed every process that exited with an observer set (a segfault in
// PyThread_acquire_lock at exit, seen from gdb's native frames). Once
// Python is finalizing or gone, the reference is left, as Python leaves
// the objects it does not free at exit.

bool python_ended() {
#if PY_VERSION_HEX >= 0x030D0000
  return !Py_IsInitialized() || Py_IsFinalizing();
#else
  return !Py_IsInitialized() || _Py_IsFinalizing();
#endif
}

/// A Python object that may be released on any thread: takes the GIL to drop
/// its reference (Note [A Python object released after Python ended]).
std::shared_ptr<py::object> hold(py::object object) {
  return std::shared_ptr<py::object>(new py::object(std::move(object)), [](py::object* o) {
    if (python_ended()) {
      o->release();
      delete o;
      return;
    }
    py::gil_scoped_acquire gil;
    delete o;
  });
}

CheckpointFn wrap_function(py::function run) {
  auto fn = hold(std::move(run));
  return [fn](const TensorList& inputs) -> TensorList {
    py::gil_scoped_acquire gil;
    try {
      return (*fn)(inputs).cast<TensorList>();
    } catch (py::error_already_set& e) {
      if (e.matches(g_stop_type)) throw detail::StopRecompute{};
      throw;
    }
  };
}

/// `context_fn()`'s two context managers as the C++ ContextFn: each run
/// enters its manager and leaves it when the run ends.
ContextFn wrap_context_fn(const py::object& context_fn) {
  if (context_fn.is_none()) return {};
  py::tuple managers = context_fn();
  if (managers.size() != 2) {
    throw std::invalid_argument("prefire.checkpoint: context_fn must return two context managers (forward, "
                                "recompute), got " + std::to_string(managers.size()) + " objects");
  }
  auto enter = [](std::shared_ptr<py::object> manager) -> ContextFactory {
    return [manager]() -> ContextGuard {
      py::gil_scoped_acquire gil;
      manager->attr("__enter__")();
      return ContextGuard(manager.get(), [manager](void*) {
        py::gil_scoped_acquire gil;
        try {
          manager->attr("__exit__")(py::none(), py::none(), py::none());
        } catch (py::error_already_set& e) {  // a guard's release must not throw
          e.discard_as_unraisable("prefire: context_fn's __exit__");
        }
      });
    };
  };
  return ContextFn{enter(hold(managers[0])), enter(hold(managers[1]))};
}

DeterminismCheck parse_check(const std::string& name) {
  if (name == "default") return DeterminismCheck::kMetadata;
  try {
    return parse_determinism_check(name);
  } catch (const std::invalid_argument&) {
    throw std::invalid_argument("prefire.checkpoint: determinism_check must be 'default', 'none', 'metadata' or "
                                "'checksum', got '" + name + "'");
  }
}

TensorList checkpoint_(py::function run, const TensorList& inputs, bool preserve_rng_state,
                       const std::string& determinism_check, bool early_stop, const py::object& context_fn,
                       std::shared_ptr<OffloadTier> offload_to, bool offload_inputs_only) {
  CheckpointOptions options;
  options.offload_to = std::move(offload_to);
  options.offload_inputs_only = offload_inputs_only;
  options.preserve_rng_state = preserve_rng_state;
  options.determinism_check = parse_check(determinism_check);
  options.early_stop = early_stop;
  options.context_fn = wrap_context_fn(context_fn);
  return checkpoint(wrap_function(std::move(run)), inputs, options);
}

/// A Python observer as the C++ one: called on the recomputing thread, takes
/// the GIL, never throws (an error is reported as unraisable).
RecomputeObserver wrap_observer(const py::object& observer) {
  if (observer.is_none()) return {};
  auto fn = hold(observer);
  return [fn](const RecomputeEvent& e) {
    py::gil_scoped_acquire gil;
    auto seconds = [](std::chrono::steady_clock::time_point t) {
      return std::chrono::duration<double>(t.time_since_epoch()).count();  // time.monotonic()'s clock on Linux
    };
    try {
      (*fn)(e.kind == RecomputeEvent::Kind::kPrefire ? "prefire" : "lazy", e.session, seconds(e.begin), seconds(e.end));
    } catch (py::error_already_set& error) {
      error.discard_as_unraisable("prefire: the recompute observer");
    }
  };
}

// ---- scopes as context managers ----------------------------------------------

/// What detail::count_in_meter() counts, for as long as Python keeps it.
struct CountedInMeter {
  explicit CountedInMeter(std::vector<std::unique_ptr<detail::PackedTensor>> counted) : tensors(std::move(counted)) {}
  CountedInMeter(const CountedInMeter&) = delete;
  CountedInMeter& operator=(const CountedInMeter&) = delete;
  std::vector<std::unique_ptr<detail::PackedTensor>> tensors;
};

/// A C++ scope object, opened by __enter__ and closed by __exit__.
template <typename Scope>
struct PyScope {
  std::optional<Scope> scope;
};

/// Runs `f` without the GIL; what the runtime warns meanwhile (TORCH_WARN)
/// becomes Python warnings when it returns, as in torch's own bindings.
/// Errors keep their types (torch's HANDLE_TH_ERRORS would make a
/// CheckpointError a RuntimeError).
template <typename F>
void warning_as_python(F&& f) {
  try {
    torch::PyWarningHandler warnings;
    try {
      py::gil_scoped_release no_gil;
      f();
    } catch (...) {
      warnings.set_in_exception();
      throw;
    }
  } catch (python_error& e) {  // a warning that the warning filters made an error
    e.restore();
    throw py::error_already_set();
  }
}

/// `name(field=value, ...)` of a stats struct, for its __repr__.
std::string fields_repr(const char* name, std::initializer_list<std::pair<const char*, std::string>> fields) {
  std::string out = std::string(name) + "(";
  const char* sep = "";
  for (const auto& [field, value] : fields) {
    out += sep + std::string(field) + "=" + value;
    sep = ", ";
  }
  return out + ")";
}

void bind_errors_and_hooks(py::module_& m) {
  // Errors: prefire.CheckpointError is a torch.utils.checkpoint.CheckpointError.
  py::object torch_error = py::module_::import("torch.utils.checkpoint").attr("CheckpointError");
  // Leaked like the hooks: a static Python object would be released after
  // the interpreter is gone.
  static auto* checkpoint_error = new py::exception<CheckpointError>(m, "CheckpointError", torch_error.ptr());
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const CheckpointError& e) {
      PyErr_SetString(checkpoint_error->ptr(), e.what());
    }
  });
  g_stop_type = PyErr_NewException("prefire._C._RecomputationStopped", PyExc_BaseException, nullptr);
  m.attr("_RecomputationStopped") = py::handle(g_stop_type);

  g_checkpoint_error = checkpoint_error->ptr();
  g_pack = new py::function(py::reinterpret_steal<py::function>(PyCFunction_New(&g_hook_defs[0], nullptr)));
  g_unpack = new py::function(py::reinterpret_steal<py::function>(PyCFunction_New(&g_hook_defs[1], nullptr)));
  if (!*g_pack || !*g_unpack) throw py::error_already_set();
  static auto* hooks = new PythonHooks();
  prefire::detail::set_hook_source(hooks);
}

void bind_checkpoint_and_tiers(py::module_& m) {
  m.def("checkpoint", &checkpoint_, py::arg("run"), py::arg("inputs"), py::arg("preserve_rng_state"),
        py::arg("determinism_check"), py::arg("early_stop"), py::arg("context_fn"), py::arg("offload_to"),
        py::arg("offload_inputs_only"));

  py::class_<OffloadTier, std::shared_ptr<OffloadTier>>(
      m, "OffloadTier", "Where offloaded checkpoints keep their saved tensors (prefire/offload.h).")
      .def_static(
          "host_file",
          [](const py::object& directory, int64_t capacity_bytes, double bytes_per_second) {  // str or PathLike
            const std::string path = py::str(py::module_::import("os").attr("fspath")(directory));
            py::gil_scoped_release released;  // reserving the file may take a while
            return OffloadTier::host_file(path, capacity_bytes, bytes_per_second);
          },
          py::arg("directory"), py::arg("capacity_bytes"), py::kw_only(), py::arg("bytes_per_second") = 0.0,
          "A host tier for CPU tensors: a file of capacity_bytes in directory, reserved and unlinked at once; "
          "copies run on a worker thread of the tier. bytes_per_second > 0 paces it: each copy takes at least "
          "nbytes / bytes_per_second seconds")
      .def_static("pinned_host", &OffloadTier::pinned_host, py::arg("capacity_bytes"),
                  py::call_guard<py::gil_scoped_release>(),  // pinning may take a while
                  "A host tier for CUDA tensors: capacity_bytes of page-locked host memory, pinned at once; copies "
                  "run on a copy stream per device, fetches on the stream that reads (a prefetch: the prefire stream)")
      .def_property_readonly("capacity_bytes", &OffloadTier::capacity_bytes)
      .def_property_readonly("used_bytes", &OffloadTier::used_bytes, "bytes offloaded tensors hold now (in pages)")
      .def_property_readonly("peak_used_bytes", &OffloadTier::peak_used_bytes)
      .def("reset_peak", &OffloadTier::reset_peak)
      .def_property_readonly("bytes_written", &OffloadTier::bytes_written, "bytes copied into the tier so far")
      .def_property_readonly("bytes_read", &OffloadTier::bytes_read, "bytes copied out of the tier so far")
      .def("synchronize", &OffloadTier::synchronize, py::call_guard<py::gil_scoped_release>(),
           "Blocks until every copy queued so far is done")
      .def_property_readonly("pending_bytes", &OffloadTier::pending_bytes,
                             "bytes queued into the tier and not yet written (held where they were until then)")
      .def_property("max_pending_bytes", &OffloadTier::max_pending_bytes, &OffloadTier::set_max_pending_bytes,
                    "backpressure: a forward waits for the oldest copies while more than this is pending (0: "
                    "every copy written before forward goes on); the memory planners set it to their headroom")
      .def("measure_copy_seconds", &OffloadTier::measure_copy_seconds, py::arg("nbytes"),
           py::call_guard<py::gil_scoped_release>(),
           "Seconds one copy of nbytes into the tier and one back take, measured now after an untimed pair");
}

// The scopes of the Python package's context managers (collect, session, SavedTensorMeter), and handles.
void bind_scopes(py::module_& m) {
  py::class_<CheckpointHandle>(m, "CheckpointHandle", "A checkpoint collected in forward, for prefire/attach.")
      .def_property_readonly("expired", &CheckpointHandle::expired);

  py::class_<PyScope<HandleCollector>>(m, "_Collector")
      .def(py::init<>())
      .def("open", [](PyScope<HandleCollector>& s) { s.scope.emplace(); })
      .def("close", [](PyScope<HandleCollector>& s) { s.scope.reset(); })
      .def("handles", [](const PyScope<HandleCollector>& s) {
        return s.scope ? s.scope->handles() : std::vector<CheckpointHandle>{};
      });

  py::class_<PyScope<SessionScope>>(m, "_SessionScope")
      .def(py::init<>())
      .def("open", [](PyScope<SessionScope>& s, SessionId id, bool retain, SavedTensorMask next_pass_reads) {
        s.scope.emplace(id, SessionOptions{retain, std::move(next_pass_reads)});
      })
      .def_property_readonly("lets_go", [](const PyScope<SessionScope>& s) { return s.scope && s.scope->lets_go(); })
      // Closing may warn (Note [A session shares what is registered to it]).
      .def("close", [](PyScope<SessionScope>& s) { warning_as_python([&] { s.scope.reset(); }); });

  py::class_<PyScope<SavedTensorMeter>>(m, "_SavedTensorMeter")
      .def(py::init<>())
      .def("open", [](PyScope<SavedTensorMeter>& s) {
        if (s.scope) throw std::logic_error("prefire.SavedTensorMeter: a meter counts once; make a new one");
        s.scope.emplace();
      })
      .def("close", [](PyScope<SavedTensorMeter>& s) { if (s.scope) s.scope->stop(); })
      .def_property_readonly("current_bytes", [](const PyScope<SavedTensorMeter>& s) {
        return s.scope ? s.scope->current_bytes() : 0;
      })
      .def_property_readonly("peak_bytes", [](const PyScope<SavedTensorMeter>& s) {
        return s.scope ? s.scope->peak_bytes() : 0;
      })
      .def_property_readonly("saved_tensors", [](const PyScope<SavedTensorMeter>& s) {
        return s.scope ? s.scope->saved_tensors() : 0;
      });

  // Note [Selective checkpointing inside prefire] (python/prefire/_checkpoint.py)
  py::class_<CountedInMeter>(m, "_CountedInMeter", "Tensors counted in a SavedTensorMeter while this lives.")
      .def("__len__", [](const CountedInMeter& c) { return c.tensors.size(); });
  m.def("_count_in_meter", [](const TensorList& tensors) {
    return std::make_unique<CountedInMeter>(prefire::detail::count_in_meter(tensors));
  }, py::arg("tensors"));
}

void bind_sessions(py::module_& m) {
  py::enum_<PrefireStatus>(m, "PrefireStatus")
      .value("RECOMPUTED", PrefireStatus::kRecomputed)
      .value("ALREADY_RESIDENT", PrefireStatus::kAlreadyResident)
      .value("REFUSED_OVER_BUDGET", PrefireStatus::kRefusedOverBudget)
      .value("EXPIRED", PrefireStatus::kExpired);

  m.def("prefire", &prefire::prefire, py::arg("handle"), py::arg("session"),
        py::call_guard<py::gil_scoped_release>());
  m.def("attach", &prefire::attach, py::arg("handle"), py::arg("session"),
        py::call_guard<py::gil_scoped_release>());
  m.def("kept_bytes", &prefire::kept_bytes, py::arg("handle"));
  m.def("fetch_ahead", &prefire::fetch_ahead, py::arg("handle"), py::call_guard<py::gil_scoped_release>());
  m.def("clear_session", [](SessionId id) { warning_as_python([&] { prefire::clear_session(id); }); },
        py::arg("session"));
  m.def("discard_session", [](SessionId id) { warning_as_python([&] { prefire::discard_session(id); }); },
        py::arg("session"));
  m.def("set_session_budget", &prefire::set_session_budget, py::arg("session"), py::arg("bytes"));

  py::class_<SessionStats>(m, "SessionStats",
                           "The counters of one session (prefire.session_stats(id)); counts since the session's first "
                           "use after it last ended, bytes now and at the peak.")
      .def_readonly("current_bytes", &SessionStats::current_bytes, "bytes: recomputed tensors the session holds now")
      .def_readonly("peak_bytes", &SessionStats::peak_bytes, "bytes: the most current_bytes has been")
      .def_readonly("pool_bytes", &SessionStats::pool_bytes,
                    "bytes: the part of current_bytes in the CUDA session buffer pool")
      .def_readonly("prefires", &SessionStats::prefires, "checkpoints recomputed ahead by prefire()")
      .def_readonly("lazy_recomputes", &SessionStats::lazy_recomputes,
                    "checkpoints recomputed by the first pass that needed them (attach)")
      .def_readonly("hits", &SessionStats::hits, "unpacks served from a recomputation the session already held")
      .def_readonly("refused_prefires", &SessionStats::refused_prefires, "prefire() calls the budget refused")
      .def_readonly("trim_misses", &SessionStats::trim_misses,
                    "unpacks of a tensor keep_only() dropped (recomputed for that backward alone)")
      .def_readonly("checkpoints", &SessionStats::checkpoints, "checkpoints registered now, nested ones included")
      .def_readonly("unused_prefires", &SessionStats::unused_prefires,
                    "registered checkpoints prefired whose recomputation no pass has used yet")
      .def_readonly("budget_bytes", &SessionStats::budget_bytes, "bytes: the session's cap, or None")
      .def("__repr__", [](const SessionStats& s) {
        auto str = [](int64_t v) { return std::to_string(v); };
        return fields_repr("SessionStats",
                           {{"current_bytes", str(s.current_bytes)}, {"peak_bytes", str(s.peak_bytes)},
                            {"pool_bytes", str(s.pool_bytes)}, {"prefires", str(s.prefires)},
                            {"lazy_recomputes", str(s.lazy_recomputes)}, {"hits", str(s.hits)},
                            {"refused_prefires", str(s.refused_prefires)}, {"trim_misses", str(s.trim_misses)},
                            {"checkpoints", str(s.checkpoints)}, {"unused_prefires", str(s.unused_prefires)},
                            {"budget_bytes", s.budget_bytes ? str(*s.budget_bytes) : "None"}});
      });
  m.def("session_stats", &prefire::session_stats, py::arg("session"));
  // Note [A session keeps what the next pass reads] (src/session/keep_only.cpp)
  m.def("pass_reads", &prefire::pass_reads, py::arg("session"));
  m.def("keep_only", &prefire::keep_only, py::arg("session"), py::arg("keep"),
        py::call_guard<py::gil_scoped_release>());
}

void bind_runtime_stats(py::module_& m) {
  py::class_<RuntimeStats>(m, "RuntimeStats",
                           "Process-wide counters (prefire.runtime_stats()): counts since start, bytes now and at the "
                           "peak since start or reset_runtime_peak().")
      .def_readonly("recomputations", &RuntimeStats::recomputations, "recomputations of a checkpoint, any key")
      .def_readonly("offload_fetches", &RuntimeStats::offload_fetches,
                    "fetches of an offloaded checkpoint's saved tensors, any key")
      .def_readonly("unshared_recomputations", &RuntimeStats::unshared_recomputations,
                    "the part of recomputations no session kept (one per backward that needed it)")
      .def_readonly("wasted_prefires", &RuntimeStats::wasted_prefires,
                    "prefired checkpoints released before any pass of their session used them")
      .def_readonly("recomputed_bytes", &RuntimeStats::recomputed_bytes, "bytes: recomputed tensors held now")
      .def_readonly("peak_recomputed_bytes", &RuntimeStats::peak_recomputed_bytes,
                    "bytes: the most recomputed_bytes has been")
      .def_readonly("held_bytes", &RuntimeStats::held_bytes,
                    "bytes: recomputed_bytes plus what active SavedTensorMeters count")
      .def_readonly("peak_held_bytes", &RuntimeStats::peak_held_bytes, "bytes: the most held_bytes has been")
      .def("__repr__", [](const RuntimeStats& s) {
        auto str = [](int64_t v) { return std::to_string(v); };
        return fields_repr("RuntimeStats",
                           {{"recomputations", str(s.recomputations)},
                            {"offload_fetches", str(s.offload_fetches)},
                            {"unshared_recomputations", str(s.unshared_recomputations)},
                            {"wasted_prefires", str(s.wasted_prefires)}, {"recomputed_bytes", str(s.recomputed_bytes)},
                            {"peak_recomputed_bytes", str(s.peak_recomputed_bytes)},
                            {"held_bytes", str(s.held_bytes)}, {"peak_held_bytes", str(s.peak_held_bytes)}});
      });
  m.def("runtime_stats", &prefire::runtime_stats);
  m.def("reset_runtime_peak", &prefire::reset_runtime_peak);
  m.def("set_recompute_observer", [](const py::object& observer) { set_recompute_observer(wrap_observer(observer)); },
        py::arg("observer"));
}

void bind_allocators_and_cuda(py::module_& m) {
  // What the allocators hold (allocator_meter.h): every allocation, not prefire's census.
  py::class_<AllocatorBytes>(m, "AllocatorBytes", "Live bytes of a device's allocator: now and at the peak.")
      .def_readonly("current", &AllocatorBytes::current, "bytes: allocated and not yet freed")
      .def_readonly("peak", &AllocatorBytes::peak, "bytes: the most `current` has been since the last peak reset")
      .def("__repr__", [](const AllocatorBytes& b) {
        return fields_repr("AllocatorBytes", {{"current", std::to_string(b.current)}, {"peak", std::to_string(b.peak)}});
      });
  m.def("count_cpu_allocations", &prefire::count_cpu_allocations);
  m.def("allocator_bytes", &prefire::allocator_bytes, py::arg("device"));
  m.def("reset_allocator_peak", &prefire::reset_allocator_peak, py::arg("device"));

  // CUDA knobs (no-ops, or 0, without CUDA).
  m.def("cuda_available", &prefire::cuda_available);
  m.def("set_prefire_stream_priority", &prefire::set_prefire_stream_priority, py::arg("priority"));
  m.def("set_session_pool_enabled", &prefire::set_session_pool_enabled, py::arg("enabled"));
  m.def("session_pool_enabled", &prefire::session_pool_enabled);
  m.def("session_pool_reserved_bytes", &prefire::session_pool_reserved_bytes);
  m.def("release_session_pools", &prefire::release_session_pools);
  m.def("_prefire_stream", [](c10::DeviceIndex device) -> py::tuple {
#if PREFIRE_WITH_CUDA
    auto packed = prefire::prefire_stream(device).unwrap().pack3();
    return py::make_tuple(packed.stream_id, packed.device_index, static_cast<int>(packed.device_type));
#else
    throw std::runtime_error("prefire was built without CUDA: no prefire stream");
#endif
  }, py::arg("device"));
}

}  // namespace
}  // namespace prefire::python

PYBIND11_MODULE(_C, m) {
  using namespace prefire::python;
  m.doc() = "prefire's C++ runtime (see the prefire package for the API)";
  bind_errors_and_hooks(m);
  bind_checkpoint_and_tiers(m);
  bind_scopes(m);
  bind_sessions(m);
  bind_runtime_stats(m);
  bind_plan(m);  // plan_bindings.cpp
  bind_allocators_and_cuda(m);
}
