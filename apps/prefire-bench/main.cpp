// prefire-bench: one pipeline stage of GPT-style blocks trained through a
// zero-bubble style schedule (forward of every micro-batch, B passes, then W
// passes), in every checkpointing mode side by side on identical weights and
// data: peak memory, step time, recomputations, refused prefires and the
// gradient difference against the unchecked run. See --help.

#include "pipeline.h"
#include "report.h"
#include "trace.h"

#include <prefire/prefire.h>

#include <ATen/Context.h>
#include <ATen/Parallel.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
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
  std::vector<std::string> modes = {"none", "graph-task", "session", "prefire", "budget"};
  std::string json, plot, trace;
};

const char* kUsage = R"(usage: prefire-bench [options]

Trains one pipeline stage of GPT-style blocks through a zero-bubble style
schedule in every checkpointing mode, and prints one row per mode.

model:     --layers N (4)  --hidden N (192)  --heads N (6)  --seq N (128)
           --micro-batch N (2)  --dropout P (0.1)
schedule:  --micro-batches N (4)  --steps N measured (5)  --warmup N (1)
           --order zb|bw (zb: every B pass, then every W pass; bw: B then W per micro-batch)
modes:     --modes LIST (none,graph-task,session,prefire,budget)
           --budgets LIST of fractions of the prefire mode's peak session bytes (0.25,0.5)
machine:   --device auto|cpu|cuda (auto: cuda when present)  --threads N (1)  --seed N (0)
output:    --json FILE  --plot FILE.svg  --trace FILE.json (Chrome / Perfetto)
)";

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> parts;
  std::stringstream in(s);
  for (std::string part; std::getline(in, part, ',');) {
    if (!part.empty()) parts.push_back(part);
  }
  return parts;
}

Options parse(int argc, char** argv) {
  Options o;
  auto& m = o.run.model;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (i + 1 >= argc) throw std::invalid_argument(flag + " needs a value (see --help)");
    std::string v = argv[++i];
    auto integer = [&](long lo) {
      size_t used = 0;
      long x = std::stol(v, &used);
      if (used != v.size() || x < lo) {
        throw std::invalid_argument(flag + " must be an integer >= " + std::to_string(lo) + ", got " + v);
      }
      return x;
    };
    if (flag == "--layers") m.layers = integer(1);
    else if (flag == "--hidden") m.hidden = integer(1);
    else if (flag == "--heads") m.heads = integer(1);
    else if (flag == "--seq") m.seq = integer(1);
    else if (flag == "--micro-batch") m.micro_batch = integer(1);
    else if (flag == "--micro-batches") o.run.micro_batches = integer(1);
    else if (flag == "--steps") o.run.steps = integer(1);
    else if (flag == "--warmup") o.run.warmup = integer(0);
    else if (flag == "--threads") o.threads = integer(1);
    else if (flag == "--seed") o.run.seed = integer(0);
    else if (flag == "--device") o.device = v;
    else if (flag == "--order") {
      if (v != "zb" && v != "bw") throw std::invalid_argument("--order must be zb or bw, got " + v);
      o.run.order = v == "zb" ? Order::kAllBThenW : Order::kInterleaved;
    }
    else if (flag == "--json") o.json = v;
    else if (flag == "--plot") o.plot = v;
    else if (flag == "--trace") o.trace = v;
    else if (flag == "--modes") o.modes = split(v);
    else if (flag == "--dropout") {
      m.dropout = std::stod(v);
      if (!(m.dropout >= 0 && m.dropout < 1)) throw std::invalid_argument("--dropout must be in [0, 1), got " + v);
    } else if (flag == "--budgets") {
      o.budgets.clear();
      for (const auto& b : split(v)) {
        double f = std::stod(b);
        if (!(f > 0)) throw std::invalid_argument("--budgets fractions must be > 0, got " + b);
        o.budgets.push_back(f);
      }
    } else {
      throw std::invalid_argument("unknown flag " + flag + " (see --help)");
    }
  }
  if (m.hidden % m.heads != 0) {
    throw std::invalid_argument("--hidden (" + std::to_string(m.hidden) + ") must be a multiple of --heads (" +
                                std::to_string(m.heads) + ")");
  }
  for (const auto& mode : o.modes) {
    if (mode != "none" && mode != "graph-task" && mode != "session" && mode != "prefire" && mode != "budget")
      throw std::invalid_argument("--modes: unknown mode " + mode);
  }
  if (o.device == "auto") o.device = prefire::cuda_available() ? "cuda" : "cpu";
  if (o.device == "cuda" && !prefire::cuda_available())
    throw std::invalid_argument("--device cuda: no CUDA device (or prefire was built without CUDA)");
  if (o.device != "cpu" && o.device != "cuda") throw std::invalid_argument("--device must be auto, cpu or cuda");
  o.run.device = o.device == "cuda" ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
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
    prefire::install();
    at::set_num_threads(o.threads);
    const auto& c = o.run;
    const auto& m = c.model;
    std::printf("prefire-bench: %d blocks (hidden %lld, %lld heads, seq %lld), %d micro-batches of %lld, order %s,"
                " dropout %.2f, %d+%d steps, %s, %d thread(s)\n",
                m.layers, (long long)m.hidden, (long long)m.heads, (long long)m.seq, c.micro_batches,
                (long long)m.micro_batch, to_string(c.order), m.dropout, c.warmup, c.steps, c.device.str().c_str(),
                o.threads);

    std::vector<std::pair<Mode, std::optional<double>>> plan = {{Mode::kNone, std::nullopt}};
    if (wants(o, "graph-task")) plan.push_back({Mode::kGraphTask, std::nullopt});
    if (wants(o, "session")) plan.push_back({Mode::kSession, std::nullopt});
    if (wants(o, "prefire") || wants(o, "budget")) plan.push_back({Mode::kPrefire, std::nullopt});
    if (wants(o, "budget")) for (double f : o.budgets) plan.push_back({Mode::kBudget, f});

    Trace trace;
    Trace* tracing = o.trace.empty() ? nullptr : &trace;
    if (tracing) trace.observe_recomputations();
    Progress progress(static_cast<int>(plan.size()) * (c.warmup + c.steps));
    std::vector<ModeResult> results;
    results.reserve(plan.size());  // `reference` points into it
    const ModeResult* reference = nullptr;
    int64_t prefire_session_peak = 0;
    for (size_t i = 0; i < plan.size(); ++i) {
      auto [mode, fraction] = plan[i];
      int64_t budget = fraction ? static_cast<int64_t>(*fraction * double(prefire_session_peak)) : 0;
      const std::string name = std::string(to_string(mode)) +
                               (fraction ? " " + std::to_string(static_cast<int>(*fraction * 100 + 0.5)) + "%" : "");
      if (tracing) trace.begin_process(static_cast<int>(i), name);
      const int done_before = static_cast<int>(i) * (c.warmup + c.steps);
      auto result = run_mode(c, mode, fraction, budget, /*session_base=*/1000 * static_cast<int64_t>(i + 1), reference,
                             tracing, [&](int step) { progress.update(name, done_before + step); });
      if (mode == Mode::kPrefire) prefire_session_peak = result.peak_session_bytes;
      results.push_back(std::move(result));
      if (mode == Mode::kNone) reference = &results.front();
    }
    if (tracing) trace.stop_observing();
    if (!wants(o, "none")) results.erase(results.begin());
    if (wants(o, "budget") && !wants(o, "prefire")) {
      results.erase(std::remove_if(results.begin(), results.end(), [](const ModeResult& r) { return r.mode == Mode::kPrefire; }),
                    results.end());
    }

    print_table(stdout, c, results);
    std::printf("\nmemory: %s; session: largest one micro-batch's session held; budgets are fractions of the "
                "prefire mode's session peak.\n",
                c.device.is_cuda() ? "CUDA allocator peak" : "peak bytes of saved and recomputed tensors (runtime accounting)");
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
