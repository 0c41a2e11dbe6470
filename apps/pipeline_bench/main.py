"""The pipeline program: a GPT in stages of torch.distributed.pipelining on
several processes (Gloo), in every mode; prints per rank the step time,
recomputations, waits and memory, the gradients compared with a
single-process run, and the ratios between modes. --json and --plot write
the summary and a per-rank timeline."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from dataclasses import asdict
from typing import Any, Dict, List, Optional

import torch
from prefire.pipelining.placement import check_placement_file

from .config import (COMPILE_MODES, KNOWN_MODES, MODES, PLACED_MODE, PLAN_MODES, SCHEDULES, TORCH_W_IN_B_MODE,
                     RunConfig)
from .launch import run_ranks
from .model import ModelConfig, check_config, reference_gradients
from .report import TIMES, compare_gradients, plot, summarize, table


def _merge_rounds(rounds: List[List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """Each rank's result from the last round, with the medians over all
    rounds of the times and the largest memory peaks."""
    merged = []
    for rank, last in enumerate(rounds[-1]):
        r = dict(last)
        for key in TIMES:
            values = [rnd[rank][key] for rnd in rounds]
            r[key] = None if None in values else statistics.median(values)
        for key in ("step_peak_bytes", "peak_held_bytes"):
            r[key] = max(rnd[rank][key] for rnd in rounds)
        merged.append(r)
    return merged


def run(config: RunConfig, world: int = 2, rounds: int = 1, log=None) -> Dict[str, Any]:
    """Runs the modes of ``config`` on ``world`` ranks, ``rounds`` times (a
    new set of processes each time), and returns the summary (see
    :func:`pipeline_bench.report.summarize`). Within a round the modes'
    steps take turns, so that every mode runs under the same conditions."""
    if config.schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {config.schedule!r}; one of {', '.join(SCHEDULES)}")
    modes = config.modes
    unknown = [m for m in modes if m not in KNOWN_MODES]
    if unknown or not modes or len(set(modes)) != len(modes):
        raise ValueError(f"unknown or repeated modes {list(modes)}; choose from {', '.join(KNOWN_MODES)}")
    if set(PLAN_MODES) & set(modes):
        fractions = config.memory_budgets
        if not fractions or min(fractions) < 0 or len({round(f * 100) for f in fractions}) != len(fractions):
            raise ValueError(f"memory_budgets must be distinct non-negative fractions (whole percents), got "
                             f"{list(fractions)}")
        if config.warmup < 1:
            raise ValueError("plan mode measures in its first step: warmup must be at least 1")
    if TORCH_W_IN_B_MODE in modes and not config.compile:
        raise ValueError(f"{TORCH_W_IN_B_MODE} mode runs torch's compiled checkpoint: pass compile (--compile) with it")
    if config.compile_memory_budget is not None and not config.compile:
        raise ValueError("compile_memory_budget (--compile-memory-budget) is prefire.compile's: pass compile "
                         "(--compile) with it")
    if config.compile and (set(modes) - set(COMPILE_MODES) or config.meter_blocks):
        raise ValueError(f"compiled blocks run in modes {', '.join(COMPILE_MODES)} only, without meter_blocks, got "
                         f"{list(modes)}")
    if config.meter_blocks and "budget" in modes:
        raise ValueError("budget mode reads what sessions alone held; it cannot run with meter_blocks")
    if world < 2:
        raise ValueError(f"a pipeline needs at least 2 ranks, got {world}")
    if config.steps < 1 or config.warmup < 0 or rounds < 1:
        raise ValueError("steps and rounds must be at least 1, warmup at least 0")
    if "budget" in modes:
        fractions = config.budgets
        if not fractions or min(fractions) < 0 or len({round(f * 100) for f in fractions}) != len(fractions):
            raise ValueError(f"budgets must be distinct non-negative fractions (whole percents), got {list(fractions)}")
        if config.warmup < 1:
            raise ValueError("budget mode learns what a rank holds in warm-up: warmup must be at least 1")
    if (PLACED_MODE in modes) != (config.placement is not None):
        raise ValueError("placed mode runs a placement and a placement needs placed mode: pass both --modes ...,placed "
                         "and --placement FILE (python -m pipeline_sim place --write-placement)")
    if config.placement is not None:
        check_placement_file(config.placement, config.schedule, world, config.model.micro_batches)
    if ("plan-given" in modes) != (config.choices is not None):
        raise ValueError("plan-given mode runs given choices and choices need plan-given mode (python -m "
                         "pipeline_bench.sweep --choices FILE)")
    if not 0 <= config.tier_bytes_per_second < float("inf"):
        raise ValueError(f"the tier's pace must be a finite number of bytes per second >= 0 (0: unpaced), got "
                         f"{config.tier_bytes_per_second!r}")
    if config.choices is not None:
        check_placement_file(config.choices, config.schedule, world, config.model.micro_batches, what="choices")
    if config.schedule == "1f1b" and {"prefire", "budget", PLACED_MODE} & set(modes):
        raise ValueError("Schedule1F1B waits on a receive where it posts it: no bubble to prefire in; "
                         "run modes none, torch, session with it")
    _, per_rank, _ = SCHEDULES[config.schedule]
    check_config(config.model, per_rank * world)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every rank: the bits depend on it
    try:
        expected = reference_gradients(config.model)
    finally:
        torch.set_num_threads(threads)
    names = [name for name, _, _ in config.runs()]
    results: Dict[str, List[List[Dict[str, Any]]]] = {name: [] for name in names}
    grads: Dict[str, Dict[str, Any]] = {}
    for round_index in range(rounds):
        if log:
            log(f"pipeline_bench: {', '.join(names)} on {world} ranks, round {round_index + 1} of {rounds}")
        ranks, rank_grads = run_ranks(config, world)
        for mode in names:
            results[mode].append([dict(r["modes"][mode]) for r in ranks])
            compared = compare_gradients({n: g for rank in rank_grads for n, g in rank[mode].items()}, expected)
            if mode not in grads or grads[mode]["exact"]:  # keeps the first round that differs, if any
                grads[mode] = compared
    runs = {mode: _merge_rounds(r) for mode, r in results.items()}
    described = asdict(config)
    described.update(world=world, rounds=rounds, torch=torch.__version__,
                     machine=platform.processor() or platform.machine(), threads_per_rank=1, backend="gloo")
    return summarize(described, runs, grads, results)


def read_json_option(p: argparse.ArgumentParser, option: str, path: Optional[str]) -> Any:
    """The JSON file an option names (None without one); the parser's
    error where it cannot be read."""
    if not path:
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        p.error(f"{option}: cannot read {path}: {e}")


def main(argv: Optional[List[str]] = None) -> int:
    d = ModelConfig()
    p = argparse.ArgumentParser(prog="python -m pipeline_bench", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="ranks (processes, Gloo on CPU)")
    p.add_argument("--schedule", choices=list(SCHEDULES), default="zbv", help="torch.distributed.pipelining schedule")
    p.add_argument("--modes", default=",".join(MODES),
                   help="comma-separated, from: " + ", ".join(KNOWN_MODES)
                        + " (the last ones are the memory sweep's: python -m pipeline_bench.sweep)")
    p.add_argument("--steps", type=int, default=5, help="measured steps per mode (medians reported)")
    p.add_argument("--rounds", type=int, default=1,
                   help="runs (new processes each); times are medians over rounds")
    p.add_argument("--warmup", type=int, default=5,
                   help="steps before measuring (bubble prefire measures the waits in steps 2 and 3)")
    p.add_argument("--blocks", type=int, default=d.blocks, help="transformer blocks of the GPT, cut into stages")
    p.add_argument("--dim", type=int, default=d.dim, help="model width")
    p.add_argument("--heads", type=int, default=d.heads, help="attention heads")
    p.add_argument("--seq", type=int, default=d.seq, help="tokens per sequence")
    p.add_argument("--vocab", type=int, default=d.vocab, help="vocabulary size")
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per step")
    p.add_argument("--micro-batches", type=int, default=d.micro_batches, help="micro-batches per step")
    p.add_argument("--budgets", default=",".join(f"{f:g}" for f in RunConfig.budgets),
                   help="budget mode: one run per fraction; a rank's budget is that share of the most it held in "
                        "warm-up with sessions alone (before bubble prefires begin; above 1 leaves room for them)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each block (inductor): none compile(block), torch compile(checkpoint(block)) "
                        f"({TORCH_W_IN_B_MODE}: the same under pipelining.enable), session and prefire "
                        f"prefire.checkpoint(prefire.compile(block)); modes {','.join(COMPILE_MODES)}")
    p.add_argument("--compile-memory-budget", type=float, metavar="F",
                   help="with --compile: session and prefire modes' prefire.compile(block, activation_memory_budget=F)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per round before its ranks are killed")
    p.add_argument("--placement", metavar="FILE",
                   help="placed mode's bubble prefires, as the simulator's search placed them (python -m "
                        "pipeline_sim place RUN.json --schedules S --ranks N "
                        "--write-placement FILE)")
    p.add_argument("--json", metavar="PATH", help="write the summary as JSON ('-': standard output)")
    p.add_argument("--plot", metavar="PATH", help="write the timeline plot (PNG, SVG or PDF by the name)")
    a = p.parse_args(argv)
    model = ModelConfig(vocab=a.vocab, dim=a.dim, heads=a.heads, blocks=a.blocks, seq=a.seq, batch=a.batch,
                        micro_batches=a.micro_batches)
    try:
        budgets = tuple(float(f) for f in a.budgets.split(",") if f)
    except ValueError:
        p.error(f"--budgets: comma-separated fractions, got {a.budgets!r}")
    placement = read_json_option(p, "--placement", a.placement)
    config = RunConfig(model=model, schedule=a.schedule, modes=tuple(m for m in a.modes.split(",") if m),
                       steps=a.steps, warmup=a.warmup, budgets=budgets, timeout_s=a.timeout, placement=placement,
                       compile=a.compile, compile_memory_budget=a.compile_memory_budget)
    try:
        summary = run(config, a.world, a.rounds, log=lambda s: print(s, file=sys.stderr, flush=True))
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
