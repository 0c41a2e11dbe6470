// prefire-bench: one pipeline stage of GPT-style blocks trained through a
// split-backward schedule (forward, B = dx through prefire::backward_input,
// W = dw through prefire::WeightPass), in every checkpointing mode side by
// side on identical weights and data: peak memory, what a session holds from
// B to W, F/B/W and step time, recomputations, refused prefires and the
// gradient difference against the unchecked run. See --help.

#include "pipeline.h"
#include "plan_file.h"
#include "report.h"
#include "trace.h"

#include <prefire/prefire.h>

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include <unistd.h>

namespace {

using namespace prefire_bench;

struct Options {
  RunConfig run;
  std::string device = "auto";
  int threads = 1;
  std::vector<double> budgets = {0.25, 0.5};
  std::vector<int> every = {2, 3, 4};
  std::vector<double> memory_budgets = {0.25, 0.5, 0.75, 1.0};
  std::vector<std::string> modes = {"none", "torch", "session", "prefire", "budget"};
  bool session_pool = false;
  std::string json, plot, trace;
  std::string plan_file;  // --plan: plan these costs and print the plan, nothing else
};

// Parses the flags (CLI11: --help lists them); exits on --help or a bad flag.
Options parse(int argc, char** argv) {
  Options o;
  auto& m = o.run.model;
  CLI::App app{"Trains one pipeline stage of GPT-style blocks through a split-backward schedule (forward, B = dx, "
               "W = dw of each micro-batch) in every checkpointing mode, and prints one row per mode.",
               "prefire-bench"};
  app.option_defaults()->always_capture_default();
  app.add_option("--layers", m.layers, "blocks in the stage")->check(CLI::PositiveNumber)->group("model");
  app.add_option("--hidden", m.hidden, "hidden size")->check(CLI::PositiveNumber)->group("model");
  app.add_option("--heads", m.heads, "attention heads")->check(CLI::PositiveNumber)->group("model");
  app.add_option("--seq", m.seq, "sequence length")->check(CLI::PositiveNumber)->group("model");
  app.add_option("--micro-batch", m.micro_batch, "micro-batch size")->check(CLI::PositiveNumber)->group("model");
  app.add_option("--dropout", m.dropout, "dropout probability")->check(CLI::Range(0.0, 0.999))->group("model");
  app.add_option("--micro-batches", o.run.micro_batches, "micro-batches per step")
      ->check(CLI::PositiveNumber)->group("schedule");
  app.add_option("--steps", o.run.steps, "measured steps")->check(CLI::PositiveNumber)->group("schedule");
  app.add_option("--warmup", o.run.warmup, "steps before measuring")->check(CLI::NonNegativeNumber)->group("schedule");
  std::string order = "zb";
  app.add_option("--order", order,
                 "zb: every forward, every B, then every W; bw: every forward, then B and W per micro-batch; "
                 "zbh1: one stage of ZB-H1 (1F1B, each W after --in-flight more B passes)")
      ->check(CLI::IsMember({"zb", "bw", "zbh1"}))->group("schedule");
  app.add_option("--in-flight", o.run.in_flight, "zbh1: warm-up forwards and W deferral, in micro-batches")
      ->check(CLI::PositiveNumber)->group("schedule");
  app.add_option("--modes", o.modes,
                 "modes to run (named as the pipeline program names its own): none, torch (a checkpoint per block "
                 "keyed by graph task, as torch.utils.checkpoint: recomputed in B and in W), session, prefire, budget, "
                 "torch-every (torch on every n-th block), plan (prefire's plan from a memory budget); "
                 "--memory-sweep runs the sweep's")
      ->delimiter(',')->check(CLI::IsMember({"none", "torch", "session", "prefire", "budget", "torch-every", "plan"}))
      ->group("modes");
  app.add_option("--budgets", o.budgets, "budget modes: fractions of the prefire mode's peak session bytes")
      ->delimiter(',')->check(CLI::PositiveNumber)->group("modes");
  app.add_option("--every", o.every, "torch-every modes: one per n, checkpointing the blocks whose index is a multiple")
      ->delimiter(',')->check(CLI::PositiveNumber)->group("modes");
  app.add_option("--memory-budgets", o.memory_budgets,
                 "plan modes: one per fraction of the none mode's peak held bytes (the least plan where that is less)")
      ->delimiter(',')->check(CLI::PositiveNumber)->group("modes");
  bool sweep = false;
  app.add_flag("--memory-sweep", sweep,
               "the memory sweep: modes none, torch, torch-every and plan, and a table of each plan against the "
               "configurations that fit its budget")
      ->group("modes");
  app.add_option("--device", o.device, "auto (cuda when present), cpu or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))->group("machine");
  app.add_flag("--session-pool", o.session_pool,
               "CUDA: prefires allocate from the session buffer pool (a private caching-allocator pool)")
      ->group("machine");
  app.add_option("--threads", o.threads, "intra-op threads")->check(CLI::PositiveNumber)->group("machine");
  app.add_option("--seed", o.run.seed, "seed of weights, data and dropout")->group("machine");
  app.add_option("--json", o.json, "write the report as JSON")->group("output");
  app.add_option("--plot", o.plot, "write an SVG chart of peak memory against step time")->group("output");
  app.add_option("--trace", o.trace, "write a Chrome / Perfetto trace of the schedule")->group("output");
  app.add_option("--plan", o.plan_file,
                 "plan the costs of this JSON file (memory_budget, blocks by field name, optionally actions and "
                 "micro_batches) as the plan mode does, print the plan as JSON and exit")
      ->group("output");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::exit(app.exit(e));
  }
  if (sweep) o.modes = {"none", "torch", "torch-every", "plan"};
  o.run.order = order == "zb" ? Order::kAllBThenW : order == "bw" ? Order::kInterleaved : Order::kZbH1;
  if (m.hidden % m.heads != 0) {
    throw std::invalid_argument("--hidden (" + std::to_string(m.hidden) + ") must be a multiple of --heads (" +
                                std::to_string(m.heads) + ")");
  }
  if (o.device == "auto") o.device = prefire::cuda_available() ? "cuda" : "cpu";
  if (o.device == "cuda" && !prefire::cuda_available())
    throw std::invalid_argument("--device cuda: no CUDA device (or prefire was built without CUDA)");
  o.run.device = o.device == "cuda" ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  if (o.session_pool && o.device != "cuda") throw std::invalid_argument("--session-pool needs --device cuda");
  prefire::set_session_pool_enabled(o.session_pool);
  return o;
}

bool wants(const Options& o, const char* mode) {
  for (const auto& m : o.modes) if (m == mode) return true;
  return false;
}

// A progress line on stderr, shown once a run has taken two seconds and only
// on a terminal.
class Progress {
 public:
  explicit Progress(int total) : total_(total), tty_(isatty(2)) {}
  void update(const std::string& what, int done) {
    if (!tty_) return;
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    if (s < 2.0) return;
    int width = 30, filled = total_ ? width * done / total_ : width;
    std::fprintf(stderr, "\r[%s%s] %3d%% %-16s %5.1fs", std::string(filled, '#').c_str(),
                 std::string(width - filled, ' ').c_str(), total_ ? 100 * done / total_ : 100, what.c_str(), s);
    shown_ = true;
  }
  ~Progress() {
    if (shown_) std::fprintf(stderr, "\r%80s\r", "");
  }

 private:
  int total_;
  bool tty_;
  bool shown_ = false;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

}  // namespace

int main(int argc, char** argv) {
  try {
    Options o = parse(argc, argv);
    if (!o.plan_file.empty()) {
      plan_from_file(o.plan_file, stdout);
      return 0;
    }
    prefire::install();
    prefire::count_cpu_allocations();  // before any model: Note [prefire-bench's memory figures]
    at::set_num_threads(o.threads);
    const auto& c = o.run;
    const auto& m = c.model;
    std::printf("prefire-bench: %d blocks (hidden %lld, %lld heads, seq %lld), %d micro-batches of %lld, order %s%s,"
                " dropout %.2f, %d+%d steps, %s%s, %d thread(s)\n",
                m.layers, (long long)m.hidden, (long long)m.heads, (long long)m.seq, c.micro_batches,
                (long long)m.micro_batch, to_string(c.order),
                c.order == Order::kZbH1 ? (" (in flight " + std::to_string(c.in_flight) + ")").c_str() : "",
                m.dropout, c.warmup, c.steps, c.device.str().c_str(),
                prefire::session_pool_enabled() ? " (session pool)" : "", o.threads);

    std::vector<ModeSpec> plan = {{Mode::kNone}};
    if (wants(o, "torch")) plan.push_back({Mode::kTorch});
    if (wants(o, "session")) plan.push_back({Mode::kSession});
    if (wants(o, "prefire") || wants(o, "budget")) plan.push_back({Mode::kPrefire});
    if (wants(o, "budget")) for (double f : o.budgets) plan.push_back({Mode::kBudget, f});
    if (wants(o, "torch-every")) for (int n : o.every) plan.push_back({Mode::kTorchEvery, std::nullopt, 0, n});
    if (wants(o, "plan")) for (double f : o.memory_budgets) plan.push_back({Mode::kPlan, f});

    Trace trace;
    Trace* tracing = o.trace.empty() ? nullptr : &trace;
    if (tracing) trace.observe_recomputations();
    Progress progress(static_cast<int>(plan.size()) * (c.warmup + c.steps));
    std::vector<ModeResult> results;
    results.reserve(plan.size());  // `reference` points into it
    const ModeResult* reference = nullptr;
    int64_t prefire_session_peak = 0;
    for (size_t i = 0; i < plan.size(); ++i) {
      ModeSpec spec = plan[i];
      if (spec.mode == Mode::kBudget) spec.budget_bytes = static_cast<int64_t>(*spec.fraction * double(prefire_session_peak));
      if (spec.mode == Mode::kPlan) spec.budget_bytes = static_cast<int64_t>(*spec.fraction * double(reference->peak_held_bytes));
      const std::string name = label(spec);
      if (tracing) trace.begin_process(static_cast<int>(i), name);
      const int done_before = static_cast<int>(i) * (c.warmup + c.steps);
      auto result = run_mode(c, spec, /*session_base=*/1000 * static_cast<int64_t>(i + 1), reference, tracing,
                             [&](int step) { progress.update(name, done_before + step); });
      if (spec.mode == Mode::kPrefire) prefire_session_peak = result.peak_session_bytes;
      results.push_back(std::move(result));
      if (spec.mode == Mode::kNone) reference = &results.front();
    }
    if (tracing) trace.stop_observing();
    if (!wants(o, "none")) results.erase(results.begin());
    if (wants(o, "budget") && !wants(o, "prefire")) {
      results.erase(std::remove_if(results.begin(), results.end(), [](const ModeResult& r) { return r.mode == Mode::kPrefire; }),
                    results.end());
    }

    print_table(stdout, c, results);
    if (wants(o, "plan")) print_memory_sweep(stdout, results);
    std::printf("\nstep peak: the most the %s allocator held during a step above what it held when the step began "
                "(every allocation: activations, gradients, working memory); held: prefire's census (saved and "
                "recomputed tensors it counts); session: the largest one micro-batch's session held; budget modes' "
                "budgets are fractions of the prefire mode's session peak.\n",
                c.device.is_cuda() ? "CUDA" : "CPU");
    if (!o.json.empty()) write_json(o.json, c, results);
    if (!o.plot.empty()) write_svg(o.plot, c, results);
    if (tracing) trace.write(o.trace);

    double worst = 0;
    for (const auto& r : results) worst = std::max(worst, r.max_grad_diff);
    if (c.device.is_cpu() && o.threads == 1 && worst != 0.0) {
      std::fprintf(stderr, "prefire-bench: gradients differ from the unchecked run (max %g) on CPU with one thread\n", worst);
      return 3;
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "prefire-bench: %s\n", e.what());
    return 2;
  }
}
