#pragma once

// Non-reentrant activation checkpointing for LibTorch (the semantics of
// torch.utils.checkpoint(use_reentrant=false)): forward keeps only the inputs
// of `fn`; every tensor autograd saves inside `fn` is dropped and recomputed
// when backward first needs one of them.

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace prefire {

class OffloadTier;  // prefire/offload.h

using TensorList = std::vector<at::Tensor>;

/// The function a checkpoint wraps. It must compute the same thing when
/// called again with the same inputs: same operations, same shapes, same
/// random numbers when `preserve_rng_state` restores the generators.
using CheckpointFn = std::function<TensorList(const TensorList&)>;

/// How a recomputation is compared with forward, per saved tensor ("slot").
enum class DeterminismCheck {
  kNone,      ///< no check: the recomputed tensors are trusted as they are
  kMetadata,  ///< count, shape, dtype and device of every saved tensor
  /// metadata plus a checksum of each saved tensor's bytes, taken at forward
  /// and at recompute (a CUB kernel on CUDA, waiting for its result; a loop on
  /// CPU). Catches values that differ, e.g. dropout without preserved RNG. A
  /// debugging mode: it costs a pass over every saved tensor, twice.
  kChecksum,
};

/// Parses "none", "metadata" or "checksum"; throws std::invalid_argument otherwise.
DeterminismCheck parse_determinism_check(const std::string& name);
/// "none", "metadata" or "checksum".
const char* to_string(DeterminismCheck check);

/// Something a user context hook returns: it is held for the duration of the
/// run it wraps and released right after (also when the run throws). Its
/// deleter runs the hook's "exit" and must not throw.
using ContextGuard = std::shared_ptr<void>;
using ContextFactory = std::function<ContextGuard()>;

/// User hooks around the runs of `fn` (the C++ form of `context_fn`).
/// `forward` is called right before the forward run, `recompute` right before
/// every recomputation; each returned guard is released when that run ends.
/// Both run on the thread that runs `fn` (recompute: the backward's thread).
struct ContextFn {
  ContextFactory forward;
  ContextFactory recompute;
};

struct CheckpointOptions {
  /// Stop a recomputation as soon as every tensor forward saved has been saved
  /// again; the rest of `fn` does not run. Where the rest builds nothing
  /// backward needs (in forward, `fn` created no autograd node after its last
  /// save) and no input is on CUDA, the rest runs instead and its outputs are
  /// dropped: stopping costs more than it would save (Note [Early stop]).
  bool early_stop = true;
  /// Capture the CPU generator and the generators of every CUDA device of the
  /// inputs at forward, and run the recomputation from that state. The
  /// caller's generator state is put back after the recomputation. Such
  /// recomputations are serialized with each other, process-wide. A
  /// function whose forward left the CPU generator as it found it (it drew
  /// no random numbers; no CUDA inputs) needs no restore: its recomputations
  /// restore nothing and are not serialized.
  bool preserve_rng_state = true;
  DeterminismCheck determinism_check = DeterminismCheck::kMetadata;
  ContextFn context_fn;
  /// Offload instead of recompute: every tensor the forward saves is copied
  /// to this tier and fetched back for backward (prefire() prefetches them);
  /// the checkpoint keeps no inputs;
  /// `fn` is not run again, so preserve_rng_state and the determinism check
  /// have nothing to do. nullptr (the default): recompute. See prefire/offload.h.
  std::shared_ptr<OffloadTier> offload_to;
  /// With offload_to: offload only the checkpoint's inputs (what a checkpoint
  /// keeps between forward and backward) and recompute the rest as usual;
  /// the recomputation reads its inputs back first.
  bool offload_inputs_only = false;
};

/// Runs `fn(inputs)` without keeping the tensors autograd saves inside it;
/// backward recomputes them (once per backward graph task) and the gradients
/// equal those of `fn` run unchecked.
///
/// * With grad mode off, `fn` runs plainly. When nothing inside `fn` saved a
///   tensor (nothing required grad), no checkpoint is kept either.
/// * The inputs are saved through autograd, so an enclosing checkpoint drops
///   them too, and an input modified in place after forward is reported as
///   CheckpointError when backward needs it.
/// * Requires prefire::install(); throws CheckpointError otherwise.
/// * Threads: forward runs on the caller's thread; the recomputation runs on
///   the thread of the backward that first needs it, under the autocast
///   state, device and intra-op thread count (at::get_num_threads()) captured
///   at forward, so its bits equal forward's on any thread. Independent
///   threads may checkpoint and backpropagate at once. Recomputations that
///   restore generator state run one at a time, process-wide, so their draws
///   never interleave; forward passes drawing random numbers on other threads
///   meanwhile race on the generators as they would without prefire.
TensorList checkpoint(const CheckpointFn& fn, const TensorList& inputs,
                      const CheckpointOptions& options = {});

}  // namespace prefire
