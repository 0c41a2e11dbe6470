#pragma once

// The free space of a tier: regions handed out first fit, in whole pages,
// and merged with their neighbours when freed.

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

namespace prefire::detail {

class Space;

/// A part of a tier that holds one offloaded storage. Freed back to its
/// space when the last reference goes (the offloaded slots' and the pending
/// copies').
struct Region {
  int64_t offset = 0;
  int64_t nbytes = 0;    // what was asked for
  int64_t reserved = 0;  // nbytes rounded up to whole pages
};

class Space {
 public:
  static constexpr int64_t kPage = 4096;

  explicit Space(int64_t capacity);
  Space(const Space&) = delete;
  Space& operator=(const Space&) = delete;

  /// A region of `nbytes` (> 0), or nullptr when no free run is long enough.
  /// The Space must outlive the region.
  std::shared_ptr<Region> allocate(int64_t nbytes);

  int64_t capacity() const { return capacity_; }
  int64_t used() const;
  int64_t peak() const;
  void reset_peak();
  /// The longest free run, in bytes (what allocate() can still hand out at most).
  int64_t largest_free() const;

 private:
  void free(const Region& region) noexcept;

  const int64_t capacity_;
  mutable std::mutex mu_;
  std::map<int64_t, int64_t> free_;  // offset -> length of each free run; runs never touch
  int64_t used_ = 0;
  int64_t peak_ = 0;
};

}  // namespace prefire::detail
