#pragma once

#include <prefire/observer.h>

namespace prefire::detail {

/// Cheap check before building an event.
bool has_recompute_observer();
/// Calls the observer, if any; swallows what it throws. Callers hold no
/// lock of prefire's: the observer may call any public function.
void notify_recompute(const RecomputeEvent& event) noexcept;

}  // namespace prefire::detail
