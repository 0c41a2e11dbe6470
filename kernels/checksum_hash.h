#pragma once

// The checksum of a byte buffer, defined once for host and device so the CPU
// loop and the CUDA kernel agree by construction.
//
// checksum(bytes) = finalize(sum over 8-byte words w_i of word_hash(w_i, i), nbytes)
// with the sum taken modulo 2^64. The words are little-endian loads, the last
// one zero-padded. A sum is order-free, so any parallel reduction gives the
// same value; position enters through word_hash, and a one-bit change changes
// one term by a mixed (avalanched) amount.

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define PREFIRE_HOST_DEVICE __host__ __device__
#else
#define PREFIRE_HOST_DEVICE
#endif

namespace prefire::kernels {

// splitmix64's finalizer.
PREFIRE_HOST_DEVICE inline uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

PREFIRE_HOST_DEVICE inline uint64_t word_hash(uint64_t word, uint64_t index) { return mix64(word ^ mix64(index)); }

PREFIRE_HOST_DEVICE inline uint64_t finalize_checksum(uint64_t sum, uint64_t nbytes) {
  return mix64(sum ^ mix64(nbytes ^ 0x5bd1e9955bd1e995ULL));
}

/// Word `i` of a buffer of `nbytes` bytes, little-endian, zero-padded.
PREFIRE_HOST_DEVICE inline uint64_t load_word_bytes(const unsigned char* data, size_t nbytes, size_t i) {
  uint64_t word = 0;
  size_t begin = i * 8;
  size_t n = nbytes - begin < 8 ? nbytes - begin : 8;
  for (size_t b = 0; b < n; ++b) word |= static_cast<uint64_t>(data[begin + b]) << (8 * b);
  return word;
}

}  // namespace prefire::kernels
