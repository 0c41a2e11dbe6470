"""The simulator's command line, ``python -m pipeline_sim COMMAND``
(the package's docstring lists the commands)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List, Optional, Tuple, Union

from pipeline_bench.config import stage_rank
from pipeline_bench.report import cell
from pipeline_bench.sweep import plan_letters
from prefire.pipelining.placement import placement_file
from prefire.pipelining.plans import choices_file

from .compare import Joint, compare
from .measured import validate
from .plan_predict import predict_plans
from .plan_search import search
from .predict import predict
from .ratios import H200


def _gb_per_s(text: str) -> Union[float, Tuple[float, float]]:
    """GB/S or GB/S,GB/S (to the tier, back) as bytes per second."""
    parts = [float(p) * 1e9 for p in text.split(",")]
    if len(parts) > 2 or min(parts) < 0:
        raise argparse.ArgumentTypeError(f"a bandwidth is GB/S or GB/S,GB/S (to the tier, back), >= 0: {text!r}")
    return parts[0] if len(parts) == 1 else (parts[0], parts[1])


def _ratios(text: str) -> Tuple[float, float, float]:
    """B,W,R or h200 (Note [Durations at another machine's ratios])."""
    if text == "h200":
        return H200
    parts = [float(p) for p in text.split(",")]
    if len(parts) != 3 or min(parts) <= 0:
        raise argparse.ArgumentTypeError(f"ratios are B/F,W/F,R/(F+B+W), each > 0, or h200: {text!r}")
    return parts[0], parts[1], parts[2]


def _joint_budget(text: str) -> Union[float, str]:
    if text == "bubble+stage":
        return text
    try:
        fraction = float(text)
    except ValueError:
        fraction = -1.0
    if not 0 < fraction <= 1:
        raise argparse.ArgumentTypeError(f"a joint budget is a fraction in (0, 1] or bubble+stage: {text!r}")
    return fraction


def _read(path: str) -> Dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipeline_sim",
                                description="Replays pipeline schedules with durations a 2-rank run of "
                                            "python -m pipeline_bench measured (its --json summary).")
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate", help="each run's modes, measured against their replay")
    v.add_argument("runs", nargs="+", metavar="SUMMARY.json")
    pr = sub.add_parser("predict", help="the runs' schedules on more ranks (micro-batches = 2 x ranks)")
    pr.add_argument("runs", nargs="+", metavar="SUMMARY.json")
    pr.add_argument("--ranks", default="4,8,16")
    pr.add_argument("--json", metavar="PATH", help="write the predictions as JSON")
    pr.add_argument("--plot", metavar="PATH", help="plot step time / torch's and H against ranks")
    pl = sub.add_parser("place", help="where recomputation can run: the filler's rules, a search over placements "
                                      "and the most any placement allows, per schedule and ranks")
    pl.add_argument("runs", nargs="+", metavar="SUMMARY.json")
    pl.add_argument("--ranks", default="2,4,8,16")
    pl.add_argument("--schedules", default="zbv,interleaved-zb,dualpipev,interleaved-1f1b",
                    help="schedules to place, each with the durations of its own run among those given, else of the "
                         "first (scaled as predict's)")
    pl.add_argument("--search-ranks", type=int, default=8, metavar="N",
                    help="search placements up to N ranks (the search takes minutes at 16)")
    pl.add_argument("--max-held", type=int, default=None, metavar="N",
                    help="the search holds at most N checkpoints per rank recomputed before their pass at once")
    pl.add_argument("--json", metavar="PATH",
                    help="write the rows as JSON: a list, one per schedule and rank count (schedule, ranks, h_rules, "
                         "h_search, h_oracle_whole, h_best, h_max, h_oracle, each also over recomputation alone as "
                         "h_..._recompute, floor_s, oracle_s, session_s, none_s, recompute_s, overhead_s, joint_s, "
                         "joint_peak_fraction, ...)")
    pl.add_argument("--ratios", type=_ratios, default=None, metavar="B,W,R|h200",
                    help="durations at another machine's ratios: B/F, W/F and a micro-batch's recomputation over "
                         "F+B+W (h200: 1.23,0.72,0.33; Note [Durations at another machine's ratios])")
    pl.add_argument("--plan-sweep", metavar="SWEEP.json",
                    help="a memory sweep with a plan-offload run (python -m pipeline_bench.sweep --offload "
                         "[--selective]): adds the joint plan's step and peak (Note [The joint plan])")
    pl.add_argument("--joint-budget", type=_joint_budget, default=0.5, metavar="FRACTION|bubble+stage",
                    help="the joint plan's budget on each rank: this share of what keeping everything holds there, "
                         "or what bubble mode holds there plus one stage's activations")
    pl.add_argument("--no-offload", action="store_true", help="the joint plan offered no offloading")
    pl.add_argument("--joint-ranks", type=int, default=16, metavar="N", help="the joint plan up to N ranks")
    pl.add_argument("--bandwidth", type=_gb_per_s, default=0.0, metavar="GB/S[,GB/S]",
                    help="the joint plan's offload tier moving this many GB per second to it and back (0: the "
                         "copies as the sweep's tier measured them)")
    pl.add_argument("--write-placement", metavar="PATH",
                    help="write the placement that ends the step earliest (the rules', the oracle's in whole "
                         "checkpoints or the search's) for the pipeline program's --placement (one schedule, one "
                         "rank count)")
    pl.add_argument("--write-choices", metavar="PATH",
                    help="write the joint plan's choices for the pipeline program's --choices (enable(..., "
                         "choices=); one schedule, one rank count, with --plan-sweep)")
    se = sub.add_parser("search", help="a memory sweep's plans against the fastest per-block plan within each "
                                       "budget (python -m pipeline_bench.sweep --json)")
    se.add_argument("runs", nargs="+", metavar="SWEEP.json")
    se.add_argument("--bandwidth", type=_gb_per_s, default=0.0, metavar="GB/S[,GB/S]",
                    help="plan-offload runs: an assumed offload tier moving this many GB per second to it and back "
                         "(one number: both ways; 0: the copies as the run's tier measured them)")
    pp = sub.add_parser("predict-plans", help="a sweep's plans with and without offloading on more ranks, at "
                                              "fractions of what keeping every block holds (sweep --offload)")
    pp.add_argument("runs", nargs="+", metavar="SWEEP.json")
    pp.add_argument("--ranks", default="4,8,16")
    pp.add_argument("--fractions", default="0.25,0.5,0.75")
    pp.add_argument("--bandwidth", type=_gb_per_s, default=0.0, metavar="GB/S[,GB/S]",
                    help="an assumed offload tier moving this many GB per second to it and back (one number: both "
                         "ways; 0: the copies as the run's tier measured them)")
    pp.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    a = _parser().parse_args(argv)
    summaries = [_read(path) for path in a.runs]
    commands = {"predict-plans": _predict_plans, "search": _search, "place": _place, "validate": _validate,
                "predict": _predict}
    return commands[a.command](summaries, a)


def _search(summaries: List[Dict[str, Any]], a: argparse.Namespace) -> int:
    print(f"{'schedule':14} {'run':9} {'plans':>5} {'best ms':>8} {'prefire ms':>10} {'prefire/best':>12} "
          f"{'measured ms':>11}  best plan (k: kept, c: checkpointed, s: selectively, o: offloaded) / prefire's")

    def letters(plan):  # per micro-batch, split by / where they differ
        return plan_letters([[c.name for c in options] for options in plan])

    for summary in summaries:
        for row in search(summary, a.bandwidth):
            print(f"{summary['config']['schedule']:14} {row['name']:9} {row['plans_tried']:5d} "
                  f"{row['best_s'] * 1e3:8.1f} {row['chosen_s'] * 1e3:10.1f} {row['chosen_over_best']:12.3f} "
                  f"{row['measured_s'] * 1e3:11.1f}  {letters(row['best'])} / {letters(row['chosen'])}")
    return 0


def _validate(summaries: List[Dict[str, Any]], a: argparse.Namespace) -> int:
    print(f"{'schedule':18} {'mode':13} {'step ms':>8} {'replay':>8} {'diff':>6}   "
          f"{'bubble ms (steps min-max)':>26} {'replay':>8} {'diff':>6}")
    for summary in summaries:
        for row in validate(summary):
            waits, sim_wait = row["wait_s"], row["simulated_wait_s"] * 1e3
            bubble = (f"{waits * 1e3:9.1f} ({row['wait_range_s'][0] * 1e3:5.1f}-{row['wait_range_s'][1] * 1e3:5.1f})"
                      f" {sim_wait:8.1f} {row['simulated_wait_s'] / waits - 1:+6.1%}" if waits else
                      f"{'not seen':>26} {sim_wait:8.1f} {'-':>6}")
            print(f"{row['schedule']:18} {row['mode']:13} {row['step_s'] * 1e3:8.1f} "
                  f"{row['simulated_step_s'] * 1e3:8.1f} {row['simulated_step_s'] / row['step_s'] - 1:+6.1%}   "
                  + bubble)
    return 0


def _predict(summaries: List[Dict[str, Any]], a: argparse.Namespace) -> int:
    ranks = [int(r) for r in a.ranks.split(",") if r]
    by_schedule = {s["config"]["schedule"]: s for s in summaries}
    schedules = [s for s in by_schedule if s != "1f1b"]  # 1f1b's own run has no middle stage:
    if "interleaved-1f1b" in by_schedule:                # it is predicted from interleaved-1f1b's
        schedules.append("1f1b")
    predictions = [predict(by_schedule["interleaved-1f1b" if schedule == "1f1b" else schedule], schedule, world)
                   for schedule in schedules for world in ranks]
    print("PREDICTED (simulated from 2-rank measurements; weak scaling, micro-batches = 2 x ranks)")
    print(f"{'schedule':18} {'ranks':>5} {'none/torch':>10} {'session/torch':>13} {'prefire/torch':>12} "
          f"{'bubble frac (session)':>21} {'H':>6} {'H max':>6} {'waits/recomp':>12}")

    for row in predictions:
        ratio = row["ratio_to_torch"]
        print(f"{row['schedule']:18} {row['world']:5d} {ratio['none']:10.3f} {ratio['session']:13.3f} "
              f"{cell(ratio.get('prefire'), digits=3):>12} {row['bubble_fraction']['session']:21.3f} "
              f"{cell(row['hidden_fraction'], digits=2):>6} {cell(row['hidden_fraction_max'], digits=2):>6} "
              f"{cell(row['waits_over_recompute'], digits=2):>12}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(predictions, f, indent=1)
    if a.plot:
        plot(predictions, a.plot)
    return 0


def _predict_plans(summaries: List[Dict[str, Any]], a: argparse.Namespace) -> int:
    rows = [row for summary in summaries for world in (int(r) for r in a.ranks.split(",") if r)
            for row in predict_plans(summary, world, [float(f) for f in a.fractions.split(",") if f],
                                     a.bandwidth)]
    print("PREDICTED (simulated from a 2-rank sweep; weak scaling, micro-batches = 2 x ranks; budgets: a share of what "
          "keeping every block holds, by the planner's count; *: the plan cannot hold it, planned at its least)")
    print(f"{'schedule':10} {'ranks':>5} {'budget':>6} {'none ms':>8} {'recompute ms':>13} {'offload ms':>11} "
          f"{'offload/recompute':>17} {'offloaded':>11} {'tier GB/s (to/back)':>20}")
    for row in rows:
        def ms(kind: str) -> str:
            return f"{row[kind]['step_s'] * 1e3:.1f}{'' if row[kind]['fits'] else '*'}"
        out_bw, back_bw = row["bandwidth"]
        tier = (f"{out_bw / 1e9:.2f}" + ("" if out_bw == back_bw else f"/{back_bw / 1e9:.2f}")
                + f" {'assumed' if row['bandwidth_assumed'] else 'measured'}")
        print(f"{row['schedule']:10} {row['world']:5d} {row['fraction']:6.0%} {row['none_s'] * 1e3:8.1f} "
              f"{ms('recompute'):>13} {ms('offload'):>11} {row['offload_over_recompute']:17.3f} "
              f"{row['offload']['offloaded_items']:5d}/{row['offload']['items']:<5d} {tier:>20}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def _place(summaries: List[Dict[str, Any]], a: argparse.Namespace) -> int:
    """Each schedule from its own run where one is given, else from the first."""
    by_schedule = {s["config"]["schedule"]: s for s in summaries}
    sweep = _read(a.plan_sweep) if a.plan_sweep else None
    print("PREDICTED (simulated from 2-rank measurements; weak scaling, micro-batches = 2 x ranks; median durations"
          + (f"; at ratios B/F, W/F, R/(F+B+W) = {a.ratios}" if a.ratios else "") + ")")
    print(f"{'schedule':16} {'ranks':>5} {'H rules':>7} {'whole':>6} {'search':>6} {'oracle':>6} {'max':>5} "
          f"{'| rules':>7} {'oracle':>6} {'max':>5} {'overhead':>8} {'held':>9} {'best/session':>12} "
          f"{'joint/none':>10} {'peak':>5}")
    rows = []
    schedules, worlds = a.schedules.split(","), [int(r) for r in a.ranks.split(",") if r]
    for option, given in (("--write-placement", a.write_placement), ("--write-choices", a.write_choices)):
        if given and (len(schedules) != 1 or len(worlds) != 1):
            print(f"{option}: name one schedule (--schedules) and one rank count (--ranks)", file=sys.stderr)
            return 2
    if a.write_choices and sweep is None:
        print("--write-choices: the joint plan needs --plan-sweep SWEEP.json", file=sys.stderr)
        return 2
    for schedule in schedules:
        for world in worlds:
            joint = None
            if sweep is not None and world <= a.joint_ranks:
                joint = Joint(sweep, a.joint_budget, a.bandwidth, offload=not a.no_offload)
            row = compare(by_schedule.get(schedule, summaries[0]), schedule, world, a.max_held,
                          searched=world <= a.search_ranks, ratios=a.ratios, joint=joint)
            rows.append(row)
            best = row["best_s"]
            # H is None where the replay's session step is no longer than none's (the measured recomputation
            # too short against the run's noise): nothing to hide, printed as "-"
            h = [cell(row[f"h_{k}"], digits=2) for k in ("rules", "oracle_whole", "search", "oracle", "max",
                                                        "rules_recompute", "oracle_recompute", "max_recompute")]
            overhead = row["overhead_s"] / row["recompute_s"] if row["recompute_s"] > 0 else None
            held = (f"{row['rules_held']}/{row['oracle_whole_held']}/"
                    f"{row['search_held'] if row['search_held'] is not None else '-'}")
            joint_cells = (f"{row['joint_s'] / row['none_s']:10.3f} {row['joint_peak_fraction']:5.2f}"
                           if row["joint_s"] is not None else f"{'-':>10} {'-':>5}")
            print(f"{schedule:16} {world:5d} {h[0]:>7} {h[1]:>6} {h[2]:>6} {h[3]:>6} {h[4]:>5} {'| ' + h[5]:>7} "
                  f"{h[6]:>6} {h[7]:>5} {cell(overhead, digits=2):>8} {held:>9} {best / row['session_s']:12.3f} "
                  + joint_cells, flush=True)
    print("H: (session - X) / (session - none); after |: over the step's recomputation alone; overhead: session "
          "mode's cost beyond its recomputation, over its recomputation; whole: the oracle's fill in whole "
          "checkpoints; held: checkpoints held ahead, rules/whole/search; best/session: the best placement's step;"
          " joint: the joint plan's step over none's and its peak over none's")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if not k.endswith("placement")} for r in rows], f, indent=1)
    if a.write_placement:
        with open(a.write_placement, "w") as f:
            row = rows[0]
            placement = row["best_placement"]  # the placement that ends the step earliest
            json.dump(placement_file(placement, row["schedule"], row["ranks"], row["micro_batches"],
                                     stage_rank(row["schedule"], row["ranks"])), f)
    if a.write_choices:
        with open(a.write_choices, "w") as f:
            row = rows[0]
            json.dump(choices_file(row["joint"]["rank_choices"], row["schedule"], row["ranks"], row["micro_batches"]),
                      f)
    return 0


def plot(predictions: List[Dict[str, Any]], path: str) -> None:
    """Predicted step time over torch's checkpoint (session, prefire) and H
    against ranks, one line per schedule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for schedule in dict.fromkeys(r["schedule"] for r in predictions):
        rows = [r for r in predictions if r["schedule"] == schedule]
        worlds = [r["world"] for r in rows]
        line, = left.plot(worlds, [r["ratio_to_torch"]["session"] for r in rows], marker="o", label=schedule)
        if all("prefire" in r["ratio_to_torch"] for r in rows):
            left.plot(worlds, [r["ratio_to_torch"]["prefire"] for r in rows], marker="x", linestyle="--",
                      color=line.get_color())
        if all(r["hidden_fraction"] is not None for r in rows):
            right.plot(worlds, [r["hidden_fraction"] for r in rows], marker="o", color=line.get_color(),
                       label=schedule)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks (micro-batches = 2 x ranks)")
        ax.grid(alpha=0.3)
    left.set_ylabel("step / torch's checkpoint")
    left.set_title("PREDICTED: session (solid), prefire (dashed)", fontsize=9)
    right.set_ylabel("H = (session - prefire) / (session - none)")
    right.set_title("PREDICTED: recomputation hidden in bubbles", fontsize=9)
    left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
