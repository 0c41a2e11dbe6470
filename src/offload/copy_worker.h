#pragma once

// A thread that runs a tier's copies in the order they are queued: the host
// tier's stand-in for a copy stream. Whoever needs a copy's bytes waits on
// its Copy, as a stream waits on an event.

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

namespace prefire::detail {

/// One queued copy, on whatever runs a tier's copies (a worker thread, a
/// CUDA stream); a tier's copies are all of one kind.
class Copy {
 public:
  virtual ~Copy() = default;
  /// Blocks until the copy ran; rethrows what it raised.
  virtual void wait() const = 0;
  /// Whether it ran (and let go of what it held), without waiting.
  virtual bool done() const = 0;
};

/// A copy on a CopyWorker.
class WorkerCopy final : public Copy {
 public:
  void wait() const override;
  bool done() const override;

 private:
  friend class CopyWorker;
  void finish(std::exception_ptr error) noexcept;

  mutable std::mutex mu_;
  mutable std::condition_variable finished_;
  bool done_ = false;
  std::exception_ptr error_;
};

class CopyWorker {
 public:
  /// `after_each` (optional, noexcept) runs on the worker thread after each
  /// copy is done and has let go of what it held.
  explicit CopyWorker(std::function<void()> after_each = {});
  /// Runs every copy still queued, then ends the thread.
  ~CopyWorker();
  CopyWorker(const CopyWorker&) = delete;
  CopyWorker& operator=(const CopyWorker&) = delete;

  /// Queues `work` after every copy queued before it. `work` runs on the
  /// worker thread; what it raises is kept for Copy::wait(). What `work`
  /// holds is released on the worker thread once it ran.
  std::shared_ptr<Copy> enqueue(std::function<void()> work);
  /// Runs `work` on this thread now, as the worker would (what it raises is
  /// kept for Copy::wait()); for copies the worker must not run.
  static std::shared_ptr<Copy> run_here(const std::function<void()>& work);

 private:
  void run();

  std::mutex mu_;
  std::condition_variable queued_;
  std::deque<std::pair<std::function<void()>, std::shared_ptr<WorkerCopy>>> queue_;
  bool stopping_ = false;
  const std::function<void()> after_each_;
  std::thread thread_;  // last: started once the fields above exist
};

}  // namespace prefire::detail
