#pragma once

// What an offloaded checkpoint keeps of its slots instead of recomputing them:
// each saved storage's copy in an offload tier, and how each slot views it.
// See Note [Offloading a checkpoint] in checkpoint/offloaded_slots.cpp.

#include <prefire/offload.h>

#include "checkpoint/recomputation.h"
#include "checkpoint/slots.h"
#include "offload/tier_store.h"
#include "offload/view_geometry.h"

#include <ATen/core/Tensor.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/SmallVector.h>
#include <c10/util/flat_hash_map.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace prefire::detail {

class OffloadedSlots {
 public:
  explicit OffloadedSlots(std::shared_ptr<OffloadTier> tier) : tier_(std::move(tier)) {}

  /// Forward: keeps `tensor`, saved as slot `slot` (slots come in order): a
  /// parameter (a leaf that requires grad, or a view of one) by reference,
  /// anything else as a copy in the tier, queued on the tier's copy worker or
  /// stream. Raises CheckpointError, before anything of this slot is kept,
  /// when the tier cannot take the tensor or is full.
  void add(size_t slot, const at::Tensor& tensor);
  /// Forward is done: storages are no longer told apart by address.
  void forward_done();

  /// Fills `r` (reset to `count` slots) with the first `count` slots that
  /// autograd still holds: read back now (on a device: on the current
  /// stream), or, for a prefetch, queued (the host file tier's worker, the
  /// prefire stream) with `r`'s ready event waiting for the reads. Raises
  /// CheckpointError when a slot's tensor was modified in place since
  /// forward or its copy failed; nothing is stored then.
  void fetch(Recomputation& r, const SlotTable& slots, size_t count, bool prefetch);
  /// Autograd released `slot`: its storage's copy goes once no held slot uses it.
  void release(size_t slot) noexcept;

 private:
  struct Stored {  // one saved storage's copy; its region null once no held slot uses it
    StorageCopy copy;
    int holders = 0;  // slots that use it and autograd holds
  };
  struct Slot {
    int storage = -1;  // index into stored_; -1: kept by reference
    at::Tensor kept;
    ViewGeometry view;
    c10::VariableVersion version{c10::VariableVersion::Disabled::DISABLED};
    uint32_t saved_version = 0;
    bool released = false;
  };

  const std::shared_ptr<OffloadTier> tier_;
  std::mutex mu_;  // guards stored_'s regions and holders, and each slot's `released`
  std::vector<Stored> stored_;
  std::vector<Slot> slots_;
  // Forward only: each storage's index, pinned so that an address is not reused meanwhile.
  ska::flat_hash_map<const c10::StorageImpl*, int> by_storage_;
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> pins_;
};

}  // namespace prefire::detail
