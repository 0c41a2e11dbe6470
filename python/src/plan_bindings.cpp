// The planner's bindings (prefire/plan.h, prefire/pipeline_plan.h).

#include "bindings.h"

#include <prefire/pipeline_plan.h>
#include <prefire/plan.h>

#include <pybind11/stl.h>

#include <algorithm>
#include <string>
#include <vector>

namespace py = pybind11;

namespace prefire::python {
namespace {

// Note [Costs and plans by name]
// A BlockCost or Plan crosses into Python, and from there into JSON files
// (the pipeline program's runs, which its simulator reads back), by field
// name only: keyword-only constructors, and to_dict / from_dict over the
// FIELDS named here, so adding a field is never a silent shift of the ones
// after it. from_dict raises naming a field that is missing or unknown (a
// file written before a field existed is refused, not misread); a Choice is
// written as its name. Each field is named once here (Fields::field: its
// attribute and its place in FIELDS), and once in its constructor's keywords.
template <typename T>
void by_name(py::class_<T>& cls, const char* type, std::vector<std::string> fields) {
  py::tuple names(fields.size());
  for (size_t i = 0; i < fields.size(); ++i) names[i] = py::str(fields[i]);
  cls.attr("FIELDS") = names;
  cls.def("to_dict", [fields](const py::object& self) {
    py::dict out;
    const py::object choice = py::module_::import("prefire._C").attr("Choice");
    for (const std::string& name : fields) {
      py::object value = self.attr(name.c_str());
      if (py::isinstance<py::list>(value)) {
        py::list items;
        for (const py::handle item : value) {
          items.append(py::isinstance(item, choice) ? py::object(item.attr("name"))
                                                    : py::reinterpret_borrow<py::object>(item));
        }
        value = items;
      }
      out[name.c_str()] = value;
    }
    return out;
  });
  cls.def_static("from_dict", [fields, type](const py::dict& d) {
    std::vector<std::string> missing, unknown;
    for (const std::string& name : fields) {
      if (!d.contains(name.c_str())) missing.push_back(name);
    }
    for (const auto& [key, value] : d) {
      const std::string k = py::str(key);
      if (std::find(fields.begin(), fields.end(), k) == fields.end()) unknown.push_back(k);
    }
    auto join = [](const std::vector<std::string>& v) {
      std::string out;
      for (const std::string& s : v) out += (out.empty() ? "" : ", ") + s;
      return out;
    };
    if (!missing.empty() || !unknown.empty()) {
      throw py::value_error(std::string("prefire.") + type + ".from_dict: " +
                            (missing.empty() ? "" : "missing field(s) " + join(missing)) +
                            (missing.empty() || unknown.empty() ? "" : "; ") +
                            (unknown.empty() ? "" : "unknown field(s) " + join(unknown)) +
                            " (a file written by another version of prefire? it names every field of " + type + ")");
    }
    py::dict kwargs;
    const py::object choice = py::module_::import("prefire._C").attr("Choice");
    for (const auto& [key, value] : d) {
      if (std::string(py::str(key)) == "choices") {
        py::list items;
        for (const py::handle item : value) {
          items.append(py::isinstance<py::str>(item) ? choice.attr("__members__")[item] : item);
        }
        kwargs[key] = items;
      } else {
        kwargs[key] = value;
      }
    }
    return py::module_::import("prefire._C").attr(type)(**kwargs).template cast<T>();
  });
}

/// The readonly attributes of a class bound by name, each added to its FIELDS.
template <typename T>
class Fields {
 public:
  Fields(py::class_<T>& cls, const char* type) : cls_(cls), type_(type) {}
  template <typename M>
  Fields& field(const char* name, M T::*member) {
    cls_.def_readonly(name, member);
    names_.emplace_back(name);
    return *this;
  }
  void done() { by_name(cls_, type_, names_); }

 private:
  py::class_<T>& cls_;
  const char* type_;
  std::vector<std::string> names_;
};

}  // namespace

void bind_plan(py::module_& m) {
  // Plans from a memory budget (plan.h): costs and plans by field name (keywords; dicts that name every field).
  py::enum_<Choice>(m, "Choice", "A block's choice in a plan.")
      .value("KEEP", Choice::kKeep)
      .value("CHECKPOINT", Choice::kCheckpoint)
      .value("SELECTIVE", Choice::kSelective)
      .value("OFFLOAD", Choice::kOffload);
  py::class_<BlockCost> block_cost(m, "BlockCost", "What one block costs (prefire/plan.h); built by keyword.");
  block_cost
      .def(py::init([](int64_t saved_bytes, int64_t input_bytes, double recompute_seconds, int64_t in_flight,
                       int64_t group, std::vector<int64_t> alive, std::vector<int64_t> done, int64_t saved_after_bytes,
                       int64_t input_after_bytes, int64_t selective_bytes, double selective_seconds,
                       int64_t selective_after_bytes, int64_t offload_bytes, int64_t offload_moved_bytes,
                       double offload_seconds, double offload_hidden, int64_t offload_after_bytes,
                       std::vector<int64_t> passes) {
             return BlockCost{.saved_bytes = saved_bytes,
                              .input_bytes = input_bytes,
                              .recompute_seconds = recompute_seconds,
                              .in_flight = in_flight,
                              .group = group,
                              .alive = std::move(alive),
                              .done = std::move(done),
                              .saved_after_bytes = saved_after_bytes,
                              .input_after_bytes = input_after_bytes,
                              .selective_bytes = selective_bytes,
                              .selective_seconds = selective_seconds,
                              .selective_after_bytes = selective_after_bytes,
                              .offload_bytes = offload_bytes,
                              .offload_moved_bytes = offload_moved_bytes,
                              .offload_seconds = offload_seconds,
                              .offload_hidden = offload_hidden,
                              .offload_after_bytes = offload_after_bytes,
                              .passes = std::move(passes)};
           }),
           py::kw_only(), py::arg("saved_bytes"), py::arg("input_bytes"), py::arg("recompute_seconds"),
           py::arg("in_flight") = 1, py::arg("group") = -1, py::arg("alive") = std::vector<int64_t>{},
           py::arg("done") = std::vector<int64_t>{}, py::arg("saved_after_bytes") = 0,
           py::arg("input_after_bytes") = 0, py::arg("selective_bytes") = -1, py::arg("selective_seconds") = 0.0,
           py::arg("selective_after_bytes") = 0, py::arg("offload_bytes") = -1, py::arg("offload_moved_bytes") = 0,
           py::arg("offload_seconds") = 0.0, py::arg("offload_hidden") = 0.0, py::arg("offload_after_bytes") = 0,
           py::arg("passes") = std::vector<int64_t>{});
  Fields<BlockCost>(block_cost, "BlockCost")
      .field("saved_bytes", &BlockCost::saved_bytes)
      .field("input_bytes", &BlockCost::input_bytes)
      .field("recompute_seconds", &BlockCost::recompute_seconds)
      .field("in_flight", &BlockCost::in_flight)
      .field("group", &BlockCost::group)
      .field("alive", &BlockCost::alive)
      .field("done", &BlockCost::done)
      .field("saved_after_bytes", &BlockCost::saved_after_bytes)
      .field("input_after_bytes", &BlockCost::input_after_bytes)
      .field("selective_bytes", &BlockCost::selective_bytes)
      .field("selective_seconds", &BlockCost::selective_seconds)
      .field("selective_after_bytes", &BlockCost::selective_after_bytes)
      .field("offload_bytes", &BlockCost::offload_bytes)
      .field("offload_moved_bytes", &BlockCost::offload_moved_bytes)
      .field("offload_seconds", &BlockCost::offload_seconds)
      .field("offload_hidden", &BlockCost::offload_hidden)
      .field("offload_after_bytes", &BlockCost::offload_after_bytes)
      .field("passes", &BlockCost::passes)
      .done();
  py::class_<Plan> plan(m, "Plan", "A plan (prefire/plan.h): plan_for_budget's answer, or describe_plan's.");
  plan.def(py::init([](std::vector<Choice> choices, std::vector<bool> checkpointed, std::vector<bool> selective,
                       std::vector<bool> offloaded, int64_t prefire_ahead, int64_t peak_bytes,
                       double recompute_seconds, int64_t memory_budget, int64_t blocks_bytes, std::vector<int64_t> pass_bytes, std::vector<int64_t> moment_bytes,
                       std::vector<int64_t> room_bytes) {
             return Plan{.choices = std::move(choices),
                         .checkpointed = std::move(checkpointed),
                         .selective = std::move(selective),
                         .offloaded = std::move(offloaded),
                         .prefire_ahead = prefire_ahead,
                         .peak_bytes = peak_bytes,
                         .recompute_seconds = recompute_seconds,
                         .memory_budget = memory_budget,
                         .blocks_bytes = blocks_bytes,
                         .pass_bytes = std::move(pass_bytes),
                         .moment_bytes = std::move(moment_bytes),
                         .room_bytes = std::move(room_bytes)};
           }),
           py::kw_only(), py::arg("choices"), py::arg("checkpointed"), py::arg("selective"), py::arg("offloaded"),
           py::arg("prefire_ahead"), py::arg("peak_bytes"), py::arg("recompute_seconds"), py::arg("memory_budget"),
           py::arg("blocks_bytes"), py::arg("pass_bytes"), py::arg("moment_bytes"), py::arg("room_bytes"));
  Fields<Plan>(plan, "Plan")
      .field("choices", &Plan::choices)
      .field("checkpointed", &Plan::checkpointed)
      .field("selective", &Plan::selective)
      .field("offloaded", &Plan::offloaded)
      .field("prefire_ahead", &Plan::prefire_ahead)
      .field("peak_bytes", &Plan::peak_bytes)
      .field("recompute_seconds", &Plan::recompute_seconds)
      .field("memory_budget", &Plan::memory_budget)
      .field("blocks_bytes", &Plan::blocks_bytes)
      .field("pass_bytes", &Plan::pass_bytes)
      .field("moment_bytes", &Plan::moment_bytes)
      .field("room_bytes", &Plan::room_bytes)
      .done();
  py::enum_<Release>(m, "Release")
      .value("AT_STEP_END", Release::kAtStepEnd)
      .value("IN_BACKWARD", Release::kInBackward);
  m.def("plan_for_budget", &prefire::plan_for_budget, py::arg("blocks"), py::arg("memory_budget"),
        py::arg("release"));
  m.def("least_plan_bytes", &prefire::least_plan_bytes, py::arg("blocks"), py::arg("release"));
  m.def("plan_bytes", &prefire::plan_bytes, py::arg("blocks"), py::arg("checkpointed"), py::arg("prefire_ahead"),
        py::arg("release"),
        py::arg("selective") = std::vector<bool>{});
  // A pipeline rank's plan from its actions, and what its sessions may hold beside it (pipeline_plan.h).
  py::enum_<ActionKind>(m, "ActionKind")
      .value("FORWARD", ActionKind::kForward)
      .value("B", ActionKind::kB)
      .value("W", ActionKind::kW)
      .value("FULL_BACKWARD", ActionKind::kFullBackward);
  py::class_<RankAction>(m, "RankAction", "One of a pipeline rank's compute actions.")
      .def(py::init([](ActionKind kind, int64_t stage, int64_t micro_batch) {
             return RankAction{.kind = kind, .stage = stage, .micro_batch = micro_batch};
           }),
           py::kw_only(), py::arg("kind"), py::arg("stage"), py::arg("micro_batch"))
      .def_readonly("kind", &RankAction::kind)
      .def_readonly("stage", &RankAction::stage)
      .def_readonly("micro_batch", &RankAction::micro_batch);
  py::class_<Lifetime>(m, "Lifetime")
      .def_readonly("alive", &Lifetime::alive)
      .def_readonly("done", &Lifetime::done)
      .def_readonly("passes", &Lifetime::passes);
  m.def("lifetime", &prefire::lifetime, py::arg("actions"), py::arg("stage"), py::arg("micro_batch") = -1);
  m.def("per_micro_batch", &prefire::per_micro_batch, py::arg("blocks"), py::arg("actions"),
        py::arg("micro_batches"));
  py::class_<SessionAction>(m, "SessionAction", "One of a rank's actions as its sessions' budget sees it.")
      .def(py::init([](ActionKind kind, int64_t key, int64_t need, int64_t kept, bool w_recomputes, bool kept_for_w) {
             return SessionAction{.kind = kind,
                                  .key = key,
                                  .need = need,
                                  .kept = kept,
                                  .w_recomputes = w_recomputes,
                                  .kept_for_w = kept_for_w};
           }),
           py::kw_only(), py::arg("kind"), py::arg("key"), py::arg("need"), py::arg("kept") = -1,
           py::arg("w_recomputes") = false, py::arg("kept_for_w") = false);
  m.def("least_session_room", &prefire::least_session_room, py::arg("room"), py::arg("actions"), py::arg("held"),
        py::arg("now"), py::arg("begin"), py::arg("end"), py::arg("keep_for_w"));
  m.def("choice_seconds", &prefire::choice_seconds, py::arg("block"), py::arg("choice"));
  m.def("describe_plan", &prefire::describe_plan, py::arg("blocks"), py::arg("choices"), py::arg("memory_budget"),
        py::arg("prefire_ahead"), py::arg("release"));

}

}  // namespace prefire::python
