"""prefire and torch.compile (inductor), side by side in one process.

A stack of GPT blocks (tests/python/test_checkpoint.py's Block, no dropout)
trained one step at a time on CPU, one intra-op thread, in eight variants
(``--variant NAME``, repeatable, runs only those and the ratios' base):

  eager, torch ckpt        torch.utils.checkpoint per block, no compile
  compiled, no ckpt        torch.compile(block) per block, nothing checkpointed
  compiled torch ckpt      torch.compile(torch's checkpoint_wrapper(block))
  compiled prefire wrapper torch.compile(prefire.checkpoint_wrapper(block)):
                           inside a compiled region prefire.checkpoint is
                           torch's (Note [prefire.checkpoint inside torch.compile])
  prefire around compiled  prefire.checkpoint_wrapper(torch.compile(block)):
                           prefire's runtime around compiled math (sessions apply);
                           the recomputation runs the whole compiled forward
  prefire around compiled (prefire.compile)
                           prefire.checkpoint_wrapper(prefire.compile(block)),
                           forward outside prefire.collect(): nothing can
                           schedule these checkpoints, so each runs as torch's
                           compiled checkpoint (Note [A block no collector sees
                           runs torch's compiled checkpoint])
  prefire around compiled (prefire.compile), collected
                           the same with forward inside prefire.collect():
                           prefire's runtime, recomputing with the forward
                           graph's program (Note [A compiled block's
                           recomputation program]), as a pipeline runs it
  prefire around compiled (prefire.compile, budget 0.5), collected
                           the same with activation_memory_budget=0.5: the
                           partitioner saves less, the compiled backward
                           recomputes the rest inside itself

For each: the step time (median of interleaved rounds), the step peak (the
most the CPU allocator held during a step above what it held when the step
began: prefire.AllocatorPeak, every allocation, inductor's buffers
included; the parameters' gradients exist from the first step on), and the
bytes forward keeps for backward, counted by a saved-tensors hook around the
forward (every storage a saved tensor refers to, once, parameters
excepted). Ratios are against "compiled torch ckpt".

    PYTHONPATH=build/python ~/.cache/prefire/venv/bin/python benchmarks/python_compile_benchmark.py
"""

import argparse
import contextlib
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as torch_wrapper

import prefire

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "python"))
from test_checkpoint import Block  # noqa: E402


def build(blocks, dim, heads, wrap, seed=0, dropout=0.0):
    torch.manual_seed(seed)
    plain = [Block(dim=dim, heads=heads, dropout=dropout) for _ in range(blocks)]
    return torch.nn.ModuleList(plain), [wrap(b) for b in plain]


BASE = "compiled torch ckpt"
VARIANTS = {
    "eager, torch ckpt": lambda b: (lambda x: torch_checkpoint.checkpoint(b, x, use_reentrant=False)),
    "compiled, no ckpt": lambda b: torch.compile(b),
    "compiled torch ckpt": lambda b: torch.compile(torch_wrapper(b)),
    "compiled prefire wrapper": lambda b: torch.compile(prefire.checkpoint_wrapper(b)),
    "prefire around compiled": lambda b: prefire.checkpoint_wrapper(torch.compile(b)),
    "prefire around compiled (prefire.compile)": lambda b: prefire.checkpoint_wrapper(prefire.compile(b)),
    "prefire around compiled (prefire.compile), collected": lambda b: prefire.checkpoint_wrapper(prefire.compile(b)),
    "prefire around compiled (prefire.compile, budget 0.5), collected": lambda b: prefire.checkpoint_wrapper(
        prefire.compile(b, activation_memory_budget=0.5)),
}


def forward(layers, x, collected):
    """The stack's output; its checkpoints collected (and dropped) where ``collected``."""
    with prefire.collect() if collected else contextlib.nullcontext():
        h = x
        for layer in layers:
            h = layer(h)
    return h


class KeptBytes:
    """Storages of the tensors autograd saves while it is active, parameters excepted."""

    def __init__(self, params):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.storages = {}

    def pack(self, t):
        s = t.untyped_storage()
        if s.data_ptr() not in self.params:
            self.storages[s.data_ptr()] = s.nbytes()
        return t

    def total(self):
        return sum(self.storages.values())


def make_step(params, layers, x, collected=False):
    def step():
        torch.autograd.grad(forward(layers, x, collected).square().mean(), [x, *params])

    return step


def step_peak(step):
    with prefire.AllocatorPeak() as peak:
        step()
    return peak.bytes


def kept_bytes(params, layers, x, collected=False):
    meter = KeptBytes(params)
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda t: t):
        h = forward(layers, x, collected)
    torch.autograd.grad(h.square().mean(), [x, *params])
    return meter.total()


def add_model_arguments(parser):
    """The stack's size and the rounds: this benchmark's and python_compiled_split.py's."""
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--steps", type=int, default=3, help="steps per round and variant")
    parser.add_argument("--variant", action="append", choices=list(VARIANTS),
                        help=f"run this variant (repeatable; default all; {BASE!r}, the ratios' base, always runs)")
    args = parser.parse_args()
    variants = {name: wrap for name, wrap in VARIANTS.items()
                if args.variant is None or name in args.variant or name == BASE}
    torch.set_num_threads(1)
    prefire.count_cpu_allocations()  # before any model
    warnings.filterwarnings("ignore", message="prefire.checkpoint inside torch.compile")

    torch.manual_seed(1)
    x = torch.randn(args.batch, args.seq, args.dim, requires_grad=True)
    steps, kept, peak, compile_s = {}, {}, {}, {}
    for name, wrap in variants.items():
        params, layers = build(args.blocks, args.dim, args.heads, wrap)
        params = list(params.parameters())
        collected = name.endswith(", collected")
        start = time.perf_counter()
        make_step(params, layers, x, collected)()  # compiles
        compile_s[name] = time.perf_counter() - start
        kept[name] = kept_bytes(params, layers, x, collected)
        steps[name] = make_step(params, layers, x, collected)
        peak[name] = step_peak(steps[name])
    times = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)

    base = BASE
    ms = {name: statistics.median(t) for name, t in times.items()}
    print(f"{args.blocks} GPT blocks, dim {args.dim}, batch {args.batch} x seq {args.seq}, CPU, 1 thread, "
          f"inductor; {args.rounds} rounds of {args.steps} steps")
    print(f"{'variant':54s} {'step ms med [min-max]':>24s} {'/ ' + base:>22s} {'step peak MiB':>14s}"
          f" {'/ ' + base:>22s} {'kept MiB':>9s} {'first step s':>13s}")
    for name in variants:
        spread = f"{ms[name]:.1f} [{min(times[name]):.1f}-{max(times[name]):.1f}]"
        print(f"{name:54s} {spread:>24s} {ms[name] / ms[base]:22.3f} {peak[name] / 2**20:14.2f}"
              f" {peak[name] / peak[base]:22.3f} {kept[name] / 2**20:9.2f} {compile_s[name]:13.1f}")


if __name__ == "__main__":
    main()
