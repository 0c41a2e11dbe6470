"""What one run of the pipeline program is: the schedules and modes it
knows, and the configuration every rank of a run gets."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from torch.distributed import pipelining as pp

from .model import ModelConfig

#: name -> (schedule class, stages per rank, layout: "loop" puts stage
#: r + k * world on rank r, "v" puts r and 2 * world - 1 - r there)
SCHEDULES = {
    "1f1b": (pp.Schedule1F1B, 1, "loop"),
    "interleaved-1f1b": (pp.ScheduleInterleaved1F1B, 2, "loop"),
    "interleaved-zb": (pp.ScheduleInterleavedZeroBubble, 2, "loop"),
    "zbv": (pp.ScheduleZBVZeroBubble, 2, "v"),
    "dualpipev": (pp.ScheduleDualPipeV, 2, "v"),
}

#: The modes, named as prefire-bench names its own: none: no checkpoints;
#: torch: torch.utils.checkpoint per block (recomputed in B and again in W);
#: session: prefire.checkpoint per block and prefire.pipelining's sessions
#: (one recomputation per micro-batch, lazily in B); prefire: also
#: recomputed ahead, in the bubbles (``enable(bubble=True)``); budget:
#: prefire under a rank's byte budget, one run per fraction in
#: ``RunConfig.budgets`` (a sweep)
MODES = ("none", "torch", "session", "prefire", "budget")
#: placed: prefire.checkpoint, sessions and the bubble prefires of ``RunConfig.placement`` in place of the
#: filler's rules (Note [Running a placement])
PLACED_MODE = "placed"
#: the memory sweep's (``python -m pipeline_bench.sweep``): torch-every<n>:
#: torch.utils.checkpoint on the blocks whose index is a multiple of n; plan:
#: sessions under ``enable(schedule, memory_budget=...)``, one run per
#: fraction in ``RunConfig.memory_budgets``; plan-prefire: the same with
#: ``bubble=True`` (prefire in the bubbles within what the plan leaves);
#: plan-selective: the same with ``selective=True`` (a block may also be
#: checkpointed selectively: matmul and attention outputs kept);
#: plan-offload: the same with ``offload_to=`` a host file tier in the
#: system's temporary directory (a block may also be offloaded);
#: plan-given: ``choices=`` the simulator's joint plan (``RunConfig.choices``)
#: in place of the planner's, at the same budget; plan-offload-all: ``choices=``
#: every block offloaded to that tier (what a framework's "offload
#: activations" switch does), the baseline a plan with offload must beat
PLAN_MODES = ("plan", "plan-prefire", "plan-selective", "plan-offload", "plan-given", "plan-offload-all")
SWEEP_MODES = ("torch-every2", "torch-every3", "torch-every4") + PLAN_MODES
#: compiled blocks only: torch's compiled checkpoint under ``pipelining.enable(schedule)``, whose W takes the
#: weight gradients B's compiled backward computed (Note [Weight gradients a custom Function computes in B])
TORCH_W_IN_B_MODE = "torch-w-in-b"
#: the modes RunConfig.compile runs
COMPILE_MODES = ("none", "torch", TORCH_W_IN_B_MODE, "session", "prefire")
#: every mode the program runs, in the order its help lists them
KNOWN_MODES = MODES + (PLACED_MODE, TORCH_W_IN_B_MODE) + SWEEP_MODES


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    schedule: str = "zbv"
    modes: Tuple[str, ...] = MODES
    steps: int = 5
    warmup: int = 5                # the prefire modes measure the waits in steps 2 and 3
    #: budget mode: one run per fraction; a rank's budget is that share of the
    #: most it held in warm-up with sessions alone (before bubble prefires
    #: begin); above 1 leaves room for bubble prefires
    budgets: Tuple[float, ...] = (0.75, 0.5, 0.25)
    #: plan mode: one run per fraction; a rank's memory budget is that share
    #: of what none mode held on the rank (without none mode: of what
    #: keeping every block holds by the plan's count), the least plan if
    #: that is more; set after the plan's measuring step (its first)
    memory_budgets: Tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    #: plan mode: every rank gets one budget, that share of the most none
    #: mode held on any rank (what an SPMD script passes every rank: a
    #: device's memory), in place of a share of what none held on the rank
    uniform_budget: bool = False
    #: every block runs in a SavedTensorMeter, so peak_held_bytes (the
    #: census) counts the blocks' activations too (the memory sweep; the
    #: budget mode reads recomputed bytes alone)
    meter_blocks: bool = False
    #: each block torch.compile'd (inductor), in COMPILE_MODES (worker.block_runner says how each runs it)
    compile: bool = False
    #: with compile: session and prefire modes' prefire.compile(activation_memory_budget=) (None: torch's 1)
    compile_memory_budget: Optional[float] = None
    timeout_s: float = 120.0
    eval_steps: int = 0            # schedule.eval() steps after training, counting the recomputations they run
    #: placed mode: the simulator's placement (``simulate place --write-placement``), every rank's
    placement: Optional[Dict[str, Any]] = None
    #: plan-given mode: the choices of the simulator's joint plan (``place --write-choices``), every rank's
    choices: Optional[Dict[str, Any]] = None
    #: plan-offload, plan-given and plan-offload-all: the host file tier's pace (bytes_per_second=; 0: as fast as
    #: this machine writes and reads the file)
    tier_bytes_per_second: float = 0.0

    @staticmethod
    def from_json(text: str) -> "RunConfig":
        raw = json.loads(text)
        raw["model"] = ModelConfig(**raw["model"])
        raw["modes"] = tuple(raw["modes"])
        raw["budgets"] = tuple(raw["budgets"])
        raw["memory_budgets"] = tuple(raw["memory_budgets"])
        return RunConfig(**raw)

    def runs(self) -> List[Tuple[str, str, Optional[float]]]:
        """(name, mode, budget fraction) of each run: a mode, or for budget
        one per fraction, named like "budget 50%"."""
        out: List[Tuple[str, str, Optional[float]]] = []
        for mode in self.modes:
            if mode == "budget":
                out += [(f"budget {round(f * 100)}%", mode, f) for f in self.budgets]
            elif mode in PLAN_MODES:
                out += [(f"{mode} {round(f * 100)}%", mode, f) for f in self.memory_budgets]
            else:
                out.append((mode, mode, None))
        return out

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def stage_indices(schedule: str, rank: int, world: int) -> List[int]:
    """The stages ``rank`` runs, by the schedule's layout."""
    _, per_rank, layout = SCHEDULES[schedule]
    if layout == "v":
        return [rank, 2 * world - 1 - rank]
    return [rank + k * world for k in range(per_rank)]


def stage_rank(schedule: str, world: int) -> Callable[[int], int]:
    """The rank that runs each stage (the inverse of :func:`stage_indices`)."""
    owner = {stage: rank for rank in range(world) for stage in stage_indices(schedule, rank, world)}
    return owner.__getitem__


