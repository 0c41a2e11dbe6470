#pragma once

// The stream prefire recomputes on (CUDA builds only).

#include <c10/cuda/CUDAStream.h>

namespace prefire {

/// The prefire stream of `device`: created by prefire on first use (a
/// non-blocking stream with the priority of set_prefire_stream_priority()),
/// never one of c10's pool streams, so nothing else (NCCL process groups,
/// other libraries) queues work on it. Order your own work against it with
/// events, e.g. to release a buffer a prefire read.
c10::cuda::CUDAStream prefire_stream(c10::DeviceIndex device);

}  // namespace prefire
