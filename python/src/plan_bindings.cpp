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
// A BlockCost, Plan or StagePlan crosses into Python, and from there into
// JSON files (the pipeline program's runs, which its simulator reads back),
// by field name only. Each field is named once on this side, in its class's
// table below (by_name: the name, the member, and whether the constructor
// requires it), from which come the readonly attribute, the keyword-only
// constructor (the defaults are the C++ struct's own), FIELDS, to_dict and
// from_dict; on the Python side once, in _C.pyi (a test compares the two).
// Adding a field is never a silent shift of the ones after it: from_dict
// raises naming a field that is missing or unknown (a file written before a
// field existed is refused, not misread), the constructor an unknown or
// missing required keyword. A Choice is written as its name, in lists and
// lists of lists alike.

template <typename T, typename M>
struct Field {
  const char* name;
  M T::*member;
  bool required;
};
template <typename T, typename M>
Field<T, M> optional(const char* name, M T::*member) {
  return {name, member, false};
}
template <typename T, typename M>
Field<T, M> required(const char* name, M T::*member) {
  return {name, member, true};
}

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& s : names) out += (out.empty() ? "" : ", ") + s;
  return out;
}

py::object choice_type() { return py::module_::import("prefire._C").attr("Choice"); }

// `value` with every Choice in it (lists of lists too) written as its name, or read back from it.
py::object choices_as_names(const py::handle value, const py::object& choice) {
  if (py::isinstance<py::list>(value)) {
    py::list out;
    for (const py::handle item : value) out.append(choices_as_names(item, choice));
    return out;
  }
  if (py::isinstance(value, choice)) return value.attr("name");
  return py::reinterpret_borrow<py::object>(value);
}
py::object names_as_choices(const py::handle value, const py::object& choice) {
  if (py::isinstance<py::list>(value)) {
    py::list out;
    for (const py::handle item : value) out.append(names_as_choices(item, choice));
    return out;
  }
  if (py::isinstance<py::str>(value)) return choice.attr("__members__")[value];
  return py::reinterpret_borrow<py::object>(value);
}

// The missing and unknown names among `given`, against `names` (and `needed`, those that must be given).
std::string misfit(const std::vector<std::string>& names, const std::vector<std::string>& needed,
                   const py::dict& given) {
  std::vector<std::string> missing, unknown;
  for (const std::string& name : needed) {
    if (!given.contains(name.c_str())) missing.push_back(name);
  }
  for (const auto& item : given) {
    const std::string k = py::str(item.first);
    if (std::find(names.begin(), names.end(), k) == names.end()) unknown.push_back(k);
  }
  return (missing.empty() ? "" : "missing field(s) " + joined(missing)) +
         (missing.empty() || unknown.empty() ? "" : "; ") +
         (unknown.empty() ? "" : "unknown field(s) " + joined(unknown));
}

template <typename T, typename M>
void set_from(T& out, const Field<T, M>& field, const py::dict& given, const char* type) {
  if (!given.contains(field.name)) return;  // the struct's default
  try {
    out.*(field.member) = given[field.name].template cast<M>();
  } catch (const py::cast_error&) {
    throw py::type_error(std::string("prefire.") + type + ": field " + field.name + " got " +
                         std::string(py::str(py::type::of(given[field.name]).attr("__name__"))));
  }
}

/// Binds T's fields by name (Note [Costs and plans by name]).
template <typename T, typename... M>
void by_name(py::class_<T>& cls, const char* type, const Field<T, M>&... fields) {
  (cls.def_readonly(fields.name, fields.member), ...);
  const std::vector<std::string> names{fields.name...};
  std::vector<std::string> needed;
  ((fields.required ? needed.push_back(fields.name) : void()), ...);
  py::tuple field_names(names.size());
  for (size_t i = 0; i < names.size(); ++i) field_names[i] = py::str(names[i]);
  cls.attr("FIELDS") = field_names;
  auto make = [=](const py::dict& given) {
    const std::string wrong = misfit(names, needed, given);
    if (!wrong.empty()) throw py::type_error(std::string("prefire.") + type + ": " + wrong + " (keywords only)");
    T out{};
    (set_from(out, fields, given, type), ...);
    return out;
  };
  cls.def(py::init([make](const py::kwargs& given) { return make(given); }));
  cls.def("to_dict", [names](const py::object& self) {
    py::dict out;
    const py::object choice = choice_type();
    for (const std::string& name : names) out[name.c_str()] = choices_as_names(self.attr(name.c_str()), choice);
    return out;
  });
  cls.def_static("from_dict", [names, type, make](const py::dict& d) {
    const std::string wrong = misfit(names, names, d);
    if (!wrong.empty()) {
      throw py::value_error(std::string("prefire.") + type + ".from_dict: " + wrong +
                            " (a file written by another version of prefire? it names every field of " + type + ")");
    }
    py::dict given;
    const py::object choice = choice_type();
    for (const auto& item : d) given[item.first] = names_as_choices(item.second, choice);
    return make(given);
  });
}

void bind_costs_and_plans(py::module_& m) {
  py::enum_<Choice>(m, "Choice", "A block's choice in a plan.")
      .value("KEEP", Choice::kKeep)
      .value("CHECKPOINT", Choice::kCheckpoint)
      .value("SELECTIVE", Choice::kSelective)
      .value("OFFLOAD", Choice::kOffload);
  py::class_<BlockCost> cost(m, "BlockCost", "What one block costs (prefire/plan.h); built by keyword.");
  by_name(cost, "BlockCost", required("saved_bytes", &BlockCost::saved_bytes),
          required("input_bytes", &BlockCost::input_bytes),
          required("recompute_seconds", &BlockCost::recompute_seconds), optional("in_flight", &BlockCost::in_flight),
          optional("group", &BlockCost::group), optional("alive", &BlockCost::alive),
          optional("done", &BlockCost::done), optional("saved_after_bytes", &BlockCost::saved_after_bytes),
          optional("input_after_bytes", &BlockCost::input_after_bytes),
          optional("selective_bytes", &BlockCost::selective_bytes),
          optional("selective_seconds", &BlockCost::selective_seconds),
          optional("selective_after_bytes", &BlockCost::selective_after_bytes),
          optional("offload_bytes", &BlockCost::offload_bytes),
          optional("offload_moved_bytes", &BlockCost::offload_moved_bytes),
          optional("offload_seconds", &BlockCost::offload_seconds),
          optional("offload_hidden", &BlockCost::offload_hidden),
          optional("offload_after_bytes", &BlockCost::offload_after_bytes), optional("passes", &BlockCost::passes));
  py::class_<Plan> plan(m, "Plan", "A plan (prefire/plan.h): plan_for_budget's answer, or describe_plan's.");
  by_name(plan, "Plan", required("choices", &Plan::choices), required("checkpointed", &Plan::checkpointed),
          required("selective", &Plan::selective), required("offloaded", &Plan::offloaded),
          required("prefire_ahead", &Plan::prefire_ahead), required("peak_bytes", &Plan::peak_bytes),
          required("recompute_seconds", &Plan::recompute_seconds),
          optional("block_seconds", &Plan::block_seconds), required("memory_budget", &Plan::memory_budget),
          required("blocks_bytes", &Plan::blocks_bytes), required("pass_bytes", &Plan::pass_bytes),
          required("moment_bytes", &Plan::moment_bytes), required("room_bytes", &Plan::room_bytes));
  py::enum_<Release>(m, "Release")
      .value("AT_STEP_END", Release::kAtStepEnd)
      .value("IN_BACKWARD", Release::kInBackward);
  m.def("plan_for_budget", &prefire::plan_for_budget, py::arg("blocks"), py::arg("memory_budget"),
        py::arg("release"));
  m.def("least_plan_bytes", &prefire::least_plan_bytes, py::arg("blocks"), py::arg("release"));
  m.def("plan_bytes", &prefire::plan_bytes, py::arg("blocks"), py::arg("checkpointed"), py::arg("prefire_ahead"),
        py::arg("release"), py::arg("selective") = std::vector<bool>{});
  m.def("describe_plan", &prefire::describe_plan, py::arg("blocks"), py::arg("choices"), py::arg("memory_budget"),
        py::arg("prefire_ahead"), py::arg("release"));
  m.def("tier_bytes", &prefire::tier_bytes, py::arg("blocks"), py::arg("choices"), py::arg("release"));
  m.def("reload_schedule", &prefire::reload_schedule, py::arg("blocks"), py::arg("choices"),
        py::arg("memory_budget"));
  m.def("choice_seconds", &prefire::choice_seconds, py::arg("block"), py::arg("choice"));
  m.def("offered_choices", &prefire::offered_choices, py::arg("block"));
  m.def("with_offload", &prefire::with_offload, py::arg("block"), py::kw_only(), py::arg("moved_bytes"),
        py::arg("copy_seconds"));
  m.def("copy_seconds", &prefire::copy_seconds, py::arg("moved_bytes"), py::arg("to_tier"), py::arg("back"));
}

void bind_pipeline_plans(py::module_& m) {
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
  m.def("rank_blocks", &prefire::rank_blocks, py::arg("blocks"), py::arg("actions"), py::arg("micro_batches"));
  m.def("rank_items", &prefire::rank_items, py::arg("blocks"), py::arg("actions"), py::arg("micro_batches"));
  py::class_<StagePlan> stage_plan(m, "StagePlan", "What a rank's plan says of one of its stages.");
  by_name(stage_plan, "StagePlan", required("stage", &StagePlan::stage), required("choices", &StagePlan::choices),
          required("pass_bytes", &StagePlan::pass_bytes));
  m.def("stage_plans", &prefire::stage_plans, py::arg("plan"), py::arg("blocks"), py::arg("micro_batches"));
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
  py::class_<KeepForW>(m, "KeepForW", "Whether a B's session keeps its recomputation for W.")
      .def_readonly("keep", &KeepForW::keep)
      .def_readonly("let_go", &KeepForW::let_go);
  m.def("keep_for_w", &prefire::keep_for_w, py::arg("room"), py::arg("actions"), py::arg("held"), py::arg("key"),
        py::arg("b_at"), py::arg("need"), py::arg("may_let_go"));
}

}  // namespace

void bind_plan(py::module_& m) {
  bind_costs_and_plans(m);
  bind_pipeline_plans(m);
}

}  // namespace prefire::python
