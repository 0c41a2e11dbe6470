#pragma once

// What prefire-bench prints and writes: the table, the JSON report and the
// SVG chart of peak memory against step time.

#include "pipeline.h"

#include <cstdio>
#include <string>
#include <vector>

namespace prefire_bench {

/// Median, min and max of `v` (non-empty).
struct Spread {
  double median, min, max;
};
Spread spread(std::vector<double> v);

void print_table(std::FILE* out, const RunConfig& config, const std::vector<ModeResult>& results);
/// Per plan mode: its budget, what it held, its step, its blocks, and the
/// configurations without a plan (none, torch, torch-every<n>) that fit the
/// same budget, the fastest of them and the ratios.
void print_memory_sweep(std::FILE* out, const std::vector<ModeResult>& results);
/// Throws std::runtime_error when a file cannot be written.
void write_json(const std::string& path, const RunConfig& config, const std::vector<ModeResult>& results);
void write_svg(const std::string& path, const RunConfig& config, const std::vector<ModeResult>& results);

}  // namespace prefire_bench
