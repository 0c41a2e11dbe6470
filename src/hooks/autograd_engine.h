#pragma once

// prefire's autograd engine (Note [How C++ gets saved-tensor hooks] in
// autograd_engine.cpp) and the few engine services the checkpoint layer uses,
// kept out of torch's engine.h and its heavy include graph.

#include <cstdint>
#include <functional>

namespace prefire::detail {

/// Runs `callback` when the backward graph task running on this thread ends
/// (Engine::queue_callback). Only valid inside a backward.
void queue_graph_task_callback(std::function<void()> callback);

/// Id of the backward graph task running on this thread, or -1 outside
/// backward.
int64_t current_graph_task_id();

}  // namespace prefire::detail
