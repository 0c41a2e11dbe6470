// Note [Frame lifetime]
// A frame is owned by the tensors it packed: every SavedVariable autograd made
// inside the checkpoint holds a SlotRef, and each SlotRef holds the frame. When
// the graph is freed, the SlotRefs go and the frame with them. Nothing else
// owns a frame (handles handed to schedulers and a parent's list of nested
// checkpoints are weak), so a frame never outlives its graph and holds no
// cycle: its saved inputs were made before it existed and point only
// backwards. A slot whose SavedVariable autograd already freed is not stored
// by any recomputation.
//
// Note [Recomputation keys]
// An unpack is served from exactly one recomputation, chosen in this order:
//   1. the session's, when the frame is bound to its registered session (a
//      SessionScope of it is open), or when a prefire of that session runs on
//      this thread (the inputs of a nested checkpoint come from its parent);
//      kept as the scope's retain_on_unpack says, until clear_session();
//   2. the torch.utils.checkpoint.GraphExecGroup's, when the backward runs
//      inside one (torch's own way to share a recomputation between
//      backwards over disjoint parts of a graph): each tensor handed out
//      once, the rest dropped with the frame or as autograd frees their saved
//      tensors, as torch's checkpoint does;
//   3. the backward graph task's: its tensors leave one by one as autograd
//      unpacks them, and those it never unpacks (partial backward) are dropped
//      when the graph task ends, through Engine::queue_callback;
//   4. outside backward, a private one for this unpack alone.
// Whatever the key, the path is the same: find the recomputation, have the
// recompute driver fill it once (recompute_once, Note [Single-flight
// recomputation]), take the slot. The frame writes its session's counters
// through the registration the session layer gave it and never calls into
// the session layer.

#include "checkpoint/frame.h"

#include <prefire/errors.h>

#include "checkpoint/checksum.h"
#include "checkpoint/handle_collector.h"
#include "checkpoint/observer.h"
#include "cuda/prefire_stream.h"
#include "hooks/autograd_engine.h"
#include "hooks/thread_state.h"

#include <ATen/SequenceNumber.h>
#include <c10/core/AutogradState.h>
#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>

namespace prefire::detail {

namespace {

// Note [Early stop]
// A recomputation stops as soon as it has saved as many tensors as forward
// did: the recompute driver's pack hook throws StopRecompute from inside the
// op that saved the last one, and the driver catches it
// (checkpoint/recompute.cpp); forward decides whether it may
// (Frame::forward, below). It derives from
// nothing, so user code inside `fn` that catches std::exception cannot swallow
// it (only a catch (...) that does not rethrow can).
//
// The signal is not free: unwinding through the dispatcher and autograd costs
// ~15 us on a 2-core x86 machine (~70k instructions). So forward notes
// whether a stop would cut enough work: whether it created an autograd node
// after the one that saved the last tensor (at::sequence_number, per thread),
// and whether that last save came before its op's kernel ran (an op saves its
// inputs when it builds its node, before the kernel, and its outputs after; a
// saved tensor that needs a gradient and is not an output of the newest node
// is taken for an input, one that needs none, a mask or indices, for an
// output) on inputs of at least kStopBeforeKernelElements elements. It stops
// when either holds: a block ending in a linear layer does not run that
// layer's GEMM again. When neither does, the rest of the function is at most
// one small kernel and work that builds nothing backward needs, cheaper than
// the stop, and the recomputation runs to its end. (torch.utils.checkpoint
// always stops; the result is the same either way.)
// A recomputation that saves more tensors than forward did, with early stop
// on, stops at forward's count like torch.utils.checkpoint does (what follows
// would not be unpacked). The rule is
// deliberately not a timing: whether the rest of `fn` runs again is the same
// on every run and every machine. Checkpoints with CUDA inputs always stop
// (their kernels run asynchronously; a stop also keeps the prefire stream
// free of work nobody uses). StopRecompute is in hooks/hook_stack.h: the
// Python bridge carries it across the Python frames of `fn`.

// The forward's placeholder for one saved tensor.
class SlotRef final : public PackedTensor {
 public:
  SlotRef(std::shared_ptr<Frame> frame, size_t slot) : frame_(std::move(frame)), slot_(slot) {}
  ~SlotRef() override { frame_->release(slot_); }
  at::Tensor unpack() override { return frame_->unpack(slot_); }

 private:
  std::shared_ptr<Frame> frame_;
  size_t slot_;
};

// Whether the checkpoint offloads what it saves (Note [Offloading a checkpoint]
// in checkpoint/offloaded_slots.cpp) rather than recomputing it.
bool offloads_saved(const CheckpointOptions& options) { return options.offload_to && !options.offload_inputs_only; }

// See Note [Early stop]: a kernel pending after the last save on at least
// this many input elements (64 KiB of float) costs about what the stop does
// on a CPU, or more.
constexpr int64_t kStopBeforeKernelElements = 16384;

// The GraphExecGroup this thread's backward runs in, or nullptr. Torch
// versions before GraphExecGroup have no such field: always nullptr there.
template <typename State>
auto graph_exec_group_of(const State& state, int) -> decltype(state.get_graph_exec_group(), (const c10::SafePyObject*)nullptr) {
  const auto& group = state.get_graph_exec_group();
  return group.has_value() ? &*group : nullptr;
}
template <typename State>
const c10::SafePyObject* graph_exec_group_of(const State&, long) {
  return nullptr;
}
const c10::SafePyObject* current_graph_exec_group() {
  return graph_exec_group_of(c10::AutogradState::get_tls_state(), 0);
}

}  // namespace

// ---- Frame: forward -------------------------------------------------------------

Frame::Frame(CheckpointFn fn, const TensorList& inputs, const CheckpointOptions& options)
    : fn_(std::move(fn)),
      options_(options),
      // An offloaded frame never runs `fn` again: no generator state to restore.
      state_(CapturedState::capture(inputs, options.preserve_rng_state && !offloads_saved(options))),
      // An offloaded frame keeps no inputs: it never runs `fn` again, and an input it saved is a slot, offloaded
      // like any (Note [Offloading a checkpoint]).
      inputs_(offloads_saved(options) ? TensorList{} : inputs,
              options.offload_inputs_only ? options.offload_to : nullptr),
      offloaded_(offloads_saved(options) ? std::make_unique<OffloadedSlots>(options.offload_to) : nullptr) {
  for (const auto& input : inputs) {
    if (input.defined() && input.has_storage()) {
      forward_uncounted_.insert(input.storage().unsafeGetStorageImpl());
      forward_pins_.push_back(input.storage().getWeakStorageImpl());
    }
  }
}

Frame::~Frame() = default;

std::unique_ptr<PackedTensor> Frame::pack(const at::Tensor& tensor) {
  TORCH_INTERNAL_ASSERT(!forward_done_.load(std::memory_order_relaxed), "pack into a finished frame");
  SlotMetadata metadata = SlotMetadata::of(tensor);
  if (options_.determinism_check == DeterminismCheck::kChecksum) metadata.checksum = tensor_checksum(tensor);
  // See Note [Counting saved bytes]: parameters and inputs are aliases. An
  // input it saves is counted apart: keeping the block would hold it.
  const bool activation = is_activation(tensor);
  const bool counted = activation && forward_uncounted_.count(tensor.storage().unsafeGetStorageImpl()) == 0;
  if (activation) {
    if (const int64_t nbytes = forward_census_.add(tensor.storage())) {
      (counted ? expected_bytes_ : saved_input_bytes_) += nbytes;
      if (counted) forward_pins_.push_back(tensor.storage().getWeakStorageImpl());
    }
  }
  // Before the slot exists: a tensor the tier cannot take fails the forward here.
  if (offloaded_) offloaded_->add(slots_.size(), tensor);
  const size_t slot = slots_.add(std::move(metadata), counted);
  // See Note [Early stop].
  const uint64_t sequence_nr = at::sequence_number::peek();
  if (sequence_nr != last_pack_sequence_nr_) last_node_input_elements_ = 0;  // a save of a newer node
  last_pack_sequence_nr_ = sequence_nr;
  const torch::autograd::Node* grad_fn = torch::autograd::impl::grad_fn_unsafe(tensor);
  last_pack_was_output_ = !tensor.requires_grad() || (grad_fn != nullptr && grad_fn->sequence_nr() + 1 == sequence_nr);
  if (!last_pack_was_output_) last_node_input_elements_ = std::max(last_node_input_elements_, tensor.numel());
  return std::make_unique<SlotRef>(shared_from_this(), slot);
}

std::pair<TensorList, bool> Frame::forward(const TensorList& inputs) {
  Frame* const parent = this_thread().forward;
  TensorList outputs;
  {
    ThreadStateGuard<Frame*> forward(this_thread().forward, this);
    ContextGuard user = options_.context_fn.forward ? options_.context_fn.forward() : nullptr;
    HookContextScope scope(this);
    outputs = fn_(inputs);
  }
  state_.drop_rng_if_unused();  // before anything else on this thread draws; Note [Generator snapshots]
  num_slots_ = slots_.size();
  // See Note [Early stop].
  const bool autograd_work_after_last_save = at::sequence_number::peek() != last_pack_sequence_nr_;
  const bool large_kernel_after_last_save =
      !last_pack_was_output_ && last_node_input_elements_ >= kStopBeforeKernelElements;
  stop_at_last_slot_ = options_.early_stop && (inputs_.cuda_device().has_value() || autograd_work_after_last_save ||
                                               large_kernel_after_last_save);
  // Forward-only bookkeeping: its memory goes too, not only its elements.
  forward_uncounted_ = {};
  forward_census_.clear();
  forward_pins_ = {};
  if (offloaded_) offloaded_->forward_done();
  forward_done_.store(true, std::memory_order_release);
  if (parent != nullptr && num_slots_ > 0) parent->nested_.push_back(weak_from_this());
  return {std::move(outputs), parent != nullptr};
}

std::vector<std::shared_ptr<Frame>> Frame::with_nested() {
  std::vector<std::shared_ptr<Frame>> all{shared_from_this()};
  for (size_t i = 0; i < all.size(); ++i) {  // breadth first: parents before children
    for (const auto& weak : all[i]->nested_) {
      if (auto frame = weak.lock()) all.push_back(std::move(frame));
    }
  }
  return all;
}

void Frame::release(size_t slot) noexcept {
  // See Note [Memory that follows the passes] in split_backward/split_backward.cpp:
  // a recomputed tensor no saved tensor refers to any more goes at once. The
  // slot is marked first (the recompute driver stores only alive slots and
  // looks again after storing), then every recomputation holding it drops
  // it, outside the frame's lock, collected without a heap allocation in the
  // usual case (one session or one graph task).
  slots_.release(slot);
  if (offloaded_) offloaded_->release(slot);
  c10::SmallVector<std::shared_ptr<Recomputation>, 2> holders;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (registered_) holders.emplace_back(registered_, &registered_->recomputation);
    for (const auto& [id, r] : graph_tasks_) holders.push_back(r);
    for (const auto& [group, r] : groups_) holders.push_back(r);
  }
  for (const auto& r : holders) r->drop(slot);
}

// ---- Frame: backward ------------------------------------------------------------

at::Tensor Frame::unpack(size_t slot) {
  if (!forward_done_.load(std::memory_order_acquire)) return unpack_in_forward(slot);
  // See Note [Recomputation keys].
  if (std::optional<Serving> s = session_for_unpack(slot)) {
    SessionCore& session = *s->registration->session;
    Recomputation& r = s->registration->recomputation;
    // See Note [A session keeps what the next pass reads] in session/keep_only.cpp.
    if (!s->for_nested_prefire) {
      s->registration->reads->mark(slot);
      // Written once: later unpacks (on other device threads too) only read the flag's cache line.
      if (!s->registration->used.load(std::memory_order_relaxed)) {
        s->registration->used.store(true, std::memory_order_relaxed);
      }
    }
    if (r.trimmed(slot)) {
      session.trim_misses.fetch_add(1, std::memory_order_relaxed);
      return unpack_by_graph_task(slot, full_extent());
    }
    std::optional<RecomputeEvent> event =
        recompute_once(source(), r, RecomputeEvent::Kind::kLazy, session.id, full_extent());
    if (event) {
      session.lazy_recomputes.fetch_add(1, std::memory_order_relaxed);
      notify_recompute(*event);
    } else if (!s->for_nested_prefire) {
      session.hits.fetch_add(1, std::memory_order_relaxed);
    }
    return take(r, slot, s->retain, session.id, /*in_group=*/false, /*hand_over=*/!s->for_nested_prefire, s->let_go);
  }
  if (const c10::SafePyObject* group = current_graph_exec_group()) {
    std::shared_ptr<Recomputation> r = recomputation_for(*group);
    compute_lazily(*r, full_extent());
    return take(*r, slot, /*retain=*/false, std::nullopt, /*in_group=*/true);
  }
  return unpack_by_graph_task(slot, full_extent());
}

// Keys 3 and 4 of Note [Recomputation keys]: the backward graph task's
// recomputation, or outside backward a private one.
at::Tensor Frame::unpack_by_graph_task(size_t slot, const Extent& extent) {
  const int64_t graph_task = current_graph_task_id();
  if (graph_task < 0) {
    Recomputation r;
    compute_lazily(r, extent);
    return take(r, slot, /*retain=*/false, std::nullopt);
  }
  std::shared_ptr<Recomputation> r = recomputation_for(graph_task);
  compute_lazily(*r, extent);
  return take(*r, slot, /*retain=*/false, std::nullopt);
}

void Frame::compute_lazily(Recomputation& r, const Extent& extent) {
  if (auto event = recompute_once(source(), r, RecomputeEvent::Kind::kLazy, std::nullopt, extent)) {
    notify_recompute(*event);
  }
}

// Note [Backward inside the checkpointed function]
// A function may run a backward of its own inside the checkpoint
// (torch.autograd.grad of something it computed: gradient penalties, and the
// nested-gradient tests of torch's checkpoint). That backward unpacks tensors
// the frame saved while its forward still runs. It gets a recomputation of
// the part of `fn` that saved them: keyed by its graph task like any lazy
// recomputation (dropped when that backward ends), filling the slots saved so
// far and stopping after the last of them, as torch.utils.checkpoint does.
// The frame's slot count is not final then, so such a recomputation carries
// its own extent, and it never serves a session (no session can bind a
// checkpoint before its forward returns). Slots saved after it (the inner
// backward may itself save tensors, with create_graph) belong to forward and
// are recomputed by backward's recomputation like any other.
at::Tensor Frame::unpack_in_forward(size_t slot) {
  const Extent extent{slots_.size(), /*stop_at_last=*/true};
  TORCH_INTERNAL_ASSERT(slot < extent.slots, "unpack of slot ", slot, " before it was saved");
  return unpack_by_graph_task(slot, extent);
}

std::optional<Frame::Serving> Frame::session_for_unpack(size_t slot) const {
  if (bound_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(mu_);
    if (bound_.load(std::memory_order_relaxed) && registered_) {
      const bool retain = registered_->session->retain_on_unpack.load(std::memory_order_acquire);
      const std::vector<bool>& keep = registered_->keep_past_unpack;
      return Serving{registered_, retain, /*let_go=*/retain && slot < keep.size() && !keep[slot]};
    }
  }
  if (const SessionCore* prefiring = this_thread().prefiring) {
    // See Note [A nested prefire takes its inputs on the prefire stream].
    std::lock_guard<std::mutex> lock(mu_);
    if (registered_ && registered_->session.get() == prefiring) {
      return Serving{registered_, /*retain=*/true, /*let_go=*/false, /*for_nested_prefire=*/true};
    }
  }
  return std::nullopt;
}

std::shared_ptr<Recomputation> Frame::recomputation_for(int64_t graph_task) {
  std::shared_ptr<Recomputation> fresh;
  {
    // Another device thread of the same graph task may get here at once.
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, r] : graph_tasks_) {
      if (id == graph_task) return r;
    }
    fresh = std::make_shared<Recomputation>();
    graph_tasks_.emplace_back(graph_task, fresh);
  }
  queue_graph_task_callback([weak = weak_from_this(), graph_task] {
    if (auto frame = weak.lock()) frame->drop_graph_task(graph_task);
  });
  return fresh;
}

std::shared_ptr<Recomputation> Frame::recomputation_for(const c10::SafePyObject& group) {
  PyObject* const key = group.ptr(&group.pyinterpreter());
  // The reference is taken before mu_ and, when not kept, given back after it
  // (declared before the lock, destroyed after it): both take the GIL, and a
  // thread holding the GIL may wait for mu_ (a graph freed from Python
  // releases its slots).
  c10::SafePyObject reference = group;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [held, r] : groups_) {
    if (held.ptr(&held.pyinterpreter()) == key) return r;
  }
  return groups_.emplace_back(std::move(reference), std::make_shared<Recomputation>()).second;
}

void Frame::drop_graph_task(int64_t graph_task) noexcept {
  std::shared_ptr<Recomputation> dropped;  // released after the lock
  std::lock_guard<std::mutex> lock(mu_);
  auto it = std::find_if(graph_tasks_.begin(), graph_tasks_.end(),
                         [&](const auto& entry) { return entry.first == graph_task; });
  if (it == graph_tasks_.end()) return;
  dropped = std::move(it->second);
  graph_tasks_.erase(it);
}

// Note [A nested prefire takes its inputs on the prefire stream]
// A prefire runs a checkpoint's nested checkpoints after it (parents first),
// and a nested checkpoint's inputs are tensors its parent saved: the nested
// recomputation unpacks them from the parent's recomputation in the same
// session (session_for_unpack's prefiring branch), on the prefire's thread,
// before any backward. That unpack is no consumer: it is not a hit, and it
// hands nothing over to the unpacking thread's current stream (the caller's
// stream waiting on the parent's completion event would serialize the
// caller's work behind the prefire, the overlap prefire exists for). The
// nested recomputation runs on the same prefire stream, after its parent's
// kernels, so it needs no event.
at::Tensor Frame::take(Recomputation& r, size_t slot, bool retain, std::optional<SessionId> session, bool in_group,
                       bool hand_over, bool let_go) {
  TORCH_INTERNAL_ASSERT(slot < r.num_slots(), "slot ", slot, " out of range ", r.num_slots());
  // A session's last pass lets go when it ends; see Note [The last pass lets go when it ends] in session/session.h.
  // A retaining pass lets go at the unpack of what the next pass will not read; see
  // Note [A pass lets go of what the next pass will not read] in session/keep_only.cpp.
  std::optional<at::Tensor> t = let_go                ? r.take_and_trim(slot)
                                : session && !retain ? r.take_for_pass(slot)
                                                     : r.take(slot, retain);
  if (!t) {
    if (session) {
      throw CheckpointError(c10::str(
          "prefire: saved tensor ", slot, " of a checkpoint in session ", *session,
          " was unpacked again after an unpack released it (retain_on_unpack=false). Open the SessionScope of "
          "every pass but the last with retain_on_unpack=true"));
    }
    if (in_group) {
      throw CheckpointError(c10::str(
          "prefire::checkpoint: saved tensor ", slot, " of a checkpoint was unpacked a second time inside one "
          "torch.utils.checkpoint.GraphExecGroup: performing two backward calls that overlap (that need the same "
          "saved tensor) is not allowed in one group. Run them in separate groups, or share the recomputation "
          "through a prefire session"));
    }
    throw CheckpointError(c10::str(
        "prefire::checkpoint: saved tensor ", slot, " of a checkpoint was unpacked a second time in this backward; "
        "a recomputed tensor is handed out once per backward. Read saved tensors once per backward "
        "(e.g. keep the result of get_saved_variables() instead of calling it twice)"));
  }
  if (!t->defined()) {
    throw CheckpointError(c10::str(
        "prefire::checkpoint: saved tensor ", slot, " was not produced by the recomputation (it saved fewer "
        "tensors than forward, and determinism_check \"none\" let that pass)"));
  }
  if (hand_over && r.ready()) r.ready()->hand_over(*t);  // See Note [Stream ordering of prefire]
  return std::move(*t);
}

// ---- Frame: sessions --------------------------------------------------------------

std::pair<std::shared_ptr<Registration>, bool> Frame::register_to(const std::shared_ptr<SessionCore>& session) {
  std::lock_guard<std::mutex> lock(mu_);
  if (registered_) {
    if (registered_->session == session) return {registered_, false};
    const SessionId other = registered_->session->id;
    throw CheckpointError(c10::str("prefire: this checkpoint is registered to session ", other, "; clear_session(",
                                   other, ") before registering it to session ", session->id));
  }
  registered_ = std::make_shared<Registration>(session, num_slots_);
  return {registered_, true};
}

void Frame::unregister(const SessionCore& session) noexcept {
  std::shared_ptr<Registration> dropped;  // released after the lock
  std::lock_guard<std::mutex> lock(mu_);
  if (!registered_ || registered_->session.get() != &session) return;
  bound_.store(false, std::memory_order_release);
  dropped = std::move(registered_);
}

void Frame::end_pass(const SessionCore& session) noexcept {
  if (std::shared_ptr<Registration> registration = registration_in(session)) registration->recomputation.end_pass();
}

void Frame::keep_past_unpack(const SessionCore& session, std::vector<bool> keep) {
  std::lock_guard<std::mutex> lock(mu_);
  if (registered_ && registered_->session.get() == &session) registered_->keep_past_unpack = std::move(keep);
}

void Frame::end_keeping_pass(const SessionCore& session) noexcept {
  std::vector<bool> keep;
  std::shared_ptr<Registration> registration;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!registered_ || registered_->session.get() != &session) return;
    keep.swap(registered_->keep_past_unpack);
    registration = registered_;
  }
  if (!keep.empty()) registration->recomputation.keep_only(keep);
}

std::shared_ptr<Registration> Frame::registration_in(const SessionCore& session) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!registered_ || registered_->session.get() != &session) return nullptr;
  return registered_;
}

void Frame::bind(bool bound) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  bound_.store(bound && registered_ != nullptr, std::memory_order_release);
}

bool Frame::prefire(Registration& registration) {
  std::optional<RecomputeEvent> event = recompute_once(source(), registration.recomputation,
                                                       RecomputeEvent::Kind::kPrefire, registration.session->id,
                                                       full_extent());
  if (!event) return false;
  registration.session->prefires.fetch_add(1, std::memory_order_relaxed);
  registration.prefired.store(true, std::memory_order_relaxed);
  notify_recompute(*event);
  return true;
}

bool Frame::fetch_ahead() {
  if (!offloaded_ || !forward_done_.load(std::memory_order_acquire)) return false;
  const int64_t graph_task = current_graph_task_id();
  if (graph_task < 0) return false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (registered_) return false;  // its session's recomputation serves it (key 1 of Note [Recomputation keys])
  }
  std::shared_ptr<Recomputation> r = recomputation_for(graph_task);
  if (auto event = recompute_once(source(), *r, RecomputeEvent::Kind::kPrefire, std::nullopt, full_extent())) {
    notify_recompute(*event);
  }
  return true;
}

}  // namespace prefire::detail

namespace prefire {

bool fetch_ahead(const CheckpointHandle& handle) {
  auto frame = detail::HandleAccess::frame(handle, "fetch_ahead");
  return frame && frame->fetch_ahead();
}

}  // namespace prefire
