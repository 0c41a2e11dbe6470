"""One rank of one mode of the pipeline program: builds its stages of the
model, the schedule and (in prefire's modes) the sessions, runs the steps and
writes what it measured. Started by :mod:`prefire.pipeline.launch`:
``python -m prefire.pipeline.worker CONFIG RANK WORLD PORT OUT``."""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from dataclasses import asdict
from datetime import timedelta
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.utils.checkpoint as torch_checkpoint
from torch.distributed import pipelining as pp

import prefire
from prefire import pipelining

from .config import SCHEDULES, RunConfig, stage_indices
from .model import GPT, Stage, data, loss_fn

def block_runner(mode: str):
    if mode == "none":
        return lambda block, x: block(x)
    if mode == "torch":
        return lambda block, x: torch_checkpoint.checkpoint(block, x, use_reentrant=False)
    return lambda block, x: prefire.checkpoint(block, x)


class Recorder:
    """The timeline of one rank: stage actions, receive waits and every block
    run that is not a forward (a recomputation), on time.monotonic()'s clock."""

    def __init__(self) -> None:
        self.events: List[List[Any]] = []   # [kind, stage, micro-batch or block, begin, end]
        self.phase: Optional[str] = None    # the stage action running, if any

    def wrap_stage(self, stage) -> None:
        def timed(name, kind_of):
            inner = getattr(stage, name)

            def run(chunk_id, *args, **kwargs):
                kind = kind_of(args, kwargs)
                self.phase, begin = kind, time.monotonic()
                try:
                    return inner(chunk_id, *args, **kwargs)
                finally:
                    self.phase = None
                    self.events.append([kind, stage.stage_index, chunk_id, begin, time.monotonic()])

            setattr(stage, name, run)

        def backward_kind(args, kwargs):
            full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
            return "BW" if full else "B"

        timed("forward_one_chunk", lambda a, k: "F")
        timed("backward_one_chunk", backward_kind)
        timed("backward_weight_one_chunk", lambda a, k: "W")

    def on_wait(self, kind: str, stage_index: int, micro_batch: int, begin: float, end: float) -> None:
        self.events.append(["wait", stage_index, micro_batch, begin, end])

    def on_block(self, index: int, begin: float, end: float) -> None:
        if self.phase == "F":
            return
        # outside any stage action: a prefire in a bubble
        self.events.append(["recompute" if self.phase else "recompute-bubble", -1, index, begin, end])


def run(cfg: RunConfig, rank: int, world: int, port: int) -> Dict[str, Any]:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=cfg.timeout_s))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=cfg.timeout_s))
    try:
        return measure(cfg, rank, world)
    finally:
        dist.destroy_process_group()


def measure(cfg: RunConfig, rank: int, world: int) -> Dict[str, Any]:
    schedule_cls, per_rank, _ = SCHEDULES[cfg.schedule]
    n_stages = per_rank * world
    model = GPT(cfg.model)
    indices = stage_indices(cfg.schedule, rank, world)
    modules = [Stage(model, i, n_stages, block_runner(cfg.mode)) for i in indices]
    stages = [pp.PipelineStage(m, i, n_stages, torch.device("cpu")) for m, i in zip(modules, indices)]
    schedule = schedule_cls(stages if per_rank > 1 else stages[0], cfg.model.micro_batches, loss_fn=loss_fn)

    sessions = None
    if cfg.mode in ("session", "bubble", "budget"):
        sessions = pipelining.enable(schedule, bubble=cfg.mode != "session")
    recorder = Recorder()
    for stage in stages:
        recorder.wrap_stage(stage)
    waits_seen = True
    try:
        pipelining.on_receive_wait(schedule, after=recorder.on_wait)
    except ValueError:
        waits_seen = False  # Schedule1F1B: no moment between post and wait
    my_blocks = [int(i) for m in modules for i in m.blocks]
    for m in modules:
        for block in m.blocks.values():
            block.observer = recorder.on_block

    tokens, targets = data(cfg.model)
    first, last = 0 in indices, n_stages - 1 in indices
    args = (tokens,) if first else ()
    kwargs = {"target": targets} if last else {}

    steps: List[Dict[str, Any]] = []
    grads: Dict[str, torch.Tensor] = {}
    for step in range(cfg.warmup + cfg.steps):
        if sessions is not None and cfg.mode == "budget" and step == cfg.warmup:
            held = sessions.stats().max_session_bytes
            sessions.set_budget_bytes(int(held * cfg.budget_fraction))
        for m in modules:
            m.zero_grad(set_to_none=True)
        recorder.events.clear()
        if sessions is not None:
            sessions.reset_stats()
        prefire.reset_runtime_peak()
        before = prefire.runtime_stats().recomputations
        dist.barrier()
        begin = time.monotonic()
        schedule.step(*args, **kwargs)
        end = time.monotonic()
        recomputes = [e for e in recorder.events if e[0].startswith("recompute")]
        per_block = {b: sum(1 for e in recomputes if e[2] == b) / cfg.model.micro_batches for b in my_blocks}
        record = {
            "step_s": end - begin,
            "begin": begin,
            "recomputations": len(recomputes),
            "recomputations_per_block_per_micro_batch": per_block,
            "prefire_recomputations": prefire.runtime_stats().recomputations - before,
            "recompute_s": sum(e[4] - e[3] for e in recomputes),
            "recompute_bubble_s": sum(e[4] - e[3] for e in recomputes if e[0] == "recompute-bubble"),
            "wait_s": sum(e[4] - e[3] for e in recorder.events if e[0] == "wait") if waits_seen else None,
            "peak_held_bytes": prefire.runtime_stats().peak_held_bytes,
            "events": [list(e) for e in recorder.events],
        }
        if sessions is not None:
            record["pipelining"] = asdict(sessions.stats())
        steps.append(record)
        grads = {name: p.grad.clone() for m in modules for name, p in m.named_parameters() if p.grad is not None}
    measured = steps[cfg.warmup:]
    last_step = measured[-1]
    return {
        "rank": rank,
        "stages": indices,
        "blocks": my_blocks,
        "step_s": statistics.median(s["step_s"] for s in measured),
        "recompute_s": statistics.median(s["recompute_s"] for s in measured),
        "recompute_bubble_s": statistics.median(s["recompute_bubble_s"] for s in measured),
        "wait_s": statistics.median(s["wait_s"] for s in measured) if waits_seen else None,
        "recomputations": last_step["recomputations"],
        "recomputations_per_block_per_micro_batch": last_step["recomputations_per_block_per_micro_batch"],
        "prefire_recomputations": last_step["prefire_recomputations"],
        "peak_held_bytes": max(s["peak_held_bytes"] for s in measured),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "budget_bytes": sessions.budget_bytes if sessions is not None else None,
        "pipelining": last_step.get("pipelining"),
        "timeline": {"begin": last_step["begin"], "events": last_step["events"]},
        "_grads": grads,
    }


def main(argv: List[str]) -> int:
    config_path, rank, world, port, out = argv
    cfg = RunConfig.from_json(open(config_path).read())
    result = run(cfg, int(rank), int(world), int(port))
    torch.save(result.pop("_grads"), out + ".grads.pt")
    with open(out + ".json", "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
