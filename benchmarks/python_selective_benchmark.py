"""What a selective checkpoint costs next to keeping a block and
checkpointing it whole, in one process: one GPT block of the pipeline
program (dim 256, a micro-batch of 2 x 128 tokens), forward and backward,
kept / prefire.checkpoint / prefire.checkpoint with torch's SAC
(prefire.MATMUL_AND_ATTENTION kept), in interleaved rounds; the medians
give the ratios, all measured in this one run. Also what a plan is told it
costs (the measuring probe, Note [Measuring a selective checkpoint] in
python/prefire/_selective.py), to set beside them.

    PYTHONPATH=build/python:apps ~/.cache/prefire/venv/bin/python benchmarks/python_selective_benchmark.py
"""

import argparse
import statistics
import time

import torch

import prefire
from prefire import _selective
from pipeline_bench.model import Block, ModelConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=30)
    a = p.parse_args()
    torch.set_num_threads(1)
    cfg = ModelConfig()
    block = Block(cfg, 0)
    x0 = torch.randn(2, cfg.seq, cfg.dim)
    policy = _selective.policy(True)
    context = _selective.context_fn(policy)
    variants = {"kept": lambda x: block(x), "checkpointed": lambda x: prefire.checkpoint(block, x),
                "selective": lambda x: prefire.checkpoint(block, x, context_fn=context)}
    times = {name: ([], []) for name in variants}
    for r in range(a.rounds + 5):
        for name, run in variants.items():
            x = x0.clone().requires_grad_(True)
            begin = time.perf_counter()
            y = run(x)
            middle = time.perf_counter()
            y.sum().backward()
            end = time.perf_counter()
            if r >= 5:  # warm-up rounds left out
                times[name][0].append(middle - begin)
                times[name][1].append(end - middle)
    total = {name: statistics.median(f) + statistics.median(b) for name, (f, b) in times.items()}
    for name, (f, b) in times.items():
        print(f"{name:13s} forward {statistics.median(f) * 1e3:6.2f} ms  backward {statistics.median(b) * 1e3:6.2f} ms"
              f"  both {total[name] * 1e3:6.2f} ms")
    print(f"over kept: checkpointed +{(total['checkpointed'] - total['kept']) * 1e3:.2f} ms, selective "
          f"+{(total['selective'] - total['kept']) * 1e3:.2f} ms (selective / checkpointed extra: "
          f"{(total['selective'] - total['kept']) / (total['checkpointed'] - total['kept']):.2f})")
    costs = _selective.mode_costs(policy)
    planned = []
    for _ in range(a.rounds):
        x = x0.clone().requires_grad_(True)
        with _selective.probing(policy) as probe:
            begin = time.perf_counter()
            prefire.checkpoint(block, x)
            seconds = time.perf_counter() - begin
        planned.append(_selective.selective_cost(probe, costs, 0, seconds))
    selective, whole = (statistics.median(c[i] for c in planned) for i in (1, 2))
    print(f"the plan is told: checkpointed {whole * 1e3:.2f} ms, selective {selective * 1e3:.2f} ms (ratio "
          f"{selective / whole:.2f}); mode costs per op: probe {costs.probe * 1e6:.1f} us, SAC {costs.sac * 1e6:.1f} us")


if __name__ == "__main__":
    main()
