// Note [Offloading a checkpoint]
// An offloaded checkpoint (CheckpointOptions::offload_to) runs its forward as
// any checkpoint does, with its frame packing every saved tensor into a slot;
// what differs is where a slot's tensor comes back from. Instead of running
// the function again, a "recomputation" of an offloaded frame is a fetch: each
// saved storage is read back from the tier into a new storage and each slot
// is rebuilt over it with forward's offset, sizes, strides and dtype, so its
// bytes, and the gradients, are forward's. The fetch fills the same
// Recomputation a recomputation would (checkpoint/recompute.cpp decides which
// runs), so everything above it is unchanged and shared: the keys of Note
// [Recomputation keys], single flight, sessions (one fetched copy serves B and
// W), retain_on_unpack, keep_only, clear, budgets and the byte gauges.
// prefire() of an offloaded checkpoint is a prefetch: its reads are queued
// (on the host file tier's worker; on the prefire stream for the pinned host
// tier, Note [The pinned host tier] in offload/pinned_host_store.h) and return
// at once, and the Recomputation's ready event makes every unpack wait for
// them (as an unpack waits for a prefire stream's event). A lazy fetch (an
// unpack with nothing fetched yet) reads on the unpacking thread (on a device:
// its current stream), after the copy into the tier. The session
// counters and the recompute observer see a fetch as they see a
// recomputation (prefires, lazy recomputes, its kind and times), so what
// times recomputations (a bubble filler) times fetches; RuntimeStats counts
// fetches apart (offload_fetches), never as recomputations.
//
// Forward: a slot whose tensor is a parameter (a leaf that requires grad, or a
// view of one) is kept by reference, as a recomputation would find it again;
// the frame keeps no inputs (it never runs the function again: an input it
// saved, as a block's LayerNorm saves its input, is a slot like the others,
// and one it did not save is needed by nothing), so the block holds nothing
// on the device between forward and fetch but parameters; every other saved
// storage is copied into the tier once, however many slots view it, on the
// tier's worker or copy stream (forward does not wait), and the copy holds
// the storage until it is written, then lets it go: from then on only the tier
// has those bytes, unless something else still holds the tensor (a block's
// output the next block reads). The region is taken from the tier on the
// forward's thread, so a full tier fails the forward, with the reason, before
// anything of that tensor is dropped. What the tier cannot take (a tensor
// that is not dense, not on the tier's kind of device, a tensor subclass, a
// conjugate or negative view, a quantized tensor) fails the forward too: a
// slot is never silently kept.
//
// In place: each slot keeps its tensor's version counter. A fetch whose slot
// was modified in place since it was saved raises CheckpointError, as
// autograd does for a saved tensor modified in place; this also covers a
// modification racing the copy into the tier, so a copy that may hold half
// of a write is never read back. A copy that failed (an I/O error) fails the
// fetch that needs it with the copy's error.
//
// Nested checkpoints: an offloaded frame's nested checkpoints save their
// inputs into its slots like any; its fetch gives them back, and they
// recompute (or fetch) their own as their options say.

#include "checkpoint/offloaded_slots.h"

#include <prefire/errors.h>

#include "memory/storage_census.h"

#include <c10/util/StringUtil.h>

#include <utility>

namespace prefire::detail {

void OffloadedSlots::add(size_t slot, const at::Tensor& tensor) {
  TORCH_INTERNAL_ASSERT(slot == slots_.size(), "offloaded slots out of order");
  Slot entry;
  entry.version = tensor.unsafeGetTensorImpl()->version_counter();
  entry.saved_version = entry.version.enabled() ? entry.version.current_version() : 0;
  if (tensor.has_storage() && !is_activation(tensor)) {  // a parameter: see Note [Offloading a checkpoint]
    entry.kept = tensor.requires_grad() ? tensor.tensor_data() : tensor;
    std::lock_guard<std::mutex> lock(mu_);
    slots_.push_back(std::move(entry));
    return;
  }
  if (const char* why = TierAccess::store(*tier_).refuses(tensor)) {
    throw CheckpointError(c10::str("prefire: an offloaded checkpoint saved a tensor its tier cannot take (saved "
                                   "tensor ", slot, ", ", SlotMetadata::of(tensor).to_string(), "): ", why,
                                   ". Keep or recompute this block instead of offloading it"));
  }
  const c10::Storage& storage = tensor.storage();
  auto found = by_storage_.find(storage.unsafeGetStorageImpl());
  if (found == by_storage_.end()) {
    // On this thread: a full tier fails the forward (Note [Offloading a checkpoint]).
    Stored stored{TierAccess::store(*tier_).copy_in(tensor, c10::str("saved tensor ", slot, " of a checkpoint"))};
    std::lock_guard<std::mutex> lock(mu_);
    found = by_storage_.emplace(storage.unsafeGetStorageImpl(), static_cast<int>(stored_.size())).first;
    stored_.push_back(std::move(stored));
    pins_.push_back(storage.getWeakStorageImpl());
  }
  entry.storage = found->second;
  entry.view = ViewGeometry::of(tensor);
  std::lock_guard<std::mutex> lock(mu_);
  ++stored_[entry.storage].holders;
  slots_.push_back(std::move(entry));
}

void OffloadedSlots::forward_done() {
  by_storage_ = {};
  pins_ = {};
}

void OffloadedSlots::fetch(Recomputation& r, const SlotTable& slots, size_t count, bool prefetch) {
  std::vector<int> fetched(stored_.size(), -1);  // each needed storage's index into `copies`
  std::vector<StorageCopy> copies;
  std::vector<at::Tensor> kept(count);
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t slot = 0; slot < count; ++slot) {
      const Slot& entry = slots_[slot];
      if (entry.released || !slots.alive(slot)) continue;
      if (entry.version.enabled() && entry.version.current_version() != entry.saved_version) {
        throw CheckpointError(c10::str(
            "prefire: saved tensor ", slot, " of an offloaded checkpoint was modified in place after it was saved "
            "(version ", entry.saved_version, " at forward, ", entry.version.current_version(), " now); its copy "
            "in the offload tier may not be what forward saved. Modify a clone instead, or modify it only after "
            "backward"));
      }
      if (entry.storage < 0) {
        kept[slot] = entry.kept;
      } else if (fetched[entry.storage] < 0) {
        fetched[entry.storage] = static_cast<int>(copies.size());
        copies.push_back(stored_[entry.storage].copy);  // holds the region while it is read
      }
    }
  }
  TierStore::ReadBack back = TierAccess::store(*tier_).read(copies, prefetch);
  r.reset(count);
  if (back.in_pool) r.count_in_pool();
  for (size_t slot = 0; slot < count; ++slot) {
    const Slot& entry = slots_[slot];  // its geometry is read-only since forward
    if (entry.storage < 0) {
      if (kept[slot].defined()) r.store(slot, std::move(kept[slot]), slots.counted(slot));
      continue;
    }
    const int index = fetched[entry.storage];
    if (index < 0 || !slots.alive(slot)) continue;
    r.store(slot, entry.view.over(back.storages[index]), /*counted=*/true);  // a new storage, whatever forward's was
    if (!slots.alive(slot)) r.drop(slot);  // released meanwhile (as the recompute driver does)
  }
  if (back.ready) r.set_ready(std::move(back.ready));
}

void OffloadedSlots::release(size_t slot) noexcept {
  std::shared_ptr<Region> freed;  // given back to the tier after the lock
  std::lock_guard<std::mutex> lock(mu_);
  if (slot >= slots_.size()) return;  // released while forward still runs: a slot not added yet
  Slot& entry = slots_[slot];
  if (entry.released) return;
  entry.released = true;
  entry.kept = at::Tensor();
  if (entry.storage >= 0 && --stored_[entry.storage].holders == 0) {
    freed = std::move(stored_[entry.storage].copy.region);
  }
}

}  // namespace prefire::detail
