"""The most (block, micro-batch) pairs a pipeline rank can keep within a
memory budget, by any plan, even one that chooses per micro-batch: a bound
on what a keep/checkpoint plan can save, on the planner's own count (Note
[What a plan holds] in src/plan/plan_bytes.cpp, `plan_bytes` on one item per
(stage, micro-batch, block) as `enable(memory_budget=...)` plans them: a
kept one holds `kept` MiB, a checkpointed one `input` MiB and its pass at
its micro-batch's B and W). Tries every choice (2^(blocks x stages x
micro-batches)): small pipelines only.

    PYTHONPATH=build/python:apps ~/.cache/prefire/venv/bin/python benchmarks/python_keep_bound.py \
        --schedule zbv --kept 3.881 --input 0.126 --budgets 15.53,20.04
"""

import argparse

from prefire import _C
from prefire.pipelining.actions import lifetime
from pipeline_sim.replay import rank_orders

MiB = 1 << 20


def most_kept(order, blocks, micro_batches, kept, inputs, budget):
    stages = sorted({s for _, s, _ in order})
    units = [(s, m, b) for s in stages for m in range(micro_batches) for b in range(blocks)]
    items = []
    for s, m, _ in units:
        life = lifetime(order, s, m)
        items.append(_C.BlockCost(saved_bytes=int(kept * MiB), input_bytes=int(inputs * MiB), recompute_seconds=1.0,
                                  in_flight=1, group=s * micro_batches + m, alive=life.alive, done=life.done,
                                  passes=life.passes))
    best = (0, None, [])
    for mask in range(1 << len(units)):
        keep = [bool(mask >> i & 1) for i in range(len(units))]
        if sum(keep) <= best[0] and best[1] is not None:
            continue
        most = _C.plan_bytes(items, [not k for k in keep], 0, _C.Release.AT_STEP_END) / MiB
        if most <= budget:
            best = (sum(keep), most, [u for u, k in zip(units, keep) if k])
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
