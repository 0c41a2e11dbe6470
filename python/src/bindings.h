#pragma once

// The parts of the extension module prefire._C bound in files of their own.

#include <pybind11/pybind11.h>

namespace prefire::python {

/// The planner (prefire/plan.h, prefire/pipeline_plan.h): costs, plans and
/// a pipeline rank's rules, by field name (Note [Costs and plans by name]).
void bind_plan(pybind11::module_& m);

}  // namespace prefire::python
