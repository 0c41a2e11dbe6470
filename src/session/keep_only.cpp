// Note [A session keeps what the next pass reads]
// A session of a split backward serves two passes: B (input gradients) and W
// (weight gradients). B reads most of what a checkpoint saved; W reads only
// what the weight gradients need: the inputs of the layers that hold weights
// (a linear layer's input, a norm's statistics), not the tensors that serve
// the input gradient alone (attention's q, k, v, output and log-sum-exp, an
// activation's input). The C++ split backward lets those go by itself
// (autograd releases a node's saved tensors after B runs it; Note [Memory
// that follows the passes]), but torch.distributed.pipelining's B keeps the
// whole graph for W (retain_graph=True), so a session would hold everything
// B recomputed until W: on the default GPT block ~4.0 MiB per block and
// micro-batch where W reads ~2.25.
//
// Which tensors W reads is known only once a W has run: pass_reads() is what
// the latest pass of a session unpacked (reset when a scope opens), per
// registered checkpoint and slot. The session keeps each checkpoint's reads
// beside it (Registration::reads), so a W that frees checkpoints as it goes
// (torch's W runs without retain_graph) is seen whole after it ends; the
// entries of freed checkpoints go when the session next forgets them (a
// scope opens, many checkpoints register, clear_session), so read them right
// after the pass. A caller that runs the same forward again
// (a pipeline stage's next micro-batch) passes what an earlier W read to
// keep_only() after the next B, and the session drops the rest. Nothing is
// inferred from names or shapes: the mask is what that W did read, and a
// mask that does not fit the session (another number of checkpoints or of
// saved tensors) drops nothing. Should W read a dropped tensor after all
// (a graph that differs in what it needs though not in its shape), the
// unpack recomputes the checkpoint for that graph task, as a checkpoint
// outside any session does, and counts a trim miss: more work, the same
// values, and the caller sees it in session_stats() and in the next
// pass_reads() (the miss marks the slot read), so it can keep more next
// time.

// Note [A pass lets go of what the next pass will not read]
// keep_only() after B leaves the session what W reads, but B holds all it
// recomputed until it ends: each checkpoint's recomputation stays whole while
// B runs the rest of the stage, where torch's checkpoint lets a tensor go
// once the node that unpacked it ran. When the mask of what W reads is known
// before B (the W of an earlier micro-batch), B's scope takes it
// (SessionOptions::next_pass_reads) and an unpack in B of a tensor W will not
// read hands it out for the last time: the session drops it at once
// (Recomputation::take_and_trim, marking it trimmed as keep_only does), so it
// lives only as long as the node that read it, and when the scope closes
// keep_only(mask) drops whatever B did not unpack. A prefire checkpoint
// around a compiled block whose weight gradients W takes from B (W reads
// none of it) then holds each recomputation only while B runs its compiled
// backward, as torch's compiled checkpoint does.
// Released at the unpack, not when the node is done: B keeps its graph for W
// (retain_graph=True), so autograd never releases the saved tensor and there
// is no later point in the pass to let go at. The price is a second unpack
// of the same tensor in B (a custom Function reading ctx.saved_tensors
// twice): it is a trim miss, recomputed for that backward alone as a W's
// unpack of a dropped tensor is, counted in SessionStats::trim_misses, so the
// caller can stop giving B the mask. A nested prefire taking its inputs from
// its parent is no consumer and lets nothing go.

#include <prefire/errors.h>
#include <prefire/session.h>

#include "checkpoint/frame.h"
#include "session/session.h"

#include <string>

namespace prefire {

namespace detail {

bool fits(const std::vector<Session::Registered>& frames, const SavedTensorMask& mask) {
  if (frames.size() != mask.size()) return false;
  for (size_t i = 0; i < mask.size(); ++i) {
    if (frames[i].reads->size() != mask[i].size()) return false;
  }
  return true;
}

}  // namespace detail

SavedTensorMask pass_reads(SessionId id) {
  detail::check_session_id(id, "pass_reads");
  std::unique_lock<std::mutex> lock;
  auto session = detail::lock_existing_session(id, lock);
  if (!session) return {};
  SavedTensorMask reads;
  reads.reserve(session->frames.size());
  for (const auto& registered : session->frames) reads.push_back(registered.reads->get());
  return reads;
}

bool keep_only(SessionId id, const SavedTensorMask& keep) {
  detail::check_session_id(id, "keep_only");
  std::unique_lock<std::mutex> lock;
  auto session = detail::lock_existing_session(id, lock);
  if (!session) return keep.empty();
  if (session->scope_open) {
    throw CheckpointError("prefire::keep_only: session " + std::to_string(id) +
                          " has an open SessionScope; call it between passes");
  }
  const auto& registered = session->frames;
  if (!detail::fits(registered, keep)) return false;
  for (size_t i = 0; i < keep.size(); ++i) {
    if (auto frame = registered[i].frame.lock()) {
      if (auto registration = frame->registration_in(*session->core)) registration->recomputation.keep_only(keep[i]);
    }
  }
  return true;
}

}  // namespace prefire
