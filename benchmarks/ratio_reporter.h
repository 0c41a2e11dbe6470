#pragma once

// A console reporter that also keeps every run's time per item, so a
// benchmark program can print ratios measured in the same run.

#include <benchmark/benchmark.h>

#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace prefire::bench {

class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    // With --benchmark_repetitions the median aggregate stands for the
    // benchmark; without, its single run.
    for (const auto& run : runs) {
      if (run.error_occurred) continue;
      bool median = run.run_type == Run::RT_Aggregate && run.aggregate_name == "median";
      if (run.run_type != Run::RT_Iteration && !median) continue;
      std::string name = run.run_name.str();
      if (!median && medians_.count(name)) continue;
      if (median) medians_.insert(name);
      double seconds = run.GetAdjustedRealTime() / benchmark::GetTimeUnitMultiplier(run.time_unit);
      auto items = run.counters.find("items_per_second");
      // Time per item when the benchmark counts items, else per iteration.
      per_item_ns_[name] =
          items != run.counters.end() && items->second.value > 0 ? 1e9 / items->second.value : seconds * 1e9;
    }
    ConsoleReporter::ReportRuns(runs);
  }

  /// ns per item (or per iteration) of `name`, or a negative value when it did not run.
  double ns(const std::string& name) const {
    auto it = per_item_ns_.find(name);
    return it == per_item_ns_.end() ? -1.0 : it->second;
  }

  /// Prints "label: numerator / denominator = ratio" for each pair that ran.
  void print_ratios(const std::vector<std::pair<std::string, std::pair<std::string, std::string>>>& ratios) const {
    std::printf("\nRatios (same run):\n");
    for (const auto& [label, pair] : ratios) {
      double num = ns(pair.first), den = ns(pair.second);
      if (num < 0 || den <= 0) {
        std::printf("  %-50s skipped (%s or %s did not run)\n", label.c_str(), pair.first.c_str(),
                    pair.second.c_str());
        continue;
      }
      std::printf("  %-50s %12s / %12s = %.3f\n", label.c_str(), human(num).c_str(), human(den).c_str(), num / den);
    }
  }

 private:
  static std::string human(double ns) {
    char buf[32];
    if (ns >= 1e6) std::snprintf(buf, sizeof buf, "%.2f ms", ns / 1e6);
    else if (ns >= 1e3) std::snprintf(buf, sizeof buf, "%.2f us", ns / 1e3);
    else std::snprintf(buf, sizeof buf, "%.1f ns", ns);
    return buf;
  }

  std::map<std::string, double> per_item_ns_;
  std::set<std::string> medians_;
};

/// Runs the benchmarks selected on the command line and prints `ratios`.
/// Unless the command line says otherwise, each benchmark runs 5 times,
/// randomly interleaved with the others, and ratios use the medians: these
/// machines are shared and a single run drifts by 10-20 %.
inline int run_with_ratios(int argc, char** argv,
                           const std::vector<std::pair<std::string, std::pair<std::string, std::string>>>& ratios,
                           RatioReporter* reporter_out = nullptr) {
  std::vector<char*> args(argv, argv + argc);
  bool repetitions_given = false;
  for (int i = 1; i < argc; ++i) repetitions_given |= std::string(argv[i]).rfind("--benchmark_repetitions", 0) == 0;
  static char repetitions[] = "--benchmark_repetitions=5";
  static char interleave[] = "--benchmark_enable_random_interleaving=true";
  static char aggregates[] = "--benchmark_report_aggregates_only=true";
  if (!repetitions_given) args.insert(args.end(), {repetitions, interleave, aggregates});
  argc = static_cast<int>(args.size());
  argv = args.data();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  RatioReporter local;
  RatioReporter& reporter = reporter_out ? *reporter_out : local;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  reporter.print_ratios(ratios);
  benchmark::Shutdown();
  return 0;
}

}  // namespace prefire::bench
