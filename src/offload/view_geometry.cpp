#include "offload/view_geometry.h"

#include <ATen/ops/empty.h>

namespace prefire::detail {

ViewGeometry ViewGeometry::of(const at::Tensor& t) {
  ViewGeometry g;
  g.offset = t.storage_offset();
  g.sizes.assign(t.sizes().begin(), t.sizes().end());
  g.strides.assign(t.strides().begin(), t.strides().end());
  g.dtype = t.dtype();
  return g;
}

at::Tensor ViewGeometry::over(const c10::Storage& storage) const {
  at::Tensor t = at::empty({0}, at::TensorOptions().dtype(dtype).device(storage.device()));
  t.set_(storage, offset, sizes, strides);
  return t;
}

}  // namespace prefire::detail
