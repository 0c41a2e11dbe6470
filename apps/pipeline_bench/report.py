"""What the pipeline program prints and writes: the summary of every mode's
ranks (and the ratios between modes), the table, and the timeline plot."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

MiB = 1 << 20

#: per-rank times of a step: a rank reports their medians over its measured
#: steps, a run of several rounds the medians over rounds
TIMES = ("step_s", "recompute_s", "recompute_bubble_s", "wait_s", "hideable_s")

# Timeline colours by event kind (the plot's legend).
_COLOURS = {
    "F": ("#4C72B0", "forward"),
    "B": ("#DD8452", "B (input grads)"),
    "W": ("#55A868", "W (weight grads)"),
    "BW": ("#8172B3", "full backward"),
    "wait": ("#BBBBBB", "waiting on a receive"),
    "recompute": ("#C44E52", "recomputation in backward"),
    "recompute-bubble": ("#E6AB02", "recomputation in a bubble"),
}


def hideable_s(events: List[List[Any]], recompute_s: float) -> float:
    """The most recomputation time one step's receive waits could have held on
    a rank: a wait can hold the recomputation of a micro-batch (a stage's
    share of ``recompute_s``, once) that had run forward and had not begun
    backward when the wait began. ``events``: the step's ``[kind, stage,
    index, begin, end]``. Waits are filled in time order, each with the
    micro-batches whose backward comes first (optimal for work that may be
    split, Glover's rule for intervals)."""
    forward_end: Dict[Any, float] = {}
    backward_begin: Dict[Any, float] = {}
    for kind, stage, mb, begin, end in events:
        if kind == "F":
            forward_end[(stage, mb)] = end
        elif kind in ("B", "BW"):
            backward_begin.setdefault((stage, mb), begin)
    units = [u for u in forward_end if u in backward_begin]
    if not units or recompute_s <= 0:
        return 0.0
    left = {u: recompute_s / len(units) for u in units}
    total = 0.0
    for _, _, _, begin, end in sorted((e for e in events if e[0] == "wait"), key=lambda e: e[3]):
        room = end - begin
        pending = sorted((u for u in units if forward_end[u] <= begin < backward_begin[u] and left[u] > 0),
                         key=backward_begin.get)
        for u in pending:
            if room <= 0:
                break
            moved = min(room, left[u])
            left[u] -= moved
            room -= moved
            total += moved
    return total


def compare_gradients(got: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    """Bit-equality of a rank's gradients with the single-process run's."""
    missing = sorted(set(expected) - set(got))
    diff = max((float((g - expected[n]).abs().max()) for n, g in got.items()), default=0.0)
    exact = all(torch.equal(g, expected[n]) for n, g in got.items())
    return {"exact": exact, "max_abs_diff": diff, "parameters": len(got), "missing": missing}


def summarize(config: Dict[str, Any], runs: Dict[str, List[Dict[str, Any]]],
              grads: Dict[str, Dict[str, Any]],
              rounds: Optional[Dict[str, List[List[Dict[str, Any]]]]] = None) -> Dict[str, Any]:
    """``runs``: mode -> each rank's result; ``grads``: mode -> the comparison
    over all ranks; ``rounds``: mode -> each round's ranks (for the spread
    across rounds). Adds a mode's step time (the slowest rank's: a step ends
    when every rank's has), the ratios to torch's checkpoint, the hidden
    fraction H = (session - prefire) / (session - none) of the recomputation
    time, per rank and overall, the most H the waits allow (from session
    mode's steps and hideable recomputation), each of those per round (their
    min-max is the spread the table shows), and whether H came out above its
    bound (then the run was noisy: it cannot be, but for timing noise)."""
    spread = _spread(rounds or {mode: [ranks] for mode, ranks in runs.items()})
    modes: Dict[str, Any] = {}
    timelines: Dict[str, Any] = {}
    for mode, ranks in runs.items():
        timelines[mode] = [r.pop("timeline") for r in ranks]
        modes[mode] = {"step_s": max(r["step_s"] for r in ranks), "ranks": ranks, "gradients": grads[mode]}

    def step(mode: str, rank: Optional[int] = None) -> Optional[float]:
        if mode not in modes:
            return None
        return modes[mode]["step_s"] if rank is None else modes[mode]["ranks"][rank]["step_s"]

    def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
        return a / b if a is not None and b else None

    def hidden(rank: Optional[int] = None, mode: str = "prefire") -> Optional[float]:
        return _hidden_fraction(step("session", rank), step(mode, rank), step("none", rank))

    def hidden_bound() -> Optional[float]:
        # In prefire mode a rank does all of session mode's work and can move
        # into its waits at most what they could hold: its step cannot end
        # before session's minus that.
        if not {"session", "none"} <= set(modes) or step("session") <= step("none"):
            return None
        ranks = modes["session"]["ranks"]
        if any(r["hideable_s"] is None for r in ranks):
            return None
        floor = max(r["step_s"] - r["hideable_s"] for r in ranks)
        return min(1.0, max(0.0, step("session") - floor) / (step("session") - step("none")))

    world = len(next(iter(runs.values())))
    h, bound = hidden(), hidden_bound()
    placed = {"hidden_fraction_placed": {"overall": hidden(None, "placed"),
                                         "per_rank": [hidden(r, "placed") for r in range(world)]}
              } if "placed" in modes else {}
    return {
        "config": config,
        "modes": modes,
        "ratios": {f"{m}/torch": ratio(step(m), step("torch")) for m in modes if m != "torch"},
        "hidden_fraction": {"overall": h, "per_rank": [hidden(r) for r in range(world)]},
        **placed,
        "hidden_fraction_bound": bound,
        # placed mode's H is bounded the same way: its prefires, too, only move recomputation into waits
        "noisy": bound is not None and any(x is not None and x > bound + 0.01
                                           for x in (h, placed.get("hidden_fraction_placed", {}).get("overall"))),
        "rounds": spread,
        "timelines": timelines,
    }


def _hidden_fraction(lazy: Optional[float], pre: Optional[float], none: Optional[float]) -> Optional[float]:
    """H = (session - prefire) / (session - none): the share of the
    recomputation time that bubble prefires hid; None where it is undefined."""
    if None in (lazy, pre, none) or lazy <= none:
        return None
    return (lazy - pre) / (lazy - none)


def _spread(rounds: Dict[str, List[List[Dict[str, Any]]]]) -> Dict[str, Any]:
    """Per round: each mode's step time (slowest rank) and H; with their
    min and max; and every measured step's time (slowest rank), per round
    (``steps_s``: the modes' steps of one index ran in turn, side by side)."""
    steps = {mode: [max(r["step_s"] for r in ranks) for ranks in per_round] for mode, per_round in rounds.items()}
    every: Dict[str, List[List[float]]] = {}
    for mode, per_round in rounds.items():
        if all(r.get("timeline", {}).get("steps") for ranks in per_round for r in ranks):
            every[mode] = [[max(step) for step in zip(*([s["step_s"] for s in r["timeline"]["steps"]] for r in ranks))]
                           for ranks in per_round]

    def per_round(mode: str) -> Dict[str, Any]:
        hs: List[Optional[float]] = []
        if {"session", mode, "none"} <= set(steps):
            hs = [_hidden_fraction(*times) for times in zip(steps["session"], steps[mode], steps["none"])]
        known = [x for x in hs if x is not None]
        return {"per_round": hs, "min": min(known) if known else None, "max": max(known) if known else None}

    return {
        "step_s": {mode: {"per_round": v, "min": min(v), "max": max(v)} for mode, v in steps.items()},
        "hidden_fraction": per_round("prefire"),
        **({"hidden_fraction_placed": per_round("placed")} if "placed" in steps else {}),
        "steps_s": every,
    }


def cell(value: Optional[float], scale: float = 1.0, digits: int = 1) -> str:
    """A table cell: ``value`` times ``scale``, or "-" where there is none."""
    return "-" if value is None else f"{value * scale:.{digits}f}"


def table(summary: Dict[str, Any]) -> str:
    head = ("mode", "rank", "stages", "step ms", "recomp/block/mb", "recomp ms", "in bubble ms", "wait ms",
            "hideable ms", "step peak MiB", "held MiB", "grads")
    rows = [head]
    for mode, m in summary["modes"].items():
        grads = "exact" if m["gradients"]["exact"] else f"diff {m['gradients']['max_abs_diff']:.1e}"
        for r in m["ranks"]:
            per_block = list(r["recomputations_per_block_per_micro_batch"].values())
            lo, hi = min(per_block), max(per_block)
            rows.append((mode, str(r["rank"]), ",".join(map(str, r["stages"])), cell(r["step_s"], 1e3),
                         f"{lo:g}" if lo == hi else f"{lo:g}-{hi:g}", cell(r["recompute_s"], 1e3),
                         cell(r["recompute_bubble_s"], 1e3), cell(r["wait_s"], 1e3),
                         cell(r["hideable_s"], 1e3), cell(r["step_peak_bytes"], 1 / MiB),
                         cell(r["peak_held_bytes"], 1 / MiB), grads))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if i > 2 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    out = ["\n".join(lines), ""]
    out.append("step peak: the most the CPU allocator held during a step above what it held when the step began "
               "(every allocation: activations, recomputations, gradients, receive buffers; the largest over the "
               "measured steps); held: prefire's census at the step's peak (its recomputations, and every block's "
               "saved tensors where blocks are metered), what memory_budget and budget_bytes cover")
    out += _budget_sweep(summary["modes"])
    if any(v is not None for v in summary["ratios"].values()):  # torch's mode ran
        out.append("step time (slowest rank), ratio to torch's checkpoint: " + ", ".join(
            f"{k} {cell(v, 1, 3)}" for k, v in summary["ratios"].items()))
    spread = summary["rounds"]
    rounds = len(next(iter(spread["step_s"].values()))["per_round"])
    out.append(f"step ms over {rounds} round{'s' if rounds > 1 else ''} (min-max): " + ", ".join(
        f"{m} {cell(v['min'], 1e3)}-{cell(v['max'], 1e3)}" for m, v in spread["step_s"].items()))
    h = summary["hidden_fraction"]
    hs = spread["hidden_fraction"]
    out.append("hidden fraction of recomputation time H = (session - prefire) / (session - none): overall "
               + cell(h["overall"], 1, 2) + f" (rounds {cell(hs['min'], 1, 2)}-{cell(hs['max'], 1, 2)})"
               + ", per rank " + ", ".join(cell(x, 1, 2) for x in h["per_rank"]))
    if "hidden_fraction_placed" in summary:
        hp, hps = summary["hidden_fraction_placed"], spread["hidden_fraction_placed"]
        out.append("placed (the simulator's placement, not the rules): H = (session - placed) / (session - none): "
                   f"overall {cell(hp['overall'], 1, 2)} (rounds {cell(hps['min'], 1, 2)}-{cell(hps['max'], 1, 2)})"
                   ", per rank " + ", ".join(cell(x, 1, 2) for x in hp["per_rank"]))
    if any(x is not None and x < 0 for x in [h["overall"], hs["min"], *h["per_rank"]]):
        out.append("H below 0: prefire mode's step came out slower than session mode's, so its prefires hid nothing "
                   "there and what they cost shows (their launch, or recomputation that overran a wait), or the "
                   "difference is timing noise (compare the rounds' spread)")
    out.append("hideable: recomputation the rank's waits could hold (micro-batches forwarded, backward not begun); "
               "the most H those allow (session steps less hideable): " + cell(summary["hidden_fraction_bound"], 1, 2))
    if summary["noisy"]:
        out.append("NOISY RUN: H came out above the most the waits allow, which only timing noise can do; the step "
                   "times are not to be trusted to this precision (more --rounds, more --steps, a quieter machine)")
    return "\n".join(out)


def _budget_sweep(modes: Dict[str, Any]) -> List[str]:
    """Per rank, for session and prefire mode (no budget) and each budget
    run: the budget, the most the rank held, and its recomputations per
    block per micro-batch (mean)."""
    runs = [m for m in modes if m in ("session", "prefire") or m.startswith("budget ")]
    if not any(m.startswith("budget ") for m in runs):
        return []
    lines = ["budget sweep, per rank: budget -> held MiB (recomputations per block per micro-batch); a budget is its "
             "share of what the rank held with sessions alone; it cannot go below the floor, one pass's recomputation"]
    width = max(len(m) for m in runs)
    for m in runs:
        cells = []
        for r in modes[m]["ranks"]:
            per_block = list(r["recomputations_per_block_per_micro_batch"].values())
            budget = r["budget_bytes"]
            below = budget is not None and r["floor_bytes"] is not None and budget < r["floor_bytes"]
            cells.append(f"rank {r['rank']} {cell(budget, 1 / MiB)} -> {cell(r['peak_held_bytes'], 1 / MiB)} "
                         f"({sum(per_block) / len(per_block):.2f}){' below floor' if below else ''}")
        lines.append(f"  {m.ljust(width)}  " + "; ".join(cells))
    floors = ", ".join(f"rank {r['rank']} {cell(r['floor_bytes'], 1 / MiB)}" for r in modes[runs[-1]]["ranks"])
    lines.append(f"  floor (MiB): {floors}")
    return lines


def shown_step(summary: Dict[str, Any], mode: str) -> List[Dict[str, Any]]:
    """Per rank, the measured step (of the last round) whose time, the
    slowest rank's, is nearest the mode's step time in the table (a median):
    ``{"begin", "step_s", "events"}``. The last step where the ranks kept no
    per-step timelines."""
    ranks = summary["timelines"][mode]
    if not all(r.get("steps") for r in ranks):
        return [{"begin": r["begin"], "step_s": None, "events": r["events"]} for r in ranks]
    times = [max(step) for step in zip(*([s["step_s"] for s in r["steps"]] for r in ranks))]
    target = summary["modes"][mode]["step_s"]
    index = min(range(len(times)), key=lambda i: abs(times[i] - target))
    return [r["steps"][index] for r in ranks]


def plot(summary: Dict[str, Any], path: str) -> None:
    """One panel per mode, one row per rank: the stage actions, receive
    waits and recomputations of the measured step nearest the table's
    (median) step time, against time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    timelines = summary["timelines"]
    fig, axes = plt.subplots(len(timelines), 1, figsize=(12, 1.0 + 1.1 * len(timelines) * len(
        next(iter(timelines.values())))), sharex=True, squeeze=False)
    for ax, mode in zip(axes[:, 0], timelines):
        ranks = shown_step(summary, mode)
        origin = min(r["begin"] for r in ranks)
        for row, r in enumerate(ranks):
            y = len(ranks) - 1 - row
            for kind, stage, index, begin, end in r["events"]:
                colour = _COLOURS[kind][0]
                if kind.startswith("recompute"):  # a thin bar under the action it ran in
                    box = (y - 0.42, 0.2)
                else:
                    box = (y - 0.2, 0.6)
                ax.broken_barh([((begin - origin) * 1e3, (end - begin) * 1e3)], box, facecolors=colour,
                               edgecolors="white" if not kind.startswith("recompute") else colour, linewidth=0.3)
                if kind in ("F", "B", "W", "BW") and (end - begin) * 1e3 > 0:
                    ax.text((begin + end - 2 * origin) / 2 * 1e3, y + 0.1, f"{stage}.{index}", ha="center",
                            va="center", fontsize=5, color="white")
        ax.set_yticks(range(len(ranks)), [f"rank {len(ranks) - 1 - i}" for i in range(len(ranks))])
        median = summary["modes"][mode]["step_s"] * 1e3
        shown = max((r["step_s"] for r in ranks if r["step_s"] is not None), default=None)
        ax.set_title(f"{mode}: step {median:.0f} ms (median)" + (f", this one {shown * 1e3:.0f} ms" if shown else ""),
                     loc="left", fontsize=9)
        ax.set_ylim(-0.6, len(ranks) - 0.4)
    axes[-1, 0].set_xlabel("ms since the step began (stage.micro-batch on each action)")
    fig.legend(handles=[Patch(color=c, label=label) for c, label in _COLOURS.values()], loc="lower center",
               ncol=4, fontsize=8, frameon=False)
    cfg = summary["config"]
    fig.suptitle(f"pipeline_bench: {cfg['schedule']}, {cfg['world']} ranks, {cfg['model']['blocks']} blocks, "
                 f"{cfg['model']['micro_batches']} micro-batches (per mode, the measured step nearest its median)",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.97))
    fig.savefig(path, dpi=130)
    plt.close(fig)
