#include "offload/storage_copy.h"

#include <ATen/ops/empty.h>
#include <c10/core/CPUAllocator.h>

namespace prefire::detail {

const char* not_offloadable(const at::Tensor& t) {
  if (!t.has_storage() || t.layout() != at::kStrided) return "it is not a dense tensor";
  if (t.unsafeGetTensorImpl()->is_python_dispatch()) return "it is a tensor subclass";
  if (!t.is_cpu()) return "it is not on the CPU (the host file tier takes CPU tensors)";
  if (t.is_quantized()) return "it is quantized";
  if (t.is_conj() || t.is_neg()) return "it is a conjugate or negative view";
  return nullptr;
}

StorageCopy StorageCopy::start(TierStore& tier, const c10::Storage& storage, const std::string& what) {
  StorageCopy copy;
  copy.nbytes = static_cast<int64_t>(storage.nbytes());
  if (copy.nbytes > 0) {
    copy.region = tier.allocate(copy.nbytes, what);
    copy.written = tier.write(storage, copy.region);
  }
  return copy;
}

c10::Storage StorageCopy::empty_storage() const {
  return c10::Storage(c10::Storage::use_byte_size_t(), nbytes, c10::GetCPUAllocator(), /*resizable=*/false);
}

c10::Storage StorageCopy::read_now(TierStore& tier) const {
  c10::Storage storage = empty_storage();
  if (region) {
    written->wait();
    tier.read_now(*region, storage);
  }
  return storage;
}

ViewGeometry ViewGeometry::of(const at::Tensor& t) {
  ViewGeometry g;
  g.offset = t.storage_offset();
  g.sizes.assign(t.sizes().begin(), t.sizes().end());
  g.strides.assign(t.strides().begin(), t.strides().end());
  g.dtype = t.dtype();
  return g;
}

at::Tensor ViewGeometry::over(const c10::Storage& storage) const {
  at::Tensor t = at::empty({0}, at::TensorOptions().dtype(dtype));
  t.set_(storage, offset, sizes, strides);
  return t;
}

}  // namespace prefire::detail
