"""prefire.checkpoint side by side with torch.utils.checkpoint, in one process.

Per-call overhead on a tiny block (4x16 linear + gelu + sin): forward and
backward checkpointed, minus the same unchecked; and the step time of a split
backward (torch.distributed.pipelining's stage_backward_input, then
stage_backward_weight) over GPT blocks with dropout: unchecked, torch's
checkpoint, prefire with a session. Every variant runs in interleaved rounds;
the medians of the rounds give the ratios, all measured in this one run.

    PYTHONPATH=build/python ~/.cache/prefire/venv/bin/python benchmarks/python_checkpoint_benchmark.py
"""

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

import prefire

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "python"))
from test_checkpoint import model  # noqa: E402  (the GPT block of the tests)


def per_call_us(step, iterations):
    start = time.perf_counter()
    for _ in range(iterations):
        step()
    return (time.perf_counter() - start) / iterations * 1e6


def rounds(variants, iterations, repeats):
    """Median microseconds per call of each variant, over interleaved rounds."""
    times = {name: [] for name in variants}
    for step in variants.values():  # warm-up
        per_call_us(step, max(1, iterations // 10))
    for _ in range(repeats):
        for name, step in variants.items():
            times[name].append(per_call_us(step, iterations))
    return {name: statistics.median(t) for name, t in times.items()}


def tiny_block_variants():
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(4, 16, requires_grad=True)

    def block(a):
        return torch.nn.functional.gelu(torch.nn.functional.linear(a, w)).sin()

    def step(forward):
        def run():
            torch.autograd.grad(forward(x).sum(), [x, w])

        return run

    return {
        "unchecked": step(block),
        "torch.utils.checkpoint": step(lambda a: torch_checkpoint.checkpoint(block, a, use_reentrant=False)),
        "prefire.checkpoint": step(lambda a: prefire.checkpoint(block, a)),
    }


def split_backward_variants():
    blocks = model(blocks=4)
    params = list(blocks.parameters())
    x = torch.randn(4, 64, 32, requires_grad=True)
    gy = torch.randn(4, 64, 32)

    def step(wrap, session=None):
        def run():
            h = x
            handles = []
            for b in blocks:
                with prefire.collect() as new:
                    h = wrap(b, h)
                handles += new
            if session is not None:
                for handle in handles:
                    prefire.attach(handle, session)
            x.grad = None
            with prefire.session(session, retain_on_unpack=True) if session is not None else contextlib.nullcontext():
                _, groups = stage_backward_input([h], [gy], [x], iter(params))
            with prefire.session(session) if session is not None else contextlib.nullcontext():
                stage_backward_weight(iter(params), groups)
            if session is not None:
                prefire.clear_session(session)
            for p in params:
                p.grad = None

        return run

    return {
        "unchecked": step(lambda b, h: b(h)),
        "torch.utils.checkpoint": step(lambda b, h: torch_checkpoint.checkpoint(b, h, use_reentrant=False)),
        "prefire session": step(lambda b, h: prefire.checkpoint(b, h), session=1),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=2000, help="calls per round, tiny block")
    parser.add_argument("--steps", type=int, default=20, help="steps per round, split backward")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, one intra-op thread, medians of {args.repeats} interleaved rounds\n")

    t = rounds(tiny_block_variants(), args.iterations, args.repeats)
    for name, us in t.items():
        print(f"  tiny block, forward+backward, {name:24s} {us:9.1f} us")
    ours = t["prefire.checkpoint"] - t["unchecked"]
    theirs = t["torch.utils.checkpoint"] - t["unchecked"]
    print(f"  per-call overhead: prefire / torch (target <= 0.5)  {ours:.1f} us / {theirs:.1f} us = {ours / theirs:.3f}\n")

    s = rounds(split_backward_variants(), args.steps, args.repeats)
    for name, us in s.items():
        print(f"  split backward step (4 GPT blocks), {name:24s} {us / 1e3:9.2f} ms")
    print(f"  step time: prefire session / torch checkpoint          "
          f"{s['prefire session'] / 1e3:.2f} ms / {s['torch.utils.checkpoint'] / 1e3:.2f} ms = "
          f"{s['prefire session'] / s['torch.utils.checkpoint']:.3f}")


if __name__ == "__main__":
    main()
