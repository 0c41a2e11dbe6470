#pragma once

#include <memory>

namespace prefire::detail {

class Frame;

/// Gives `frame` to the innermost HandleCollector of this thread, if any.
void collect(const std::shared_ptr<Frame>& frame);

}  // namespace prefire::detail
