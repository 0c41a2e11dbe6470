"""prefire's CUDA knobs (see <prefire/cuda.h>): they work without CUDA as
no-ops, or returning 0, except prefire_stream()."""

from __future__ import annotations

import torch

from . import _C

cuda_available = _C.cuda_available
set_prefire_stream_priority = _C.set_prefire_stream_priority
set_session_pool_enabled = _C.set_session_pool_enabled
session_pool_enabled = _C.session_pool_enabled
session_pool_reserved_bytes = _C.session_pool_reserved_bytes
release_session_pools = _C.release_session_pools


def prefire_stream(device: int = 0) -> torch.cuda.Stream:
    """The stream prefire recomputes on for ``device``: prefire's own, never
    one of c10's pool streams. Order your work against it with events."""
    stream_id, device_index, device_type = _C._prefire_stream(device)
    return torch.cuda.Stream(stream_id=stream_id, device_index=device_index, device_type=device_type)
