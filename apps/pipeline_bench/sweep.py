"""The pipeline program's memory sweep: ``python -m pipeline_bench.sweep``.

For each memory budget (a share of what none mode held on the rank, or
with --uniform-budget one budget for every rank, that share of the most none
held on any rank; the least plan where that is less), prefire's plan
(``enable(schedule, memory_budget=...)``) next to the configurations a user
writes with torch's checkpoint (every block, every n-th block for n = 2, 3,
4, none). Memory is measured two ways, per rank: the step peak, the most
the CPU allocator held during a step above what it held when it began
(every allocation, whoever made it: Note [The pipeline program's memory
figures] in worker.py), and prefire's census of the blocks' activations
(saved tensors, checkpoint inputs and recomputations; every block runs in
a SavedTensorMeter), which is what memory_budget covers: a plan is within
its budget when its census is. A torch configuration fits a plan's budget
when its step peak is at most the plan's on every rank: it uses no more
memory, by the allocator, than the plan did. Session mode (every block
checkpointed, unmetered) runs too, for the simulator's search over
per-block plans (``python -m pipeline_sim search``).
Prints a table, and with --plot step time against step peak, one curve per
approach."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any, Dict, List, Optional

from .config import PLAN_MODES, SCHEDULES, RunConfig
from .main import read_json_option, run
from .model import ModelConfig

MiB = float(1 << 20)
TORCH = ("none", "torch-every4", "torch-every3", "torch-every2", "torch")


def _held(mode: Dict[str, Any]) -> List[int]:
    """Per rank, prefire's census (what memory_budget covers)."""
    return [r["peak_held_bytes"] for r in mode["ranks"]]


def _peak(mode: Dict[str, Any]) -> List[int]:
    """Per rank, the step peak by the allocator."""
    return [r["step_peak_bytes"] for r in mode["ranks"]]


def paired(summary: Dict[str, Any], mode: str, base: str) -> Optional[float]:
    """The median over every measured step of every round of ``mode``'s
    step over ``base``'s step of the same index (those ran side by side:
    the machine's slow spells fall on both), None without the steps."""
    every = summary.get("rounds", {}).get("steps_s", {})
    if mode not in every or base not in every:
        return None
    ratios = [a / b for ours, theirs in zip(every[mode], every[base]) for a, b in zip(ours, theirs)]
    return statistics.median(ratios) if ratios else None


def rows(summary: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One row per plan run: its budget, census and step peak per rank, its
    step, the torch configurations whose step peak is at most its own on
    every rank, the fastest of them."""
    modes = summary["modes"]
    out = []
    for name, mode in modes.items():
        if name.split(" ")[0] not in PLAN_MODES:
            continue
        budgets = [r["memory_budget"] for r in mode["ranks"]]
        fits = {t: modes[t] for t in TORCH if t in modes
                and all(theirs <= ours for theirs, ours in zip(_peak(modes[t]), _peak(mode)))}
        fastest = min(fits, key=lambda t: fits[t]["step_s"]) if fits else None
        out.append({
            "name": name, "budgets": budgets, "held": _held(mode), "step_peak": _peak(mode),
            "measuring_held": [r["measuring_held_bytes"] for r in mode["ranks"]],
            "step_s": mode["step_s"], "plan": [r["plan"] for r in mode["ranks"]],
            "within_budget": all(h <= b for h, b in zip(_held(mode), budgets)),
            "exact": mode["gradients"]["exact"],
            "fits": {t: m["step_s"] for t, m in fits.items()}, "fastest_fit": fastest,
            "plan_over_fastest": mode["step_s"] / fits[fastest]["step_s"] if fastest else None,
            "plan_over_none": mode["step_s"] / modes["none"]["step_s"] if "none" in modes else None,
            "plan_over_none_paired": paired(summary, name, "none"),
        })
    return out


def table(summary: Dict[str, Any]) -> str:
    modes = summary["modes"]
    lines = ["torch's configurations: step peak MiB per rank (allocator), activations MiB per rank (census), step ms"]
    for t in TORCH:
        if t in modes:
            peak = ", ".join(f"{p / MiB:.2f}" for p in _peak(modes[t]))
            held = ", ".join(f"{h / MiB:.2f}" for h in _held(modes[t]))
            lines.append(f"  {t:13s} {peak:>16s}  {held:>16s}  {modes[t]['step_s'] * 1e3:8.1f} ms")
    lines.append("prefire's plan: per rank budget -> activations MiB (census; measuring step), step peak MiB "
                 "(allocator); step ms; blocks per stage (k: kept, c: checkpointed, s: selectively, o: offloaded; per "
                 "micro-batch, "
                 "split by /, where they differ); torch's that fit (step peak at most the plan's on every rank); "
                 "plan / fastest that fits; plan / none (its steps over none's of the same index: their median)")
    for r in rows(summary):
        per_rank = "; ".join(f"{b / MiB:.2f} -> {h / MiB:.2f} ({m / MiB:.2f}), {p / MiB:.2f}"
                             for b, h, m, p in zip(r["budgets"], r["held"], r["measuring_held"], r["step_peak"]))
        plan = " ".join(f"{s}:{plan_letters(choices)}" for p in r["plan"] for s, choices in p.items())
        fits = ", ".join(f"{t} {s * 1e3:.0f}" for t, s in r["fits"].items()) or "none fits"
        ratio = f"{r['plan_over_fastest']:.2f}" if r["plan_over_fastest"] is not None else "-"
        step_pairs = f" ({r['plan_over_none_paired']:.2f})" if r["plan_over_none_paired"] is not None else ""
        lines.append(f"  {r['name']:16s} {per_rank}  {r['step_s'] * 1e3:8.1f} ms  [{plan}]  {fits}  {ratio}  "
                     f"{r['plan_over_none']:.2f}{step_pairs}{'' if r['within_budget'] else '  OVER BUDGET'}"
                     f"{'' if r['exact'] else '  GRADIENTS DIFFER'}")
    return "\n".join(lines)


#: a plan's choices as the sweep's table writes them
LETTERS = {"KEEP": "k", "CHECKPOINT": "c", "SELECTIVE": "s", "OFFLOAD": "o"}


def plan_letters(choices: List[List[str]]) -> str:
    """A stage's plan (per micro-batch and block, a choice by name): per
    block k (kept), c (checkpointed), s (selectively) or o (offloaded); per
    micro-batch, joined by "/", where they differ."""
    per_micro_batch = ["".join(LETTERS[c] for c in blocks) for blocks in choices]
    return per_micro_batch[0] if len(set(per_micro_batch)) == 1 else "/".join(per_micro_batch)


def plot(summary: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = summary["modes"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, label in (("plan", "prefire plan"), ("plan-prefire", "prefire plan, bubble=True"),
                        ("plan-selective", "prefire plan, selective=True"),
                        ("plan-offload", "prefire plan, offload_to=a host file tier")):
        plans = sorted((r for r in rows(summary) if r["name"].split(" ")[0] == mode),
                       key=lambda r: max(r["step_peak"]))
        if plans:
            ax.plot([max(r["step_peak"]) / MiB for r in plans], [r["step_s"] * 1e3 for r in plans], "o-",
                    label=label)
    torch_runs = sorted((m for m in TORCH if m in modes), key=lambda m: max(_peak(modes[m])))
    ax.plot([max(_peak(modes[m])) / MiB for m in torch_runs], [modes[m]["step_s"] * 1e3 for m in torch_runs], "s--",
            label="torch checkpoint (all, every n-th, none)")
    for m in torch_runs:
        ax.annotate(m.replace("torch-", ""), (max(_peak(modes[m])) / MiB, modes[m]["step_s"] * 1e3), fontsize=8)
    c = summary["config"]
    ax.set_xlabel("step peak MiB, CPU allocator (the rank that held most)")
    ax.set_ylabel("step ms")
    ax.set_title(f"{c['schedule']}, {c['world']} ranks: step time against memory")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline_bench.sweep", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--schedule", choices=list(SCHEDULES), default="zbv")
    p.add_argument("--memory-budgets", default="0,0.25,0.5,0.75,1",
                   help="a rank's budget per plan run: this share of what none mode held there")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--prefire", action="store_true",
                   help="also each budget's plan with bubble=True (prefire in bubbles within what the plan leaves)")
    p.add_argument("--selective", action="store_true",
                   help="also each budget's plan with selective=True (a block may be checkpointed selectively)")
    p.add_argument("--offload", action="store_true",
                   help="also each budget's plan with offload_to= a host file tier (a block may be offloaded)")
    p.add_argument("--choices", metavar="FILE",
                   help="also each budget's plan-given run: the simulator's joint plan in place of the planner's "
                        "(python -m pipeline_sim place ... --plan-sweep S.json --write-choices FILE; ValueError where "
                        "it holds more than the budget)")
    p.add_argument("--offload-all", action="store_true",
                   help="also each budget's plan-offload-all run: every block offloaded to the tier (the baseline a "
                        "plan with offload must beat)")
    p.add_argument("--tier-bandwidth", type=float, default=0.0, metavar="GB/S",
                   help="pace the offload tier: each copy, either way, takes at least its bytes / this (0: unpaced)")
    p.add_argument("--uniform-budget", action="store_true",
                   help="one budget for every rank: each fraction of the most none held on any rank (what an SPMD "
                        "script passes), not of what none held on each rank")
    p.add_argument("--plans-only", action="store_true",
                   help="none (what the budgets are shares of) and the plan runs only, without torch's "
                        "configurations and session: fewer runs taking turns, for the paired ratios to none")
    p.add_argument("--tiny", action="store_true", help="a tiny model (the test's)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PATH")
    a = p.parse_args(argv)
    model = ModelConfig(vocab=64, dim=32, heads=2, blocks=4, seq=16, batch=4, micro_batches=2) if a.tiny \
        else ModelConfig()
    fractions = tuple(float(f) for f in a.memory_budgets.split(",") if f)
    modes = (("none",) if a.plans_only else TORCH + ("session",)) + ("plan",) + \
        (("plan-prefire",) if a.prefire else ()) + \
        (("plan-selective",) if a.selective else ()) + (("plan-offload",) if a.offload else ()) + \
        (("plan-given",) if a.choices else ()) + (("plan-offload-all",) if a.offload_all else ())
    choices = read_json_option(p, "--choices", a.choices)
    config = RunConfig(model=model, schedule=a.schedule, modes=modes, steps=a.steps, warmup=a.warmup,
                       memory_budgets=fractions, uniform_budget=a.uniform_budget, meter_blocks=True, timeout_s=600.0,
                       choices=choices, tier_bytes_per_second=a.tier_bandwidth * 1e9)
    try:
        summary = run(config, a.world, a.rounds, log=lambda s: print(s, file=sys.stderr, flush=True))
    except ValueError as e:
        p.error(str(e))
    print(table(summary))
    summary["sweep"] = rows(summary)
    if a.json:
        with open(a.json, "w") as f:  # with the timelines: the simulator's search reads them
            json.dump(summary, f)
    if a.plot:
        plot(summary, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
