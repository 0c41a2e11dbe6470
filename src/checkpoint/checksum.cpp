#include "checkpoint/checksum.h"

#include "cuda/checksum_cuda.h"

#include "kernels/checksum_hash.h"

#include <c10/util/Exception.h>

#include <cstring>

namespace prefire::detail {

uint64_t bytes_checksum(const void* data, size_t nbytes) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  const size_t full_words = nbytes / 8;
  uint64_t sum = 0;
  for (size_t i = 0; i < full_words; ++i) {
    uint64_t word;
    std::memcpy(&word, bytes + 8 * i, 8);  // little-endian hosts only (x86-64, aarch64)
    sum += kernels::word_hash(word, i);
  }
  if (nbytes % 8 != 0) sum += kernels::word_hash(kernels::load_word_bytes(bytes, nbytes, full_words), full_words);
  return kernels::finalize_checksum(sum, nbytes);
}

uint64_t tensor_checksum(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  if (c.is_cuda()) return cuda_tensor_checksum(c);
  TORCH_CHECK(c.is_cpu(), "prefire: determinism_check = checksum supports CPU and CUDA tensors, got ", c.device());
  return bytes_checksum(c.const_data_ptr(), c.nbytes());
}

}  // namespace prefire::detail
