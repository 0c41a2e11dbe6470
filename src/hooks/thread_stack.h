#pragma once

// Per-thread intrusive stacks (hook contexts, handle collectors) whose entries
// may leave in any order on their own thread.
//
// Note [Scopes that leave out of order]
// RAII scopes normally leave last-in first-out, but a user can end one early
// (SavedTensorMeter::stop()) or keep one on the heap. Popping "the top"
// regardless would leave the thread-local pointing at a destroyed entry, so a
// leaving entry is unlinked wherever it is, in every build type. An entry that
// is not on this thread's stack at all is being ended on another thread: that
// cannot be repaired (the other thread's pointer is out of reach), so it is a
// fatal misuse with a message (fatal_misuse), never a silent corruption.

#include <string>

namespace prefire::detail {

/// Unlinks `entry` from the stack whose top is `top`; `below(e)` is a
/// reference to the link under `e`. False when `entry` is not on the stack.
template <typename T, typename Below>
bool unlink_from_stack(T*& top, T* entry, Below below) {
  for (T** link = &top; *link != nullptr; link = &below(**link)) {
    if (*link == entry) {
      *link = below(*entry);
      return true;
    }
  }
  return false;
}

/// Prints "prefire: fatal misuse: <what>" to stderr and aborts. For misuse
/// found where nothing can be thrown (destructors) and nothing can be repaired.
[[noreturn]] void fatal_misuse(const std::string& what) noexcept;

}  // namespace prefire::detail
