#pragma once

// A Chrome / Perfetto trace of the schedule ("traceEvents" JSON): one
// process per mode, the main thread's phases and the recomputations
// (from prefire's RecomputeObserver) on their threads.

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace prefire_bench {

class Trace {
 public:
  using Clock = std::chrono::steady_clock;

  /// Events after this call belong to process `pid`, named `name`.
  void begin_process(int pid, const std::string& name);
  /// A complete event on the calling thread; `arg` goes to args as `arg_name`.
  void add(const std::string& name, const std::string& category, Clock::time_point begin, Clock::time_point end,
           const char* arg_name, int64_t arg);
  /// Starts observing prefire's recomputations (until stop_observing()).
  void observe_recomputations();
  void stop_observing();
  /// Writes the trace; throws std::runtime_error when the file cannot be written.
  void write(const std::string& path) const;

 private:
  struct Event {
    std::string name, category;
    int pid;
    int tid;
    double ts_us, dur_us;
    const char* arg_name;
    int64_t arg;
  };
  int tid_of_this_thread();

  mutable std::mutex mu_;
  Clock::time_point origin_ = Clock::now();
  int pid_ = 0;
  std::map<int, std::string> process_names_;
  std::map<std::thread::id, int> tids_;
  std::vector<Event> events_;
};

}  // namespace prefire_bench
