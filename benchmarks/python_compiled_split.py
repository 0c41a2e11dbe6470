"""Compiled, checkpointed blocks under a pipeline's B/W split: what torch does, and what prefire does.

One process, one intra-op thread, CPU inductor: a stack of GPT blocks
(python_compile_benchmark.py's, no dropout) runs forward, then torch's own
split backward as its pipeline schedules run it:
``torch.distributed.pipelining._backward.stage_backward_input`` (B: the
stage input's gradient, keeping the graph) and ``stage_backward_weight`` (W:
the parameters' gradients from the intermediates B saw). The variants are
python_compile_benchmark.py's, plus eager without a checkpoint and eager
prefire in a session; every prefire variant runs its blocks' handles in one
session (B retaining what it unpacks, cleared after W), as the pipeline
integration does.

Per variant: the step (median of interleaved rounds) and its peak (the CPU
allocator, every allocation), what is still held after B (the allocator's
bytes above the step's start: what W will use), and per block and
micro-batch how often its forward is recomputed (prefire's recompute
observer; torch's checkpoint: the block's forward pre-hook, eager only) and
how often its compiled backward runs (a pre-hook on the compiled node the
block's output hangs from; inside that backward torch's compiled
checkpoint recomputes). Ratios are against "compiled torch ckpt";
gradients are compared with its, bit for bit where the same program runs
(with dropout, eager and compiled programs draw different masks).

``--dropout P`` gives the blocks dropout: inductor then donates the saved
mask to the compiled backward, and torch refuses B's ``retain_graph`` once
that backward was first compiled by a plain ``backward()`` (set
``torch._functorch.config.donated_buffer = False``; ``--no-donated-buffer``).

    PYTHONPATH=build/python ~/.cache/prefire/venv/bin/python benchmarks/python_compiled_split.py
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings
from typing import Dict, List, Optional

import torch
from python_compile_benchmark import VARIANTS as COMPILE_VARIANTS
from python_compile_benchmark import add_model_arguments, build
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

import prefire

#: name -> (wrap a block, runs in a prefire session)
VARIANTS = {
    "eager, no ckpt": (lambda b: b, False),
    "eager prefire session": (prefire.checkpoint_wrapper, True),
    # every step here collects its forward, so this one is "prefire around compiled (prefire.compile)" again
    **{name: (wrap, "prefire" in name) for name, wrap in COMPILE_VARIANTS.items()
       if name != "prefire around compiled (prefire.compile), collected"},
}
BASE = "compiled torch ckpt"
RECOMPUTED: List[tuple] = []  # prefire's recompute observer's events


class Stage:
    """One variant's blocks, stepped as a pipeline stage with a split backward."""

    def __init__(self, name: str, args: argparse.Namespace, session: int) -> None:
        wrap, self.in_session = VARIANTS[name]
        self.compiled = "compiled" in name
        self.plain, self.layers = build(args.blocks, args.dim, args.heads, wrap, dropout=args.dropout)
        self.params = list(self.plain.parameters())
        self.session = session
        self.forwards = [0] * args.blocks  # eager blocks' forward calls, recomputations included
        for i, block in enumerate(self.plain):  # not on compiled blocks: a hook there changes what dynamo traces
            if not self.compiled:
                block.register_forward_pre_hook(lambda *_, i=i: self.forwards.__setitem__(i, self.forwards[i] + 1))

    def scope(self, **options):
        return prefire.session(self.session, **options) if self.in_session else contextlib.nullcontext()

    def forward(self, x: torch.Tensor, backwards: Optional[List[int]] = None):
        """The stage input and output; ``backwards[i]`` counts block i's compiled backward runs."""
        h = stage_input = x.detach().requires_grad_()
        for i, layer in enumerate(self.layers):
            h = layer(h)
            if backwards is not None:
                h.grad_fn.register_prehook(lambda _, i=i: backwards.__setitem__(i, backwards[i] + 1))
        return stage_input, h

    def step(self, x: torch.Tensor, grad: torch.Tensor, count: bool = False) -> Dict[str, float]:
        for p in self.params:
            p.grad = None
        torch.manual_seed(2)  # each step's dropout masks the same within a variant
        RECOMPUTED.clear()
        self.forwards[:] = [0] * len(self.forwards)
        backwards = [0] * len(self.layers)
        start = prefire.allocator_bytes().current
        begin = time.perf_counter()
        with prefire.collect() as handles:
            stage_input, h = self.forward(x, backwards if count and self.compiled else None)
        for handle in handles:
            prefire.attach(handle, self.session)
        forwards = list(self.forwards)
        with self.scope(retain_on_unpack=True):
            _, groups = stage_backward_input([h], [grad], [stage_input], iter(self.params))
        held_after_b = prefire.allocator_bytes().current - start
        with self.scope():
            stage_backward_weight(iter(self.params), groups)
        if self.in_session:
            prefire.clear_session(self.session)
        seconds = time.perf_counter() - begin
        n = len(self.layers)
        return {"s": seconds, "held_after_b": held_after_b,
                "prefire_recomputes": len(RECOMPUTED) / n,
                "torch_recomputes": (sum(self.forwards) - sum(forwards)) / n if not self.compiled else float("nan"),
                "compiled_backwards": sum(backwards) / n if self.compiled else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--no-donated-buffer", action="store_true",
                        help="torch._functorch.config.donated_buffer = False")
    args = parser.parse_args()
    torch.set_num_threads(1)
    prefire.count_cpu_allocations()  # before any model
    warnings.filterwarnings("ignore", message="prefire.checkpoint inside torch.compile")
    if args.no_donated_buffer:
        torch._functorch.config.donated_buffer = False
    prefire.set_recompute_observer(lambda *event: RECOMPUTED.append(event))
    torch.manual_seed(1)
    x = torch.randn(args.batch, args.seq, args.dim)
    grad = torch.randn(args.batch, args.seq, args.dim)

    stages: Dict[str, Stage] = {}
    counts: Dict[str, Dict[str, float]] = {}
    peaks: Dict[str, int] = {}
    grads: Dict[str, List[torch.Tensor]] = {}
    for session, name in enumerate(VARIANTS, 1):
        stage = Stage(name, args, session)
        try:
            if args.dropout > 0:  # a plain backward first, as a step without a split (or a warm-up) runs it
                torch.autograd.grad(stage.forward(x)[1].square().mean(), stage.params)
            stage.step(x, grad)  # compiles
        except RuntimeError as e:  # stage_backward_input raises from what failed
            cause = e.__cause__ or e
            print(f"{name}: {type(cause).__name__}: {str(cause).strip().splitlines()[0]}")
            continue
        counts[name] = stage.step(x, grad, count=True)
        with prefire.AllocatorPeak() as peak:
            stage.step(x, grad)
        peaks[name] = peak.bytes
        grads[name] = [p.grad.clone() for p in stage.params]
        stages[name] = stage
    times: Dict[str, List[float]] = {name: [] for name in stages}
    for _ in range(args.rounds):
        for name, stage in stages.items():
            times[name].append(stage.step(x, grad)["s"])

    print(f"{args.blocks} GPT blocks, dim {args.dim}, batch {args.batch} x seq {args.seq}, dropout {args.dropout}, "
          f"CPU, 1 thread, inductor; B and W by torch's stage_backward_input / stage_backward_weight; "
          f"{args.rounds} rounds")
    print(f"{'variant':54s} {'step ms':>8s} {'/ base':>7s} {'peak MiB':>9s} {'/ base':>7s} {'held after B':>13s}"
          f" {'recomputes/block':>17s} {'compiled bw/block':>18s} {'grads vs base':>14s}")
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    for name in stages:
        c = counts[name]
        recomputes = c["prefire_recomputes"] if VARIANTS[name][1] else c["torch_recomputes"]
        if BASE in grads:
            diff = max((a - b).abs().max().item() for a, b in zip(grads[name], grads[BASE]))
            versus = "equal" if diff == 0 else f"{diff:.1e}"
        else:
            versus = "-"
        base_ms, base_peak = ms.get(BASE, float("nan")), peaks.get(BASE, 0) or float("nan")
        print(f"{name:54s} {ms[name]:8.1f} {ms[name] / base_ms:7.3f} {peaks[name] / 2**20:9.2f}"
              f" {peaks[name] / base_peak:7.3f} {c['held_after_b'] / 2**20:9.2f} MiB {_count(recomputes):>17s}"
              f" {_count(c['compiled_backwards']):>18s} {versus:>14s}")
    print("recomputes/block: prefire's recomputations (sessions) or the eager block's forwards beyond the first "
          "(torch's checkpoint); under compile torch's checkpoint recomputes inside each compiled backward run")


def _count(value: float) -> str:
    return "-" if value != value else f"{value:g}"


if __name__ == "__main__":
    main()
