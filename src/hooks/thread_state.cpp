#include "hooks/thread_state.h"

namespace prefire::detail {

constinit thread_local ThreadState tls_thread_state;

}  // namespace prefire::detail
