#pragma once

// What a checkpoint keeps of a session it is registered to: the session's
// counters and retain flag (SessionCore), and its own recomputation kept for
// the session (Registration). The session layer (session/) creates
// registrations and hands them to frames; the checkpoint layer only reads
// the flag and writes the counters, and never calls into the session layer.
// See Note [Session binding] in session/session.h.

#include <prefire/session.h>

#include "checkpoint/recomputation.h"
#include "memory/storage_census.h"

#include <atomic>
#include <cstdint>
#include <memory>

namespace prefire::detail {

/// The part of a session shared with its checkpoints' unpacks. Lives as long
/// as the session or any registration to it.
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
struct Registration {
  explicit Registration(std::shared_ptr<SessionCore> core)
      : session(std::move(core)), recomputation(session->bytes, session->pool_bytes) {}

  const std::shared_ptr<SessionCore> session;
  Recomputation recomputation;  // shared by every pass of the session
};

}  // namespace prefire::detail
