#include "trace.h"

#include <prefire/observer.h>

#include <fstream>
#include <stdexcept>

namespace prefire_bench {

void Trace::begin_process(int pid, const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  pid_ = pid;
  process_names_[pid] = name;
}

int Trace::tid_of_this_thread() {
  auto [it, inserted] = tids_.emplace(std::this_thread::get_id(), static_cast<int>(tids_.size()));
  return it->second;
}

void Trace::add(const std::string& name, const std::string& category, Clock::time_point begin, Clock::time_point end,
                const char* arg_name, int64_t arg) {
  std::lock_guard<std::mutex> lock(mu_);
  auto us = [&](Clock::time_point t) { return std::chrono::duration<double, std::micro>(t - origin_).count(); };
  events_.push_back({name, category, pid_, tid_of_this_thread(), us(begin), us(end) - us(begin), arg_name, arg});
}

void Trace::observe_recomputations() {
  prefire::set_recompute_observer([this](const prefire::RecomputeEvent& e) {
    bool prefired = e.kind == prefire::RecomputeEvent::Kind::kPrefire;
    add(prefired ? "recompute (prefire)" : "recompute (lazy)", "recompute", e.begin, e.end, "session", e.session);
  });
}

void Trace::stop_observing() { prefire::set_recompute_observer(nullptr); }

void Trace::write(const std::string& path) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::ofstream out(path);
  if (!out) throw std::runtime_error("cannot write the trace to " + path);
  out << "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";
  bool first = true;
  auto sep = [&] {
    if (!first) out << ",\n";
    first = false;
  };
  for (const auto& [pid, name] : process_names_) {
    sep();
    out << "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": " << pid << ", \"tid\": 0, \"args\": {\"name\": \""
        << name << "\"}}";
  }
  for (const auto& e : events_) {
    sep();
    out << "{\"name\": \"" << e.name << "\", \"cat\": \"" << e.category << "\", \"ph\": \"X\", \"pid\": " << e.pid
        << ", \"tid\": " << e.tid << ", \"ts\": " << e.ts_us << ", \"dur\": " << e.dur_us
        << ", \"args\": {\"" << e.arg_name << "\": " << e.arg << "}}";
  }
  out << "\n]}\n";
}

}  // namespace prefire_bench
