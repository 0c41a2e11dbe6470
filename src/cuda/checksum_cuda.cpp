// Host side of the checksum kernel: launches it on the current stream of the
// tensor's device and brings the sum back.

#include "cuda/checksum_cuda.h"

#include <c10/util/Exception.h>

#if PREFIRE_WITH_CUDA
#include "kernels/checksum.h"
#include "kernels/checksum_hash.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace prefire::detail {

#if PREFIRE_WITH_CUDA

uint64_t cuda_tensor_checksum(const at::Tensor& contiguous) {
  TORCH_INTERNAL_ASSERT(contiguous.is_cuda() && contiguous.is_contiguous());
  c10::cuda::CUDAGuard device(contiguous.device());
  auto sum = at::empty({1}, contiguous.options().dtype(at::kLong));
  auto stream = c10::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(kernels::launch_checksum(contiguous.const_data_ptr(), contiguous.nbytes(),
                                          static_cast<unsigned long long*>(sum.data_ptr()), stream.stream()));
  return kernels::finalize_checksum(static_cast<uint64_t>(sum.item<int64_t>()), contiguous.nbytes());
}

#else

uint64_t cuda_tensor_checksum(const at::Tensor&) {
  TORCH_CHECK(false, "prefire was built without CUDA (PREFIRE_CUDA=OFF or no nvcc): cannot checksum a CUDA tensor");
}

#endif

}  // namespace prefire::detail
