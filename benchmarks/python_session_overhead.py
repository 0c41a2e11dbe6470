"""What a session costs one pipeline stage beyond its recomputation, pass by pass.

One process, one intra-op thread: a stage of the pipeline program's model
(two of its GPT blocks, one micro-batch of its default size) runs forward
(F), the input-gradient pass (B: ``torch.autograd.grad`` to the stage's
input, keeping the graph) and the weight-gradient pass (W: the gradients of
the blocks' parameters), unchecked ("none") and checkpointed in a session
("session": every block ``prefire.checkpoint``, its handle attached, B
retaining what it unpacks, the session cleared after W), interleaved round
by round. The recomputation's own time is what the blocks' forwards take
inside backward (the program's block observer); what is left of session's
pass beyond none's is the overhead: hooks, the checkpoint's Python and C++
path, the early stop, and the allocator's work for what a checkpoint frees
and makes again. W here differentiates through the whole stage (not
``stage_backward_weight``'s weight groups), the same work in both modes.

    PYTHONPATH=build/python:apps ~/.cache/prefire/venv/bin/python benchmarks/python_session_overhead.py
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Dict, List

import torch

import prefire
from pipeline_bench.model import Block, ModelConfig

PASSES = ("F", "B", "W")
WARMUP = 10  # rounds left out of the medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60, help=f"interleaved rounds (the first {WARMUP} are warm-up)")
    args = parser.parse_args()
    if args.rounds <= WARMUP:
        parser.error(f"--rounds must be more than {WARMUP} (the first {WARMUP} are warm-up)")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = ModelConfig()
    blocks = [Block(cfg, i) for i in range(2)]
    params = [p for b in blocks for p in b.parameters()]
    recomputed: List[float] = []
    for b in blocks:
        b.observer = lambda index, begin, end: recomputed.append(end - begin)
    x0 = torch.randn(cfg.batch // cfg.micro_batches, cfg.seq, cfg.dim, requires_grad=True)

    def step(mode: str, sid: int) -> Dict[str, float]:
        def scope(**options):  # none's passes run outside any session
            return contextlib.nullcontext() if mode == "none" else prefire.session(sid, **options)

        out: Dict[str, float] = {}
        begin = time.perf_counter()
        with prefire.collect() as handles:
            x = x0
            for b in blocks:
                x = b(x) if mode == "none" else prefire.checkpoint(b, x)
        for h in handles:
            prefire.attach(h, sid)
        out["F"] = time.perf_counter() - begin
        grad = torch.ones_like(x)
        recomputed.clear()
        begin = time.perf_counter()
        with scope(retain_on_unpack=True):
            torch.autograd.grad(x, [x0], grad, retain_graph=True)
        out["B"], out["B recompute"] = time.perf_counter() - begin, sum(recomputed)
        recomputed.clear()
        begin = time.perf_counter()
        with scope():
            torch.autograd.grad(x, params, grad)
        if mode != "none":
            prefire.clear_session(sid)
        out["W"], out["W recompute"] = time.perf_counter() - begin, sum(recomputed)
        return out

    runs: Dict[str, List[Dict[str, float]]] = {"none": [], "session": []}
    sid = 0
    for _ in range(args.rounds):
        for mode in runs:
            sid += 1
            runs[mode].append(step(mode, sid))

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[mode][WARMUP:])

    print(f"torch {torch.__version__}, one intra-op thread, 2 blocks of the pipeline program's model, micro-batch "
          f"{tuple(x0.shape)}; medians of {args.rounds - WARMUP} interleaved rounds")
    print(f"{'pass':5} {'none ms':>9} {'session ms':>11} {'recompute ms':>13} {'overhead ms':>12}")
    total_over = total_recompute = 0.0
    for p in PASSES:
        recompute = med("session", f"{p} recompute") if p != "F" else 0.0
        over = med("session", p) - med("none", p) - recompute
        total_over += over
        total_recompute += recompute
        print(f"{p:5} {med('none', p) * 1e3:9.3f} {med('session', p) * 1e3:11.3f} {recompute * 1e3:13.3f} "
              f"{over * 1e3:12.3f}")
    print(f"overhead beyond recomputation / recomputation: {total_over * 1e3:.3f} ms / {total_recompute * 1e3:.3f} ms "
          f"= {total_over / total_recompute:.3f}")


if __name__ == "__main__":
    main()
