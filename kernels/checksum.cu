// The checksum kernel: a grid-stride loop over 8-byte words, a CUB block
// reduction of the per-thread sums, one atomic add per block. Integer
// addition modulo 2^64 is associative and commutative, so the result does not
// depend on the launch shape or on the order of the atomics.

#include "checksum.h"
#include "checksum_hash.h"

#include <cub/block/block_reduce.cuh>

namespace prefire::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1024;

template <bool kAligned>
__global__ void checksum_kernel(const unsigned char* data, size_t nbytes, unsigned long long* sum_out) {
  using BlockReduce = cub::BlockReduce<unsigned long long, kThreads>;
  __shared__ typename BlockReduce::TempStorage temp;
  const size_t words = (nbytes + 7) / 8;
  const size_t full_words = nbytes / 8;
  unsigned long long acc = 0;
  for (size_t i = blockIdx.x * size_t(kThreads) + threadIdx.x; i < words; i += size_t(gridDim.x) * kThreads) {
    uint64_t word;
    if (kAligned && i < full_words) {
      word = reinterpret_cast<const uint64_t*>(data)[i];
    } else {
      word = load_word_bytes(data, nbytes, i);
    }
    acc += word_hash(word, i);
  }
  unsigned long long block_sum = BlockReduce(temp).Sum(acc);
  if (threadIdx.x == 0) atomicAdd(sum_out, block_sum);
}

}  // namespace

cudaError_t launch_checksum(const void* data, size_t nbytes, unsigned long long* sum_out, cudaStream_t stream) {
  cudaError_t status = cudaMemsetAsync(sum_out, 0, sizeof(*sum_out), stream);
  if (status != cudaSuccess || nbytes == 0) return status;
  const size_t words = (nbytes + 7) / 8;
  const int blocks = static_cast<int>(words / kThreads + 1 < size_t(kMaxBlocks) ? words / kThreads + 1 : kMaxBlocks);
  const auto* bytes = static_cast<const unsigned char*>(data);
  if (reinterpret_cast<uintptr_t>(data) % 8 == 0) {
    checksum_kernel<true><<<blocks, kThreads, 0, stream>>>(bytes, nbytes, sum_out);
  } else {
    checksum_kernel<false><<<blocks, kThreads, 0, stream>>>(bytes, nbytes, sum_out);
  }
  return cudaGetLastError();
}

}  // namespace prefire::kernels
