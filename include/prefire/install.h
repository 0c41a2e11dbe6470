#pragma once

namespace prefire {

/// Installs prefire's autograd engine as the process's default engine, the
/// place where LibTorch asks for saved-tensor hooks (see Note [How C++ gets
/// saved-tensor hooks] in src/hooks/autograd_engine.cpp).
///
/// Call it once at start-up, before the first backward of the process: worker
/// threads of an engine that already ran keep serving that engine. Idempotent
/// and thread-safe.
///
/// It replaces only torch's base engine. When another engine is the default,
/// it raises std::logic_error and changes nothing: inside a Python process
/// (PyTorch installs its Python engine when torch is imported) or after
/// another library installed its own. is_installed() then stays false and
/// checkpoint() raises CheckpointError saying so.
void install();

/// True when saved tensors reach prefire: its engine is the process's default
/// engine, or (in a Python process) the prefire Python package is imported.
bool is_installed();

}  // namespace prefire
