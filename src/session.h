#pragma once

// A session's state and the process-wide registry of sessions.
//
// Note [Session binding]
// An unpack must find its session on whatever thread autograd runs it (the
// CUDA device threads do not see the caller's thread-locals). So a SessionScope
// writes the session into a field of every checkpoint registered to it, and
// the unpack hot path reads that field: no thread-local lookup, no global lock,
// only the checkpoint's own lock around its recomputation. Sessions are never
// destroyed (clear_session empties one, the registry keeps it), so a raw
// pointer in a checkpoint cannot dangle.

#include <prefire/session.h>

#include "recomputation.h"

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

namespace prefire::detail {

class Frame;

class Session {
 public:
  explicit Session(SessionId session_id) : id(session_id) {}

  const SessionId id;

  std::mutex mu;                             // guards the fields below up to the atomics
  std::vector<std::weak_ptr<Frame>> frames;  // registered checkpoints
  bool scope_open = false;
  std::optional<int64_t> budget;  // bytes

  std::atomic<bool> retain_on_unpack{false};  // of the open scope; read by unpacks
  const std::shared_ptr<ByteGauge> bytes = std::make_shared<ByteGauge>();
  const std::shared_ptr<ByteGauge> pool_bytes = std::make_shared<ByteGauge>();  // part of `bytes` in the buffer pool
  std::atomic<int64_t> prefires{0};
  std::atomic<int64_t> lazy_recomputes{0};
  std::atomic<int64_t> hits{0};
  std::atomic<int64_t> refused_prefires{0};

  /// Registers `frame` (caller holds `mu`); binds it when a scope is open.
  /// Returns false when it was registered already.
  bool register_frame_locked(const std::shared_ptr<Frame>& frame);
};

/// std::invalid_argument unless `id` >= 0; `what` names the caller.
void check_session_id(SessionId id, const char* what);
/// The session with `id`, created on first use.
std::shared_ptr<Session> session_for(SessionId id);
/// The session with `id`, or nullptr when it was never used.
std::shared_ptr<Session> find_session(SessionId id);
/// Whether a SessionScope is open on this thread.
bool session_scope_open_on_this_thread();

}  // namespace prefire::detail
