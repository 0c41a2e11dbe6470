"""The most (block, micro-batch) pairs a pipeline rank can keep within a
memory budget, by any plan, even one that chooses per micro-batch: a bound
on what a keep/checkpoint plan can save, on the planner's count (Note [What a
plan holds] in src/memory/plan.cpp): after each of the rank's actions (torch's
order), every pair alive there (between its F and its W) holds `kept` MiB if
kept, `input` MiB if checkpointed, plus one pass, the checkpointed blocks of
one (stage, micro-batch) recomputed together, the largest of them. Tries
every choice (2^(blocks x stages x micro-batches)): small pipelines only.

    PYTHONPATH=build/python ~/.cache/prefire/venv/bin/python benchmarks/python_keep_bound.py \
        --schedule zbv --kept 3.881 --input 0.126 --budgets 15.53,20.04
"""

import argparse

from prefire.pipeline.simulate import rank_orders


def most_kept(order, blocks, micro_batches, kept, inputs, budget):
    stages = sorted({s for _, s, _ in order})
    live, now = [], set()
    for kind, s, m in order:
        if kind == "F":
            now.add((s, m))
        elif kind in ("W", "BW"):
            now.discard((s, m))
        live.append(set(now))
    units = [(s, m, b) for s in stages for m in range(micro_batches) for b in range(blocks)]
    best = (0, None, [])
    for mask in range(1 << len(units)):
        keep = {u for i, u in enumerate(units) if mask >> i & 1}
        if len(keep) <= best[0] and best[1] is not None:
            continue
        one_pass = kept * max(sum((s, m, b) not in keep for b in range(blocks)) for s in stages
                              for m in range(micro_batches))
        peak = max(sum(kept if (s, m, b) in keep else inputs for s, m in at for b in range(blocks))
                   for at in live) + one_pass
        if peak <= budget:
            best = (len(keep), peak, sorted(keep))
    return best


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedule", default="zbv")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--blocks", type=int, default=2, help="blocks per stage")
    p.add_argument("--kept", type=float, required=True, help="MiB a kept block holds per micro-batch")
    p.add_argument("--input", type=float, required=True, help="MiB a checkpointed block holds per micro-batch")
    p.add_argument("--budgets", required=True, help="MiB, comma-separated")
    a = p.parse_args()
    for rank, order in enumerate(rank_orders(a.schedule, a.world, a.micro_batches)):
        units = a.blocks * len({s for _, s, _ in order}) * a.micro_batches
        for budget in (float(b) for b in a.budgets.split(",")):
            n, peak, keep = most_kept(order, a.blocks, a.micro_batches, a.kept, a.input, budget)
            print(f"{a.schedule} rank {rank} budget {budget:.2f} MiB: at most {n} of {units} (block, micro-batch) "
                  f"kept" + (f" (holding {peak:.2f}: {keep})" if peak is not None else ""))


if __name__ == "__main__":
    main()
