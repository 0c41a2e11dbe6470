#pragma once

// How a saved tensor views its storage: what rebuilds it over the storage its
// tier's copy is read back into (checkpoint/offloaded_slots.h,
// checkpoint/frame_inputs.cpp).

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>
#include <c10/util/SmallVector.h>

#include <cstdint>

namespace prefire::detail {

struct ViewGeometry {
  int64_t offset = 0;
  c10::SmallVector<int64_t, 5> sizes;
  c10::SmallVector<int64_t, 5> strides;
  caffe2::TypeMeta dtype;

  static ViewGeometry of(const at::Tensor& t);
  /// A tensor with this geometry over `storage`, on its device (no autograd metadata).
  at::Tensor over(const c10::Storage& storage) const;
};

}  // namespace prefire::detail
