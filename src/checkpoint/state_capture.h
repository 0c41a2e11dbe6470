#pragma once

// What a recomputation must see exactly as forward saw it: generator states,
// autocast settings and the current CUDA device.
//
// Note [Restoring state for recompute]
// Captured when the checkpoint's forward starts (before the user's forward
// context), applied around every recomputation, and the caller's state is put
// back afterwards, on success and on exception. Generators are read and
// written under their own mutex. Autocast settings are thread-local and need
// no lock.
//
// Note [Autocast's cast cache in recomputation]
// Autocast caches the low-precision casts of leaf tensors that require grad
// (the weights) in one process-wide map, filled inside autocast regions and
// cleared when a thread's outermost region ends. A recomputation must not
// use it: a prefire's casts are made on the prefire stream and another
// thread's region would read them with no stream order; a cast the main
// stream made would be read on the prefire stream; and a recomputation that
// ended a region of its own (a lazy one on an autograd device thread) would
// clear the cache under another thread's forward. So a recomputation runs
// with the cache disabled (a thread-local setting) and enters no region: it
// casts the weights it uses afresh, the same values forward cast, and leaves
// the map as it found it. One exception, as in torch: a checkpointed
// function that opens an autocast region of its own ends it in the
// recomputation too, and when that is the recomputing thread's outermost
// region autocast clears the process-wide cache on exit, exactly as the same
// function does in forward (and in torch.utils.checkpoint's recomputation).
//
// The intra-op thread count is state too: CPU reductions split their work by
// it, so a recomputation under another count computes other bits than forward
// did (a sum over 4M floats differs in its last places between 1 and 4
// threads). It is per thread (OpenMP's and MKL's settings are), and a
// backward may run on another thread than forward: an autograd device thread,
// a std::thread running the W pass. So forward's count is captured and, when
// the recomputing thread's count differs, set for the recomputation and put
// back after. at::set_num_threads() also sets the default that threads not yet
// initialized pick up and drops oneDNN's primitive cache, so this costs
// something only when the counts differ.
//
// Note [Recomputations that restore generators]
// Restoring a generator is only exact if nothing else draws from it until the
// recomputation ends. Two recomputations that restore generator state (a
// prefire on one thread, a lazy recompute on an autograd device thread, two
// backward threads) would each set the process-wide generator and interleave
// their draws: wrong dropout masks, silently. So every recomputation with
// preserve_rng_state that restores a generator (see Note [Generator
// snapshots]) holds one process-wide recursive lock from before it
// claims its single flight (Note [Single-flight recomputation]) until it ends;
// they run one at a time, and a recomputation that needs another one (a
// nested checkpoint's inputs) takes it again on its own thread. The lock is
// taken before the claim so that no thread can own a running recomputation
// while it waits for the lock. Forward passes and other code that draw random
// numbers on other threads meanwhile are not serialized: they race on the
// generator as they would without prefire.

// Note [Generator snapshots]
// The CPU generator's state is ~2.5 KB, and restoring it around a
// recomputation means a read, two writes and the process-wide lock of Note
// [Recomputations that restore generators]. Most checkpointed functions draw
// no random numbers at all (no dropout), so:
//  * When forward returns and the generators are exactly as the snapshot
//    found them, the function drew nothing, and its recomputation (the same
//    function; or a prefix of it, when it stops early) will draw nothing
//    either: the frame drops the snapshot and its recomputations restore no
//    generator and take no lock. Anything else that drew meanwhile (another
//    thread, a context hook) makes the states differ, and the snapshot is
//    kept: the rule only ever errs towards restoring.
//  * A thread keeps its last snapshot, and the next capture shares it when
//    the state read now is the same, so a forward that draws nothing
//    allocates no 2.5 KB copy per checkpoint (glibc consolidates its fast bins
//    on every large request). Snapshots are immutable once made.
// Both apply to captures of the CPU generator alone; a CUDA generator's state
// is a tensor, read afresh and always restored.

#include <ATen/core/Generator.h>
#include <ATen/core/MT19937RNGEngine.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

namespace prefire::detail {

struct AutocastState {
  bool cpu_enabled = false;
  at::ScalarType cpu_dtype = at::kBFloat16;
  bool cuda_enabled = false;
  at::ScalarType cuda_dtype = at::kHalf;
  bool cache_enabled = true;

  static AutocastState current();
  void apply() const;
};

/// The CPU generator's whole state, copied as it is (no serialization to a
/// tensor: a capture and a restore are a ~2.5 KB copy each).
struct CpuRngState {
  at::mt19937 engine;
  std::optional<float> next_float_normal;
  std::optional<double> next_double_normal;

  /// Whether both describe the same generator state. Compares the engines'
  /// bytes, padding included: a false "different" only keeps a snapshot
  /// that was not needed, never the reverse.
  bool same_as(const CpuRngState& other) const;
};

struct RngState {
  CpuRngState cpu;                                       // CPU generator state
  std::vector<std::pair<c10::Device, at::Tensor>> devices;  // per CUDA device of the inputs

  /// Captures the CPU generator and the generators of the devices of `inputs`.
  /// See Note [Generator snapshots].
  static std::shared_ptr<const RngState> capture(const std::vector<at::Tensor>& inputs);
  /// Captures the same generators as `like`, as they are now.
  static RngState capture_like(const RngState& like);
  void apply() const;
};

struct CapturedState {
  std::shared_ptr<const RngState> rng;  // null without preserve_rng_state
  AutocastState autocast;
  std::optional<c10::Device> cuda_device;  // current CUDA device, when CUDA has devices
  int intra_op_threads = 1;                // at::get_num_threads() of the forward's thread

  static CapturedState capture(const std::vector<at::Tensor>& inputs, bool preserve_rng);
  /// Right after forward: drops `rng` when it holds the CPU generator alone
  /// and that generator is as the snapshot found it (Note [Generator snapshots]).
  void drop_rng_if_unused();
};

/// Applies a captured state for its lifetime and restores the caller's state
/// afterwards. Never throws from its destructor.
class StateRestoreGuard {
 public:
  explicit StateRestoreGuard(const CapturedState& state);
  ~StateRestoreGuard();
  StateRestoreGuard(const StateRestoreGuard&) = delete;
  StateRestoreGuard& operator=(const StateRestoreGuard&) = delete;

 private:
  void restore() noexcept;

  std::optional<RngState> saved_rng_;
  AutocastState saved_autocast_;
  std::optional<c10::Device> saved_device_;
  std::optional<int> saved_threads_;  // set when the recomputation changed the thread count
};

/// The lock of Note [Recomputations that restore generators].
std::unique_lock<std::recursive_mutex> lock_generators();

}  // namespace prefire::detail
