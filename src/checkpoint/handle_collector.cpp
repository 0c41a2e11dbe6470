#include "checkpoint/handle_collector.h"

#include "hooks/thread_stack.h"
#include "hooks/thread_state.h"

#include <stdexcept>
#include <string>

namespace prefire {
namespace detail {

std::shared_ptr<Frame> HandleAccess::frame(const CheckpointHandle& h, const char* what) {
  if (!h.valid_) {
    throw std::invalid_argument(std::string("prefire::") + what +
                                ": the handle was default-constructed; take handles from HandleCollector::handles()");
  }
  return h.frame_.lock();
}

void collect(const std::shared_ptr<Frame>& frame) {
  if (HandleCollector* c = this_thread().collector) HandleAccess::add(*c, frame);
}

}  // namespace detail

HandleCollector::HandleCollector() : previous_(detail::this_thread().collector) {
  detail::this_thread().collector = this;
}

HandleCollector::~HandleCollector() {
  // See Note [Scopes that leave out of order] in hooks/thread_stack.h.
  if (!detail::unlink_from_stack(detail::this_thread().collector, this, detail::HandleAccess::below)) {
    detail::fatal_misuse("a HandleCollector was destroyed on another thread than the one that made it");
  }
}

}  // namespace prefire
