#pragma once

// Everything a training job needs from prefire.

#include <prefire/allocator_meter.h>
#include <prefire/checkpoint.h>
#include <prefire/cuda.h>
#include <prefire/errors.h>
#include <prefire/install.h>
#include <prefire/observer.h>
#include <prefire/offload.h>
#include <prefire/plan.h>
#include <prefire/pipeline_plan.h>
#include <prefire/saved_tensor_meter.h>
#include <prefire/schedule.h>
#include <prefire/session.h>
#include <prefire/split_backward.h>
#include <prefire/stats.h>
