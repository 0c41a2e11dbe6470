// determinism_check = checksum on CPU: the hash itself (one-bit changes,
// logical element order, byte-level definition) and the checkpoint mode that
// uses it.
//
// Not covered here: the CUDA kernel and its equality with this loop
// (cuda_test.cpp, which needs a GPU).

#include "test_support.h"

#include "checkpoint/checksum.h"

#include <cstring>

namespace prefire::testing {
namespace {

using ::testing::HasSubstr;

TEST(Checksum, OneBitChangeChangesTheHash) {
  for (size_t n : {1u, 7u, 8u, 9u, 63u, 64u, 1000u, 4097u}) {
    std::vector<unsigned char> bytes(n);
    for (size_t i = 0; i < n; ++i) bytes[i] = static_cast<unsigned char>(i * 131 + 7);
    const uint64_t base = detail::bytes_checksum(bytes.data(), n);
    for (size_t pos : {size_t(0), n / 2, n - 1}) {
      for (int bit = 0; bit < 8; ++bit) {
        bytes[pos] ^= static_cast<unsigned char>(1u << bit);
        EXPECT_NE(detail::bytes_checksum(bytes.data(), n), base) << "n=" << n << " byte " << pos << " bit " << bit;
        bytes[pos] ^= static_cast<unsigned char>(1u << bit);
      }
    }
    EXPECT_EQ(detail::bytes_checksum(bytes.data(), n), base);
  }
}

TEST(Checksum, SwappedWordsAndLengthsGiveDifferentHashes) {
  uint64_t words[2] = {1, 2}, swapped[2] = {2, 1};
  EXPECT_NE(detail::bytes_checksum(words, 16), detail::bytes_checksum(swapped, 16));
  unsigned char zeros[16] = {};
  EXPECT_NE(detail::bytes_checksum(zeros, 15), detail::bytes_checksum(zeros, 16));  // padding is not data
}

TEST(Checksum, TensorChecksumHashesLogicalOrderBytes) {
  auto t = at::randn({6, 5});
  auto transposed = t.t();  // not contiguous
  auto copy = transposed.contiguous();
  EXPECT_EQ(detail::tensor_checksum(transposed), detail::tensor_checksum(copy));
  EXPECT_EQ(detail::tensor_checksum(copy), detail::bytes_checksum(copy.const_data_ptr(), copy.nbytes()));
  EXPECT_NE(detail::tensor_checksum(transposed), detail::tensor_checksum(t));
}

TEST(Checksum, CheckpointChecksumModeCatchesDropoutWithoutRngRestore) {
  auto x = at::randn({8, 64}).requires_grad_(true);
  CheckpointFn fn = [](const TensorList& in) { return TensorList{at::dropout(in[0], 0.5, true).sin()}; };
  CheckpointOptions options;
  options.preserve_rng_state = false;
  options.determinism_check = DeterminismCheck::kChecksum;
  auto y = checkpoint(fn, {x}, options)[0];
  const std::string message = message_of([&] { grads(y, {x}); });
  EXPECT_THAT(message, HasSubstr("other values in the recomputation than in forward"));
  EXPECT_THAT(message, HasSubstr("checksum 0x"));
  options.determinism_check = DeterminismCheck::kMetadata;  // the same bug passes the metadata check
  auto y2 = checkpoint(fn, {x}, options)[0];
  EXPECT_NO_THROW(grads(y2, {x}));
}

TEST(Checksum, CheckpointChecksumModePassesWithPreservedRngAndMatchesGradients) {
  at::manual_seed(31);
  Block block(16, 0.2);
  auto x = at::randn({2, 5, 16}).requires_grad_(true);
  auto wrt = concat({x}, block.params());
  at::manual_seed(5);
  auto expected = grads(block.forward(x), wrt);
  CheckpointOptions options;
  options.determinism_check = parse_determinism_check("checksum");
  at::manual_seed(5);
  auto y = checkpoint(block.fn(), {x}, options)[0];
  expect_all_equal(grads(y, wrt), expected);
}

}  // namespace
}  // namespace prefire::testing
