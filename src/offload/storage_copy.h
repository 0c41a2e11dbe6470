#pragma once

// One saved storage's copy in a tier, and a saved tensor's view of it: what
// an offloaded tensor is made of (checkpoint/offloaded_slots.h keeps a
// checkpoint's; checkpoint/frame_inputs.h a checkpoint's inputs).

#include "offload/copy_worker.h"
#include "offload/space.h"
#include "offload/tier_store.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>
#include <c10/util/SmallVector.h>

#include <cstdint>
#include <memory>
#include <string>

namespace prefire::detail {

/// Why `t` cannot go to a host tier, or nullptr when it can.
const char* not_offloadable(const at::Tensor& t);

struct StorageCopy {
  std::shared_ptr<Region> region;  // null for 0 bytes
  std::shared_ptr<Copy> written;
  int64_t nbytes = 0;

  /// Takes a region for `storage` (CheckpointError naming `what` when the
  /// tier is full) and queues the copy into it.
  static StorageCopy start(TierStore& tier, const c10::Storage& storage, const std::string& what);
  /// A new CPU storage of nbytes, to read the copy into.
  c10::Storage empty_storage() const;
  /// Reads the copy into a new storage on this thread, after the write.
  c10::Storage read_now(TierStore& tier) const;
};

/// How a saved tensor views its storage.
struct ViewGeometry {
  int64_t offset = 0;
  c10::SmallVector<int64_t, 5> sizes;
  c10::SmallVector<int64_t, 5> strides;
  caffe2::TypeMeta dtype;

  static ViewGeometry of(const at::Tensor& t);
  /// A tensor with this geometry over `storage` (no autograd metadata).
  at::Tensor over(const c10::Storage& storage) const;
};

}  // namespace prefire::detail
