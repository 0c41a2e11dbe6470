"""The pipeline program, ``python -m pipeline_bench``: a GPT cut into stages
of ``torch.distributed.pipelining``, run by a real schedule on several
processes (Gloo on CPU) in every mode (no checkpoints, torch's checkpoint,
prefire's sessions, sessions with prefire in the bubbles, the same under a
byte budget), the modes' steps taking turns, with step time,
recomputations, waits, memory and gradients compared with a single-process
run. ``run`` is the program as a function. From the checkout, with the
venv's Python and ``PYTHONPATH=build/python:apps`` (or ``scripts/run.sh
--pipeline ...``); it uses prefire by public names only."""

from .main import run

__all__ = ["run"]
