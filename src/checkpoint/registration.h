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
#include <vector>

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
  std::atomic<int64_t> trim_misses{0};
};

/// Which of one checkpoint's saved tensors the latest pass of its session
/// unpacked (pass_reads()). The session keeps it beside the checkpoint, so it
/// outlives a checkpoint that the pass freed (torch's W runs without
/// retain_graph and frees each checkpoint's graph as it goes). Any thread.
class SlotReads {
 public:
  explicit SlotReads(size_t slots) : read_(slots) {}
  void mark(size_t slot) noexcept {
    if (slot < read_.size()) read_[slot].store(true, std::memory_order_relaxed);
  }
  /// A pass begins.
  void clear() noexcept {
    for (auto& r : read_) r.store(false, std::memory_order_relaxed);
  }
  std::vector<bool> get() const {
    std::vector<bool> out(read_.size());
    for (size_t slot = 0; slot < read_.size(); ++slot) out[slot] = read_[slot].load(std::memory_order_relaxed);
    return out;
  }
  size_t size() const { return read_.size(); }

 private:
  std::vector<std::atomic<bool>> read_;  // by slot
};

/// One checkpoint's registration to one session.
struct Registration {
  Registration(std::shared_ptr<SessionCore> core, size_t slots)
      : session(std::move(core)),
        recomputation(session->bytes, session->pool_bytes),
        reads(std::make_shared<SlotReads>(slots)) {}
  /// A prefire nobody used is reported as it goes; see Note [A session shares
  /// what is registered to it] in session/session.h.
  ~Registration() {
    if (unused_prefire()) count_wasted_prefire(session->id);
  }
  Registration(const Registration&) = delete;
  Registration& operator=(const Registration&) = delete;

  /// Whether prefire() recomputed into this registration and no pass has
  /// unpacked from it yet. Flags, not data: relaxed (the destructor runs
  /// after every holder let go, which orders it after their writes).
  bool unused_prefire() const {
    return prefired.load(std::memory_order_relaxed) && !used.load(std::memory_order_relaxed);
  }

  const std::shared_ptr<SessionCore> session;
  Recomputation recomputation;  // shared by every pass of the session
  const std::shared_ptr<SlotReads> reads;
  std::atomic<bool> prefired{false};  // prefire() ran `recomputation`
  std::atomic<bool> used{false};      // a pass of the session unpacked from it
  /// Of the open scope, by slot: kept past its unpack (SessionOptions::next_pass_reads);
  /// empty: every slot. Guarded by the frame's lock (Frame::keep_past_unpack).
  std::vector<bool> keep_past_unpack;
};

}  // namespace prefire::detail
