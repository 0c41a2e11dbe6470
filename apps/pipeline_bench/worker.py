"""One rank of the pipeline program: for each mode, its stages of the model,
the schedule and (in prefire's modes) the sessions; runs the modes' steps in
turn and writes what it measured, or, when it fails, its exception
(``OUT.error``, which the launcher's report leads with). Started by
:mod:`pipeline_bench.launch`:
``python -m pipeline_bench.worker CONFIG RANK WORLD PORT OUT``.

For the failure tests, ``PREFIRE_PIPELINE_FAULT=forward:RANK`` makes a
rank's first stage forward raise, ``bubble:RANK`` its first recomputation in
a bubble (RANK may be ``*``)."""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.utils.checkpoint as torch_checkpoint
from torch.distributed import pipelining as pp

import prefire
from prefire import pipelining
from prefire.pipelining import is_full_backward
from prefire.pipelining.placement import rank_placement
from prefire.pipelining.plans import rank_choices

from .config import PLAN_MODES, SCHEDULES, TORCH_W_IN_B_MODE, RunConfig, stage_indices
from .model import GPT, Stage, data, loss_fn
from .process_exit import exit_process
from .report import TIMES, hideable_s


# Note [The pipeline program's memory figures]
# A mode's memory is what the CPU allocator holds (prefire.allocator_bytes():
# every storage, whoever made it: activations, torch's checkpoint's
# recomputations, gradients, Gloo's buffers, ops' working memory), not
# prefire's census, which sees only what prefire handles (0 for none and
# torch without meter_blocks). The modes take turns in one process, each
# with its own model, so the bytes live at a step's start belong to every
# mode (their weights, the gradients kept for the comparison); a step's
# figure is the most the allocator held during it above what it held when
# it began. Each step starts from gradients set to None and from stages that
# let go of the previous step's state (clear_runtime_states, which torch's
# next step would run first), so it counts everything the step makes:
# activations, gradients, what B keeps for W, receive buffers. A rank
# reports its largest over the measured steps (step_peak_bytes); the census
# (peak_held_bytes) stays beside it: it is what memory_budget covers.


class InjectedFault(RuntimeError):
    """Raised where PREFIRE_PIPELINE_FAULT says (the failure tests)."""


def _fault(kind: str, rank: int) -> bool:
    spec = os.environ.get("PREFIRE_PIPELINE_FAULT", "")
    return spec in (f"{kind}:{rank}", f"{kind}:*")


#: plan-offload's tier per rank: a file in the system's temporary directory (what the default model offloads at most
#: is some tens of MiB a rank)
OFFLOAD_TIER_BYTES = 1 << 30


def compiled_block_runner(mode: str, memory_budget: Optional[float] = None):
    """How a stage runs a block in ``mode`` with ``RunConfig.compile``, each
    block's math (``Block.compute``) compiled once (inductor) and timed
    outside the compiled region: none: ``torch.compile(compute)``; torch and
    torch-w-in-b: torch's compiled checkpoint, the checkpoint inside the
    compiled region (its partitioner recomputes inside the compiled backward,
    as under torchtitan's order); session and prefire: ``prefire.checkpoint`` around
    the block compiled by ``prefire.compile`` (Note [prefire.checkpoint inside
    torch.compile]), under the partitioner's ``memory_budget`` when given."""
    compiled: Dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}

    def of(block):
        fn = compiled.get(block.index)
        if fn is None:
            if mode in ("torch", TORCH_W_IN_B_MODE):
                math = torch.compile(lambda x: torch_checkpoint.checkpoint(block.compute, x, use_reentrant=False))
            elif mode in ("session", "prefire"):
                math = prefire.compile(block.compute, activation_memory_budget=memory_budget)
            else:
                math = torch.compile(block.compute)
            fn = compiled[block.index] = lambda x: block.timed(math, x)
        return fn

    if mode in ("session", "prefire"):
        return lambda block, x: prefire.checkpoint(of(block), x)
    return lambda block, x: of(block)(x)


def block_runner(mode: str, meter: bool = False):
    """How a stage runs a block in ``mode``; ``meter``: inside a
    SavedTensorMeter (a plan mode's planner meters its blocks itself)."""
    if mode == "none":
        run = lambda block, x: block(x)  # noqa: E731
    elif mode == "torch":
        run = lambda block, x: torch_checkpoint.checkpoint(block, x, use_reentrant=False)  # noqa: E731
    elif mode.startswith("torch-every"):
        every = int(mode[len("torch-every"):])
        run = lambda block, x: (torch_checkpoint.checkpoint(block, x, use_reentrant=False)  # noqa: E731
                                if block.index % every == 0 else block(x))
    else:
        return lambda block, x: prefire.checkpoint(block, x)
    if not meter:
        return run

    def metered(block, x):
        with prefire.SavedTensorMeter():
            return run(block, x)

    return metered


class Recorder:
    """The timeline of one rank: stage actions, receive waits and every block
    run that is not a forward (a recomputation), on time.monotonic()'s clock."""

    def __init__(self, rank: int = 0) -> None:
        self.events: List[List[Any]] = []   # [kind, stage, micro-batch or block, begin, end]
        self.phase: Optional[str] = None    # the stage action running, if any
        self.moved_begin: Optional[float] = None  # the running action began after a placed prefire inside it
        self.fault_in = {kind for kind in ("forward", "bubble") if _fault(kind, rank)}

    def wrap_stage(self, stage) -> None:
        def timed(name, kind_of):
            inner = getattr(stage, name)

            def run(chunk_id, *args, **kwargs):
                kind = kind_of(args, kwargs)
                if kind == "F" and "forward" in self.fault_in:
                    raise InjectedFault(f"injected fault: a forward of stage {stage.stage_index}")
                self.phase, self.moved_begin, begin = kind, None, time.monotonic()
                try:
                    return inner(chunk_id, *args, **kwargs)
                finally:
                    self.phase = None
                    self.events.append([kind, stage.stage_index, chunk_id, self.moved_begin or begin,
                                        time.monotonic()])

            setattr(stage, name, run)

        timed("forward_one_chunk", lambda a, k: "F")
        timed("backward_one_chunk", lambda a, k: "BW" if is_full_backward(a, k) else "B")
        timed("backward_weight_one_chunk", lambda a, k: "W")

    def outside_action(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (a placed prefire, Note [Running a placement]) may run
        inside a stage method but is not its action: its block runs are
        bubble prefires, and the action begins after it."""
        def run(*args, **kwargs):
            phase, self.phase = self.phase, None
            try:
                return fn(*args, **kwargs)
            finally:
                self.phase = phase
                if phase is not None:
                    self.moved_begin = time.monotonic()

        return run

    def on_wait(self, kind: str, stage_index: int, micro_batch: int, begin: float, end: float) -> None:
        self.events.append(["wait", stage_index, micro_batch, begin, end])

    def on_block(self, index: int, begin: float, end: float) -> None:
        if self.phase == "F":
            return
        # outside any stage action: a prefire in a bubble
        if self.phase is None and "bubble" in self.fault_in:
            raise InjectedFault(f"injected fault: a recomputation of block {index} in a bubble")
        self.events.append(["recompute" if self.phase else "recompute-bubble", -1, index, begin, end])


class ModeRun:
    """One mode on this rank: its own copy of the model, stages, schedule
    (and prefire's sessions), recorder, and the records of its steps."""

    def __init__(self, cfg: RunConfig, name: str, mode: str, budget_fraction: Optional[float], rank: int,
                 world: int) -> None:
        """``budget_fraction``: the budget mode's share of what sessions held,
        or the plan mode's of the way from the least plan to keeping all."""
        schedule_cls, per_rank, _ = SCHEDULES[cfg.schedule]
        n_stages = per_rank * world
        self.cfg, self.name, self.budget_fraction = cfg, name, budget_fraction
        self.indices = stage_indices(cfg.schedule, rank, world)
        model = GPT(cfg.model)
        self.mode = mode
        if cfg.compile:
            # torch's compiled backward donates its saved buffers unless told not to, and a B/W split's B
            # (retain_graph=True) cannot run one that does: torch's own compiled blocks need this too
            torch._functorch.config.donated_buffer = False
        runner = (compiled_block_runner(mode, cfg.compile_memory_budget) if cfg.compile
                  else block_runner(mode, cfg.meter_blocks))
        self.modules = [Stage(model, i, n_stages, runner) for i in self.indices]
        stages = [pp.PipelineStage(m, i, n_stages, torch.device("cpu")) for m, i in zip(self.modules, self.indices)]
        self.stages = stages
        self.schedule = schedule_cls(stages if per_rank > 1 else stages[0], cfg.model.micro_batches,
                                     loss_fn=loss_fn)
        self.sessions = None
        if mode in ("session", "prefire", "budget", TORCH_W_IN_B_MODE):
            self.sessions = pipelining.enable(self.schedule, bubble=mode in ("prefire", "budget"))
        elif mode == "placed":  # the simulator's placement for this rank (Note [Running a placement])
            self.sessions = pipelining.enable(self.schedule, bubble=True,
                                              placement=rank_placement(cfg.placement, rank))
        elif mode in PLAN_MODES:  # the first step measures; its budget is set from what it found (step())
            given = rank_choices(cfg.choices, rank) if mode == "plan-given" else None
            if mode == "plan-offload-all":
                given = {i: [["OFFLOAD"] * len(m.blocks)] * cfg.model.micro_batches
                         for i, m in zip(self.indices, self.modules)}
            named = {c for rows in (given or {}).values() for row in rows for c in row}
            tier = (prefire.OffloadTier.host_file(tempfile.gettempdir(), OFFLOAD_TIER_BYTES,
                                                  bytes_per_second=cfg.tier_bytes_per_second)
                    if mode == "plan-offload" or "OFFLOAD" in named else None)
            self.sessions = pipelining.enable(self.schedule, memory_budget=1 << 62, bubble=mode == "plan-prefire",
                                              selective=mode == "plan-selective" or "SELECTIVE" in named,
                                              offload_to=tier, choices=given)
        self.recorder = Recorder(rank)
        for stage in stages:
            self.recorder.wrap_stage(stage)
        if mode == "placed":
            self.sessions.wrap_placed_prefires(self.recorder.outside_action)
        self.waits_seen = True
        try:
            pipelining.on_receive_wait(self.schedule, after=self.recorder.on_wait)
        except ValueError:
            self.waits_seen = False  # Schedule1F1B: no moment between post and wait
        self.blocks = [int(i) for m in self.modules for i in m.blocks]
        for m in self.modules:
            for block in m.blocks.values():
                block.observer = self.recorder.on_block
        tokens, targets = data(cfg.model)
        self.args = (tokens,) if 0 in self.indices else ()
        self.kwargs = {"target": targets} if n_stages - 1 in self.indices else {}
        self.steps: List[Dict[str, Any]] = []
        self.none: Optional["ModeRun"] = None  # plan mode: the none run beside it, whose held bytes its budget shares
        self.grads: Dict[str, torch.Tensor] = {}
        self.eval_recomputations = 0

    def step(self) -> None:
        cfg, sessions, recorder = self.cfg, self.sessions, self.recorder
        if self.mode == "budget" and len(self.steps) == cfg.warmup:
            # what sessions alone held: warm-up steps before bubble prefires begin (their amount varies with timing)
            held = max(s["peak_held_bytes"] for s in self.steps if s["pipelining"]["bubble_prefires"] == 0)
            sessions.set_budget_bytes(int(held * self.budget_fraction))
        if self.mode in PLAN_MODES and len(self.steps) == 1:
            costs = sessions.plan.costs
            # the sweep's lowest point: the least budget every step holds, the measuring one included (it
            # checkpoints every block); with offload_to, the least any plan holds (below that, warned)
            least = sessions.least_memory_budget()
            if self.mode not in ("plan-offload", "plan-given", "plan-offload-all"):
                least = max(least, prefire.plan_bytes(costs, [True] * len(costs)))
            # what none mode held on this rank so far, or without it what keeping every block holds by the plan
            most = (max(s["peak_held_bytes"] for s in self.none.steps) if self.none is not None and self.none.steps
                    else prefire.plan_bytes(costs, [False] * len(costs)))
            if cfg.uniform_budget:  # one budget for every rank: a share of the most any rank held
                most_t = torch.tensor([most], dtype=torch.int64)
                dist.all_reduce(most_t, op=dist.ReduceOp.MAX)
                most = int(most_t.item())
            sessions.set_memory_budget(max(least, int(self.budget_fraction * most)))
        for m in self.modules:
            m.zero_grad(set_to_none=True)
        recorder.events.clear()
        if sessions is not None:
            sessions.reset_stats()
        prefire.reset_runtime_peak()
        held_before = prefire.runtime_stats().held_bytes
        before = prefire.runtime_stats().recomputations
        wasted_before = prefire.runtime_stats().wasted_prefires
        # the slack each wait point's rule 2 works to in this step (Note [Filling bubbles]), for the simulator
        slack = [[*point, s] for point, s in sessions.bubble_slack().items()] if sessions is not None else []
        dist.barrier()
        with prefire.AllocatorPeak() as step_peak:  # See Note [The pipeline program's memory figures].
            begin = time.monotonic()
            self.schedule.step(*self.args, **self.kwargs)
            end = time.monotonic()
            # What torch's stages keep of a step until their next one begins (which clears it first): let go
            # now, inside the window, so that no mode's next step starts with it.
            for stage in self.stages:
                type(stage).clear_runtime_states(stage)
        recomputes = [e for e in recorder.events if e[0].startswith("recompute")]
        recompute_s = sum(e[4] - e[3] for e in recomputes)
        record = {
            "step_s": end - begin,
            "begin": begin,
            "recomputations": len(recomputes),
            "recomputations_per_block_per_micro_batch": {
                b: sum(1 for e in recomputes if e[2] == b) / cfg.model.micro_batches for b in self.blocks},
            "prefire_recomputations": prefire.runtime_stats().recomputations - before,
            # prefires no pass used and nobody let go on purpose (Note [A session shares what is registered to it])
            "wasted_prefires": prefire.runtime_stats().wasted_prefires - wasted_before,
            "recompute_s": recompute_s,
            "recompute_bubble_s": sum(e[4] - e[3] for e in recomputes if e[0] == "recompute-bubble"),
            "wait_s": sum(e[4] - e[3] for e in recorder.events if e[0] == "wait") if self.waits_seen else None,
            "hideable_s": hideable_s(recorder.events, recompute_s) if self.waits_seen else None,
            "step_peak_bytes": step_peak.bytes,
            "peak_held_bytes": prefire.runtime_stats().peak_held_bytes - held_before,
            "events": [list(e) for e in recorder.events],
            "slack": slack,
        }
        if sessions is not None:
            record["pipelining"] = asdict(sessions.stats())
        self.steps.append(record)
        self.grads = {n: p.grad.clone() for m in self.modules for n, p in m.named_parameters() if p.grad is not None}

    def eval_step(self) -> None:
        """A forward-only ``schedule.eval()`` step; counts prefire's
        recomputations in it (none should run: no backward will need them)."""
        before = prefire.runtime_stats().recomputations
        dist.barrier()
        self.schedule.eval(*self.args, **self.kwargs)
        self.eval_recomputations += prefire.runtime_stats().recomputations - before

    def result(self, rank: int) -> Dict[str, Any]:
        measured = self.steps[self.cfg.warmup:]
        last = measured[-1]

        def median(key):
            return statistics.median(s[key] for s in measured) if last[key] is not None else None

        return {
            "rank": rank,
            "stages": self.indices,
            "blocks": self.blocks,
            **{key: median(key) for key in TIMES},
            "recomputations": last["recomputations"],
            "recomputations_per_block_per_micro_batch": last["recomputations_per_block_per_micro_batch"],
            "prefire_recomputations": last["prefire_recomputations"],
            "wasted_prefires": sum(s["wasted_prefires"] for s in self.steps),
            "step_peak_bytes": max(s["step_peak_bytes"] for s in measured),
            "peak_held_bytes": max(s["peak_held_bytes"] for s in measured),
            "budget_bytes": self.sessions.budget_bytes if self.sessions is not None else None,
            "memory_budget": self.sessions.memory_budget if self.sessions is not None else None,
            # per stage, per micro-batch and block: the plan's choice by name ("KEEP", "CHECKPOINT", ...)
            "plan": ({str(s): p.to_dict()["choices"] for s, p in self.sessions.plan.stages.items()}
                     if self.sessions is not None and self.sessions.plan is not None else None),
            "measuring_held_bytes": self.steps[0]["peak_held_bytes"],
            # what the plan was chosen from, in the plan's order (the simulator's search)
            # by field name (Note [Costs and plans by name] in python/src/plan_bindings.cpp)
            "plan_costs": ([c.to_dict() for c in self.sessions.plan.costs]
                           if self.sessions is not None and self.sessions.plan is not None else None),
            # one pass's recomputation: the least a budget can hold a rank to
            "floor_bytes": self.sessions.floor_bytes if self.sessions is not None else None,
            "eval_recomputations": self.eval_recomputations,
            "pipelining": last.get("pipelining"),
            # the last measured step's (plots), and every measured step's (the simulator's durations)
            "timeline": {"begin": last["begin"], "events": last["events"],
                         "steps": [{"begin": s["begin"], "step_s": s["step_s"], "events": s["events"],
                                    "slack": s["slack"]} for s in measured]},
        }


def run(cfg: RunConfig, rank: int, world: int, port: int, running_marker: Optional[str] = None) -> Dict[str, Any]:
    """Every mode of ``cfg`` on this rank, their steps interleaved (one step
    of each mode in turn), so that they run under the same conditions."""
    torch.set_num_threads(1)
    prefire.count_cpu_allocations()  # before any model: Note [The pipeline program's memory figures]
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=cfg.timeout_s))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=cfg.timeout_s))
    if running_marker:
        open(running_marker, "w").close()  # the failure tests wait for it
    try:
        runs = [ModeRun(cfg, name, mode, fraction, rank, world) for name, mode, fraction in cfg.runs()]
        for r in runs:
            r.none = next((o for o in runs if o.mode == "none"), None)
        for _ in range(cfg.warmup + cfg.steps):
            for r in runs:
                r.step()
        for _ in range(cfg.eval_steps):
            for r in runs:
                r.eval_step()
        return {
            "modes": {r.name: r.result(rank) for r in runs},
            "_grads": {r.name: r.grads for r in runs},
        }
    except BaseException as e:
        # When it failed, before the process group goes down and fails the
        # other ranks: the launcher reports the rank that failed first.
        e.prefire_failed_at = time.time()
        raise
    finally:
        dist.destroy_process_group()


def main(argv: List[str]) -> int:
    config_path, rank, world, port, out = argv
    try:
        cfg = RunConfig.from_json(open(config_path).read())
        result = run(cfg, int(rank), int(world), int(port), running_marker=out + ".running")
    except BaseException as e:
        with open(out + ".error", "w") as f:  # the launcher reports the first of these
            json.dump({"time": getattr(e, "prefire_failed_at", time.time()), "traceback": traceback.format_exc()}, f)
        raise
    torch.save(result.pop("_grads"), out + ".grads.pt")
    with open(out + ".json", "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    # main returns only after the rank wrote its results and destroyed its
    # process group (Note [Leaving a process that ran Gloo collectives])
    exit_process(main(sys.argv[1:]))
