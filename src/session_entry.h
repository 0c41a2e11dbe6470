#pragma once

// What a checkpoint registered to a session sees of that session: the
// session's counters and retain flag, and its own recomputation kept for the
// session. The session layer (session.cpp, schedule.cpp) creates entries and
// hands them to frames; frames never call into the session layer. See Note
// [Session binding] in session.h.

#include <prefire/session.h>

#include "recomputation.h"

#include <atomic>
#include <cstdint>
#include <memory>

namespace prefire::detail {

/// The part of a session shared with its checkpoints' unpacks. Lives as long
/// as the session or any entry of it.
struct SessionCore {
  explicit SessionCore(SessionId session_id) : id(session_id) {}

  const SessionId id;
  std::atomic<bool> retain_on_unpack{false};  // of the open scope
  const std::shared_ptr<ByteGauge> bytes = std::make_shared<ByteGauge>();       // recomputed tensors held
  const std::shared_ptr<ByteGauge> pool_bytes = std::make_shared<ByteGauge>();  // part of `bytes` in the buffer pool
  std::atomic<int64_t> prefires{0};
  std::atomic<int64_t> lazy_recomputes{0};
  std::atomic<int64_t> hits{0};
  std::atomic<int64_t> refused_prefires{0};
};

/// One checkpoint's registration to one session.
struct SessionEntry {
  explicit SessionEntry(std::shared_ptr<SessionCore> core)
      : session(std::move(core)), recomputation(session->bytes, session->pool_bytes) {}

  const std::shared_ptr<SessionCore> session;
  Recomputation recomputation;  // shared by every pass of the session
};

}  // namespace prefire::detail
