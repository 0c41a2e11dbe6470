"""What one run of the pipeline program is: the schedules and modes it
knows, and the configuration every rank of a run gets."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import List, Tuple

from torch.distributed import pipelining as pp

from .model import ModelConfig

#: name -> (schedule class, stages per rank, placement: "loop" puts stage
#: r + k * world on rank r, "v" puts r and 2 * world - 1 - r there)
SCHEDULES = {
    "1f1b": (pp.Schedule1F1B, 1, "loop"),
    "interleaved-1f1b": (pp.ScheduleInterleaved1F1B, 2, "loop"),
    "interleaved-zb": (pp.ScheduleInterleavedZeroBubble, 2, "loop"),
    "zbv": (pp.ScheduleZBVZeroBubble, 2, "v"),
    "dualpipev": (pp.ScheduleDualPipeV, 2, "v"),
}

#: none: no checkpoints; torch: torch.utils.checkpoint per block; session:
#: prefire.checkpoint per block and prefire.pipelining's sessions; bubble:
#: also prefire in the bubbles; budget: bubble under a byte budget per session
MODES = ("none", "torch", "session", "bubble", "budget")


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    schedule: str = "zbv"
    modes: Tuple[str, ...] = MODES
    steps: int = 5
    warmup: int = 5                # the bubble modes measure the waits in steps 2 and 3
    budget_fraction: float = 0.5   # budget mode: this share of the most one session held in warm-up
    timeout_s: float = 120.0
    eval_steps: int = 0            # schedule.eval() steps after training, counting the recomputations they run

    @staticmethod
    def from_json(text: str) -> "RunConfig":
        raw = json.loads(text)
        raw["model"] = ModelConfig(**raw["model"])
        raw["modes"] = tuple(raw["modes"])
        return RunConfig(**raw)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def stage_indices(schedule: str, rank: int, world: int) -> List[int]:
    _, per_rank, placement = SCHEDULES[schedule]
    if placement == "v":
        return [rank, 2 * world - 1 - rank]
    return [rank + k * world for k in range(per_rank)]


