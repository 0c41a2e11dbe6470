#pragma once

// NVTX ranges in one domain, "prefire", for Nsight Systems. Header-only NVTX3
// from the CUDA toolkit; without it (PREFIRE_HAVE_NVTX unset) or with
// NVTX_DISABLE defined, the macro compiles to nothing. NVTX calls are cheap
// no-ops unless a profiler is attached.
//
//   PREFIRE_NVTX_RANGE("prefire::prefire", session_id);  // until end of scope
//
// The session id (or -1 where there is none) is the range's int64 payload.

#include <cstdint>

#if defined(PREFIRE_HAVE_NVTX) && !defined(NVTX_DISABLE)
#include <nvtx3/nvtx3.hpp>

namespace prefire::nvtx {

struct domain {
  static constexpr char const* name{"prefire"};
};

/// A range in the prefire domain, closed when the object goes (also on
/// exceptions). Ends on the thread that opened it.
class Range {
 public:
  Range(const char* message, int64_t session)
      : range_(nvtx3::event_attributes{nvtx3::message{message}, nvtx3::payload{session}}) {}

 private:
  nvtx3::scoped_range_in<domain> range_;
};

}  // namespace prefire::nvtx

#define PREFIRE_NVTX_CONCAT_INNER(a, b) a##b
#define PREFIRE_NVTX_CONCAT(a, b) PREFIRE_NVTX_CONCAT_INNER(a, b)
#define PREFIRE_NVTX_RANGE(message, session) \
  ::prefire::nvtx::Range PREFIRE_NVTX_CONCAT(prefire_nvtx_range_, __LINE__)(message, static_cast<int64_t>(session))
#define PREFIRE_NVTX_ENABLED 1

#else

#define PREFIRE_NVTX_RANGE(message, session) static_cast<void>(0)
#define PREFIRE_NVTX_ENABLED 0

#endif
