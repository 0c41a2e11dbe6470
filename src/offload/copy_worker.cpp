#include "offload/copy_worker.h"

#include <utility>

namespace prefire::detail {

void WorkerCopy::wait() const {
  std::unique_lock<std::mutex> lock(mu_);
  finished_.wait(lock, [&] { return done_; });
  if (error_) std::rethrow_exception(error_);
}

bool WorkerCopy::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

void WorkerCopy::finish(std::exception_ptr error) noexcept {
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    error_ = std::move(error);
  }
  finished_.notify_all();
}

CopyWorker::CopyWorker(std::function<void()> after_each)
    : after_each_(std::move(after_each)), thread_([this] { run(); }) {}

CopyWorker::~CopyWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  queued_.notify_one();
  thread_.join();
}

std::shared_ptr<Copy> CopyWorker::enqueue(std::function<void()> work) {
  auto copy = std::make_shared<WorkerCopy>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.emplace_back(std::move(work), copy);
  }
  queued_.notify_one();
  return copy;
}

std::shared_ptr<Copy> CopyWorker::run_here(const std::function<void()>& work) {
  auto copy = std::make_shared<WorkerCopy>();
  std::exception_ptr error;
  try {
    work();
  } catch (...) {
    error = std::current_exception();
  }
  copy->finish(std::move(error));
  return copy;
}

void CopyWorker::run() {
  for (;;) {
    std::pair<std::function<void()>, std::shared_ptr<WorkerCopy>> next;
    {
      std::unique_lock<std::mutex> lock(mu_);
      queued_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and nothing left to copy
      next = std::move(queue_.front());
      queue_.pop_front();
    }
    std::exception_ptr error;
    try {
      next.first();
    } catch (...) {
      error = std::current_exception();
    }
    next.first = nullptr;  // what the copy held goes before anyone is told it is done
    next.second->finish(std::move(error));
    if (after_each_) after_each_();
  }
}

}  // namespace prefire::detail
