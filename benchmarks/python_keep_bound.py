"""The most (block, micro-batch) pairs a pipeline rank can keep within a
memory budget, by any plan, even one that chooses per micro-batch: a bound
on what a keep/checkpoint plan can save, on the planner's count (Note [What a
plan holds] in src/memory/plan.cpp): after each of the rank's actions (torch's
order), every pair alive there (between its F and its W) holds `kept` MiB if
kept, `input` MiB if checkpointed; during each B, W or full backward, what
was held before and after it, and that (stage, micro-batch)'s checkpointed
blocks recomputed together. Tries every choice (2^(blocks x stages x
micro-batches)): small pipelines only.

    PYTHONPATH=build/python ~/.cache/prefire/venv/bin/python benchmarks/python_keep_bound.py \
        --schedule zbv --kept 3.881 --input 0.126 --budgets 15.53,20.04
"""

import argparse

from prefire.pipeline.simulate import rank_orders


def peak(order, keep, blocks, kept, inputs):
    """The most the rank holds over its actions with the (stage, micro-batch, block) units ``keep`` kept."""
    def held(live):
        return sum(kept if (s, m, b) in keep else inputs for s, m in live for b in range(blocks))

    live, most = set(), 0.0
    for kind, s, m in order:
        before = held(live)
        if kind == "F":
            live.add((s, m))
        elif kind in ("W", "BW"):
            live.discard((s, m))
        after = held(live)
        most = max(most, after)
        if kind != "F":  # a pass: this micro-batch's checkpointed blocks of the stage
            most = max(most, max(before, after) + kept * sum((s, m, b) not in keep for b in range(blocks)))
    return most


def most_kept(order, blocks, micro_batches, kept, inputs, budget):
    stages = sorted({s for _, s, _ in order})
    units = [(s, m, b) for s in stages for m in range(micro_batches) for b in range(blocks)]
    best = (0, None, [])
    for mask in range(1 << len(units)):
        keep = {u for i, u in enumerate(units) if mask >> i & 1}
        if len(keep) <= best[0] and best[1] is not None:
            continue
        most = peak(order, keep, blocks, kept, inputs)
        if most <= budget:
            best = (len(keep), most, sorted(keep))
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
