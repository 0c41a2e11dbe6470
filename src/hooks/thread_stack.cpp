#include "hooks/thread_stack.h"

#include <cstdio>
#include <cstdlib>

namespace prefire::detail {

void fatal_misuse(const std::string& what) noexcept {
  std::fprintf(stderr, "prefire: fatal misuse: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace prefire::detail
