"""The pipeline program: a GPT in stages of torch.distributed.pipelining on
several processes (Gloo), run once per mode; prints per rank the step time,
recomputations, waits and memory, the gradients compared with a
single-process run, and the ratios between modes. --json and --plot write
the summary and a per-rank timeline."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import asdict, replace
from typing import Any, Dict, List, Optional, Sequence

import torch

from .config import MODES, SCHEDULES, RunConfig
from .launch import run_ranks
from .model import ModelConfig, check_config, reference_gradients
from .report import compare_gradients, plot, summarize, table



def run(config: RunConfig, world: int = 2, modes: Sequence[str] = MODES, log=None) -> Dict[str, Any]:
    """Runs ``modes`` of ``config`` on ``world`` ranks, one set of processes
    per mode (so that each mode's peak RSS is its own), and returns the
    summary (see :func:`prefire.pipeline.report.summarize`)."""
    if config.schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {config.schedule!r}; one of {', '.join(SCHEDULES)}")
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ValueError(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    if world < 2:
        raise ValueError(f"a pipeline needs at least 2 ranks, got {world}")
    if config.steps < 1 or config.warmup < 0:
        raise ValueError("steps must be at least 1 and warmup at least 0")
    if config.schedule == "1f1b" and {"bubble", "budget"} & set(modes):
        raise ValueError("Schedule1F1B waits on a receive where it posts it: no bubble to prefire in; "
                         "run modes none, torch, session with it")
    _, per_rank, _ = SCHEDULES[config.schedule]
    check_config(config.model, per_rank * world)
    torch.set_num_threads(1)
    expected = reference_gradients(config.model)
    runs, grads = {}, {}
    for mode in modes:
        if log:
            log(f"prefire.pipeline: mode {mode} on {world} ranks ...")
        results, rank_grads = run_ranks(replace(config, mode=mode), world)
        merged = {name: g for rank in rank_grads for name, g in rank.items()}
        runs[mode], grads[mode] = results, compare_gradients(merged, expected)
    described = asdict(config)
    del described["mode"]
    described.update(world=world, torch=torch.__version__, machine=platform.processor() or platform.machine(),
                     threads_per_rank=1, backend="gloo")
    return summarize(described, runs, grads)


def main(argv: Optional[List[str]] = None) -> int:
    d = ModelConfig()
    p = argparse.ArgumentParser(prog="python -m prefire.pipeline", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="ranks (processes, Gloo on CPU)")
    p.add_argument("--schedule", choices=list(SCHEDULES), default="zbv")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, from " + ", ".join(MODES))
    p.add_argument("--steps", type=int, default=5, help="measured steps per mode (medians reported)")
    p.add_argument("--warmup", type=int, default=4,
                   help="steps before measuring (bubble prefire measures the waits in the first two)")
    p.add_argument("--blocks", type=int, default=d.blocks)
    p.add_argument("--dim", type=int, default=d.dim)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--seq", type=int, default=d.seq)
    p.add_argument("--vocab", type=int, default=d.vocab)
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per step")
    p.add_argument("--micro-batches", type=int, default=d.micro_batches)
    p.add_argument("--budget-fraction", type=float, default=0.5,
                   help="budget mode: per-session budget as this share of the most one session held in warm-up")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per mode before its ranks are killed")
    p.add_argument("--json", metavar="PATH", help="write the summary as JSON ('-': standard output)")
    p.add_argument("--plot", metavar="PATH", help="write the timeline plot (PNG, SVG or PDF by the name)")
    a = p.parse_args(argv)
    if not 0 <= a.budget_fraction <= 1:
        p.error("--budget-fraction must be within [0, 1]")
    model = ModelConfig(vocab=a.vocab, dim=a.dim, heads=a.heads, blocks=a.blocks, seq=a.seq, batch=a.batch,
                        micro_batches=a.micro_batches)
    config = RunConfig(model=model, schedule=a.schedule, steps=a.steps, warmup=a.warmup,
                       budget_fraction=a.budget_fraction, timeout_s=a.timeout)
    try:
        summary = run(config, a.world, [m for m in a.modes.split(",") if m],
                      log=lambda s: print(s, file=sys.stderr, flush=True))
    except ValueError as e:
        p.error(str(e))
    print(table(summary))
    if a.json:
        text = json.dumps(summary, indent=1)
        if a.json == "-":
            print(text)
        else:
            with open(a.json, "w") as f:
                f.write(text + "\n")
    if a.plot:
        plot(summary, a.plot)
    return 0
