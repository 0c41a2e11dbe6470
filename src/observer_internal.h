#pragma once

#include <prefire/observer.h>

namespace prefire::detail {

/// Cheap check before building an event.
bool has_recompute_observer();
/// Calls the observer, if any; swallows what it throws.
void notify_recompute(const RecomputeEvent& event) noexcept;

}  // namespace prefire::detail
