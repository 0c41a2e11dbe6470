"""prefire.SavedTensorMeter: the bytes autograd's saved tensors hold."""

from __future__ import annotations

from . import _C


class SavedTensorMeter:
    """``with SavedTensorMeter() as meter:`` counts the storages autograd
    saves on this thread inside the block, outside any checkpoint (a
    checkpoint's inputs are counted, what it drops is not), each once, until
    autograd releases every saved tensor using it; parameters are not
    counted. ``current_bytes`` and ``peak_bytes`` may be read at any time,
    also after the block (tensors saved inside it stay counted until
    released). The bytes also count in ``runtime_stats().held_bytes``, so
    ``peak_held_bytes`` is saved plus recomputed bytes at their joint peak.
    One meter counts once; exit it on the thread that entered it."""

    def __init__(self) -> None:
        self._meter = _C._SavedTensorMeter()

    def __enter__(self) -> "SavedTensorMeter":
        self._meter.open()
        return self

    def __exit__(self, *exc) -> None:
        self._meter.close()

    @property
    def current_bytes(self) -> int:
        return self._meter.current_bytes

    @property
    def peak_bytes(self) -> int:
        return self._meter.peak_bytes

    @property
    def saved_tensors(self) -> int:
        return self._meter.saved_tensors
