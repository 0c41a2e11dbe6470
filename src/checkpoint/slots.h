#pragma once

// A checkpoint's slots: one per tensor autograd saved inside its forward,
// as forward saved it. Forward writes them (Frame::pack), the recompute
// driver reads them (checkpoint/recompute.h) and autograd's releases mark
// them (Frame::release).

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/SmallVector.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>

namespace prefire::detail {

/// What the determinism check compares per saved tensor.
struct SlotMetadata {
  c10::SmallVector<int64_t, 5> sizes;
  at::ScalarType dtype = at::kFloat;
  c10::Device device = c10::Device(c10::kCPU);
  std::optional<uint64_t> checksum;  // determinism_check = checksum only; compared on its own

  static SlotMetadata of(const at::Tensor& t);
  /// Whether `t` has this shape, dtype and device (no allocation: the recompute path's check).
  bool matches(const at::Tensor& t) const;
  std::string to_string() const;
};

/// How much of `fn` one recomputation redoes: the slots it fills, and
/// whether it stops once the last of them is saved (Note [Early stop] in
/// checkpoint/frame.cpp).
struct Extent {
  size_t slots = 0;
  bool stop_at_last = false;
};

/// The slots of one checkpoint. Metadata and counted flags are written by
/// the forward thread while forward runs and read-only once it is done (a
/// backward inside forward reads only the slots saved before it, on the
/// forward's thread). Whether autograd still holds a slot's saved tensor is
/// read and written on any thread.
class SlotTable {
 public:
  /// Forward: adds a slot and returns its index. `counted`: its storage is
  /// new memory, counted in recomputed bytes (Note [Counting saved bytes]).
  size_t add(SlotMetadata metadata, bool counted);

  /// Slots saved so far (all of them once forward is done). Any thread.
  size_t size() const;
  const SlotMetadata& metadata(size_t slot) const { return metadata_[slot]; }
  bool counted(size_t slot) const { return counted_[slot] != 0; }

  /// Autograd released the saved tensor of `slot`: no recomputation stores it again. Any thread.
  void release(size_t slot) noexcept;
  /// Whether autograd still holds the saved tensor of `slot`. Any thread.
  bool alive(size_t slot) const;

 private:
  // Per-slot vectors keep a few slots inline: most checkpoints save a
  // handful of tensors, and these are filled on the forward's hot path.
  c10::SmallVector<SlotMetadata, 4> metadata_;
  c10::SmallVector<uint8_t, 8> counted_;
  mutable std::mutex mu_;               // guards alive_
  c10::SmallVector<uint8_t, 8> alive_;  // by slot
};

}  // namespace prefire::detail
