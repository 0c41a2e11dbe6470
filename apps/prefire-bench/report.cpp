#include "report.h"

#include <prefire/cuda.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <stdexcept>
#include <type_traits>

namespace prefire_bench {

Spread spread(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  double median = n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
  return {median, v.front(), v.back()};
}

namespace {

double mib(int64_t bytes) { return double(bytes) / (1024.0 * 1024.0); }

std::ofstream open_or_throw(const std::string& path) {
  std::ofstream out(path);
  if (!out) throw std::runtime_error("cannot write " + path);
  return out;
}

}  // namespace

void print_table(std::FILE* out, const RunConfig& c, const std::vector<ModeResult>& results) {
  const bool cuda = c.device.is_cuda();
  std::fprintf(out, "\n%-12s %14s %12s %12s %10s %22s %22s %12s %8s %11s\n", "mode", "step peak MiB",
               "held MiB", "session MiB", "B->W MiB", "step ms med [min-max]", "F / B / W ms per mb", "recomp/step",
               "refused", "max|dgrad|");
  for (const auto& r : results) {
    auto s = spread(r.step_ms);
    char step[64], passes[64];
    std::snprintf(step, sizeof step, "%.1f [%.1f-%.1f]", s.median, s.min, s.max);
    std::snprintf(passes, sizeof passes, "%.1f / %.1f / %.1f", r.forward_ms, r.b_ms, r.w_ms);
    std::fprintf(out, "%-12s %14.2f %12.2f %12.2f %10.2f %22s %22s %12.1f %8.1f %11.3g\n", r.label.c_str(),
                 mib(r.step_peak_bytes), mib(r.peak_held_bytes), mib(r.peak_session_bytes), mib(r.held_b_to_w_bytes),
                 step, passes, r.recomputes_per_step, r.refused_per_step, r.max_grad_diff);
  }
  if (!cuda) return;
  // The caching allocator's view: reserved memory and the part of it the
  // peak allocation left unused (fragmentation and cache).
  std::fprintf(out, "\n%-12s %18s\n", "mode", "peak reserved MiB");
  for (const auto& r : results) {
    if (r.peak_reserved_bytes <= 0) continue;
    std::fprintf(out, "%-12s %18.2f\n", r.label.c_str(), mib(r.peak_reserved_bytes));
  }
}

void print_memory_sweep(std::FILE* out, const std::vector<ModeResult>& results) {
  const ModeResult* none = nullptr;
  for (const auto& r : results) {
    if (r.mode == Mode::kNone) none = &r;
  }
  std::fprintf(out, "\nmemory sweep (budgets: fractions of none's peak held bytes, the least plan where that is "
                    "less, covering prefire's census; a configuration fits when its step peak, by the allocator, is at "
                    "most the plan's; c: checkpointed, k: kept; per micro-batch, split by / where they differ)\n"
                    "%-10s %10s %9s %9s %10s %10s  %-14s %-44s %9s %7s\n",
               "plan", "budget MiB", "held MiB", "plan MiB", "step peak", "step ms", "blocks", "that fit: step ms",
               "plan/best", "/none");
  for (const auto& r : results) {
    if (r.mode != Mode::kPlan) continue;
    std::string blocks, fit;  // per micro-batch, split by / where they differ
    for (const auto& per_block : r.checkpointed) {
      std::string letters;
      for (bool c : per_block) letters += c ? 'c' : 'k';
      if (blocks.empty() || r.checkpointed.front() != per_block) blocks += (blocks.empty() ? "" : "/") + letters;
    }
    const double step = spread(r.step_ms).median;
    double best = 0;
    for (const auto& other : results) {
      const bool configuration = other.mode == Mode::kNone || other.mode == Mode::kTorch || other.mode == Mode::kTorchEvery;
      if (!configuration || other.step_peak_bytes > r.step_peak_bytes) continue;
      const double s = spread(other.step_ms).median;
      char cell[48];
      std::snprintf(cell, sizeof cell, "%s%s %.0f", fit.empty() ? "" : ", ", other.label.c_str(), s);
      fit += cell;
      if (best == 0 || s < best) best = s;
    }
    std::fprintf(out, "%-10s %10.2f %9.2f %9.2f %10.2f %10.1f  %-14s %-44s %9s %7.2f%s\n", r.label.c_str(),
                 mib(r.budget_bytes), mib(r.peak_held_bytes), mib(r.plan_bytes), mib(r.step_peak_bytes), step,
                 blocks.c_str(), fit.empty() ? "none fits" : fit.c_str(),
                 best > 0 ? std::to_string(step / best).substr(0, 4).c_str() : "-",
                 none ? step / spread(none->step_ms).median : NAN,
                 r.peak_held_bytes > r.budget_bytes ? "  OVER BUDGET" : "");
  }
}

namespace {
// A figure measured only where it applies: JSON null otherwise (and for NaN).
template <typename T>
nlohmann::json measured(T value, bool applies = true) {
  if constexpr (std::is_floating_point_v<T>) applies = applies && std::isfinite(value);
  return applies ? nlohmann::json(value) : nlohmann::json(nullptr);
}
}  // namespace

void write_json(const std::string& path, const RunConfig& c, const std::vector<ModeResult>& results) {
  const auto& m = c.model;
  nlohmann::json report;
  report["config"] = {{"layers", m.layers},         {"hidden", m.hidden},
                      {"heads", m.heads},           {"seq", m.seq},
                      {"micro_batch", m.micro_batch}, {"micro_batches", c.micro_batches},
                      {"steps", c.steps},           {"warmup", c.warmup},
                      {"dropout", m.dropout},       {"seed", c.seed},
                      {"order", to_string(c.order)}, {"in_flight", c.in_flight},
                      {"device", c.device.str()},   {"session_pool", prefire::session_pool_enabled()}};
  nlohmann::json modes = nlohmann::json::array();
  for (const auto& r : results) {
    const auto s = spread(r.step_ms);
    const bool sessions = uses_sessions(r.mode);
    modes.push_back({
        {"label", r.label},
        {"mode", to_string(r.mode)},
        {"budget_fraction", r.budget_fraction ? nlohmann::json(*r.budget_fraction) : nlohmann::json(nullptr)},
        {"budget_bytes", r.budget_bytes},
        {"step_peak_bytes", r.step_peak_bytes},
        {"peak_held_bytes", r.peak_held_bytes},
        {"peak_session_bytes", r.peak_session_bytes},
        {"held_b_to_w_bytes", measured(r.held_b_to_w_bytes, sessions)},
        {"held_b_to_w_fraction", measured(r.held_b_to_w_fraction, sessions)},
        {"peak_reserved_bytes", measured(r.peak_reserved_bytes, r.peak_reserved_bytes >= 0)},
        {"step_ms", {{"median", s.median}, {"min", s.min}, {"max", s.max}, {"all", r.step_ms}}},
        {"per_micro_batch_ms", {{"forward", r.forward_ms}, {"b", r.b_ms}, {"w", r.w_ms}}},
        {"recomputes_per_step", r.recomputes_per_step},
        {"refused_prefires_per_step", r.refused_per_step},
        {"max_grad_diff", measured(r.max_grad_diff)},
        {"checkpointed", r.checkpointed},
        {"least_plan_bytes", measured(r.least_plan_bytes, r.mode == Mode::kPlan)},
        {"plan_bytes", measured(r.plan_bytes, r.mode == Mode::kPlan)},
        {"measuring_held_bytes", measured(r.measuring_held_bytes, r.mode == Mode::kPlan)},
        {"released_after_b_per_step", measured(r.released_after_b_per_step, r.mode == Mode::kPlan)},
        {"released_per_micro_batch", r.mode == Mode::kPlan ? nlohmann::json(r.released_per_micro_batch)
                                                            : nlohmann::json(nullptr)},
    });
  }
  report["modes"] = std::move(modes);
  auto out = open_or_throw(path);
  out << report.dump(2) << "\n";
}

void write_svg(const std::string& path, const RunConfig& c, const std::vector<ModeResult>& results) {
  auto out = open_or_throw(path);
  const double width = 720, height = 480, left = 80, right = 40, top = 50, bottom = 60;
  double tmax = 0, mmax = 0;
  for (const auto& r : results) {
    tmax = std::max(tmax, spread(r.step_ms).median);
    mmax = std::max(mmax, mib(r.step_peak_bytes));
  }
  tmax = tmax > 0 ? tmax * 1.15 : 1;
  mmax = mmax > 0 ? mmax * 1.15 : 1;
  auto px = [&](double t) { return left + t / tmax * (width - left - right); };
  auto py = [&](double mb) { return height - bottom - mb / mmax * (height - top - bottom); };
  const char* palette[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"};

  out << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
      << "\" viewBox=\"0 0 " << width << " " << height << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "<text x=\"" << width / 2 << "\" y=\"24\" text-anchor=\"middle\" font-size=\"15\">prefire-bench: "
      << (c.device.is_cuda() ? "peak allocated" : "peak saved-tensor") << " memory vs step time ("
      << c.model.layers << " layers, " << c.micro_batches << " micro-batches, order " << to_string(c.order) << ", "
      << c.device.str() << ")</text>\n";
  // Axes with five ticks each.
  out << "<line x1=\"" << left << "\" y1=\"" << height - bottom << "\" x2=\"" << width - right << "\" y2=\""
      << height - bottom << "\" stroke=\"black\"/>\n<line x1=\"" << left << "\" y1=\"" << top << "\" x2=\"" << left
      << "\" y2=\"" << height - bottom << "\" stroke=\"black\"/>\n";
  for (int i = 0; i <= 5; ++i) {
    double t = tmax * i / 5, mb = mmax * i / 5;
    out << "<text x=\"" << px(t) << "\" y=\"" << height - bottom + 18 << "\" text-anchor=\"middle\">"
        << std::round(t * 10) / 10 << "</text>\n";
    out << "<text x=\"" << left - 8 << "\" y=\"" << py(mb) + 4 << "\" text-anchor=\"end\">"
        << std::round(mb * 10) / 10 << "</text>\n";
    out << "<line x1=\"" << left << "\" y1=\"" << py(mb) << "\" x2=\"" << width - right << "\" y2=\"" << py(mb)
        << "\" stroke=\"#ddd\"/>\n";
  }
  out << "<text x=\"" << (left + width - right) / 2 << "\" y=\"" << height - 18
      << "\" text-anchor=\"middle\">median step time (ms)</text>\n"
      << "<text transform=\"translate(20," << (top + height - bottom) / 2
      << ") rotate(-90)\" text-anchor=\"middle\">step peak, allocator (MiB)</text>\n";
  // Labels go to the first of four places beside their point that no earlier
  // label covers (points of similar modes often sit close together).
  struct Box {
    double x0, y0, x1, y1;
  };
  std::vector<Box> placed;
  for (size_t i = 0; i < results.size(); ++i) {
    const auto& r = results[i];
    double x = px(spread(r.step_ms).median), y = py(mib(r.step_peak_bytes));
    const double w = 7.0 * r.label.size(), h = 14;
    const double candidates[4][2] = {{9, -8}, {9, 18}, {-9 - w, -8}, {-9 - w, 18}};
    double lx = x + 9, ly = y - 8;
    for (const auto& c : candidates) {
      Box b{x + c[0], y + c[1] - h, x + c[0] + w, y + c[1]};
      bool free = std::none_of(placed.begin(), placed.end(), [&](const Box& o) {
        return b.x0 < o.x1 && o.x0 < b.x1 && b.y0 < o.y1 && o.y0 < b.y1;
      });
      if (free) {
        lx = b.x0, ly = b.y1;
        break;
      }
    }
    placed.push_back({lx, ly - h, lx + w, ly});
    out << "<circle cx=\"" << x << "\" cy=\"" << y << "\" r=\"6\" fill=\"" << palette[i % 8] << "\"/>\n"
        << "<text x=\"" << lx << "\" y=\"" << ly << "\" fill=\"" << palette[i % 8] << "\">" << r.label
        << "</text>\n";
  }
  out << "</svg>\n";
}

}  // namespace prefire_bench
