"""A memory budget sweep for a plain model: prefire.plan_checkpoints against
the configurations a user writes with torch's checkpoint, in one process.

The model: a GPT stack split as Megatron's selective recompute sees it, an
attention block (its softmax saves batch x heads x seq^2) and an MLP block
(4x wider matmuls) per layer, dropout in both. For budgets from what
the least the planner promises to what checkpointing none holds, each row
gives prefire's plan (which blocks it checkpoints, the most bytes the step
held, the step time) and every torch configuration that fits: every n-th
block for n = 1..4 (n = 2: the attention blocks, what Megatron's selective
recompute chooses by hand), the MLP blocks, and none. Memory is measured two
ways. The step peak is what the CPU allocator held during a step above what
it held when the step began (prefire.AllocatorPeak: every allocation, torch's
checkpoint's recomputations included; the parameters' gradients exist from
the first step on, so they are not in it), for every configuration run as
it is, torch's with torch.utils.checkpoint itself: a torch configuration
fits a budget when its step peak is at most the plan's. The budgets, and
the check that the plan keeps within its budget, are in prefire's census (a
SavedTensorMeter plus recomputed bytes), which is what memory_budget covers.
Times are medians over interleaved rounds.

With --offload-dir DIR, budgets are fractions of what checkpointing none
holds (--fractions, default 0.25,0.5,0.75), and each is planned twice:
recompute-only, and with offloading as a fourth choice (plan_checkpoints(...,
offload_to=an OffloadTier.host_file in DIR)); both are timed in the same
interleaved rounds, and memory is the CPU allocator's: the step peak, and
what the forward leaves held (the activations kept for backward).

    PYTHONPATH=build/python ~/.cache/prefire/venv/bin/python benchmarks/python_plan_sweep.py \
        [--json sweep.json] [--plot docs/plan-sweep.png] [--offload-dir /tmp]
"""

import argparse
import copy
import json
import statistics
import time

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint

import prefire


class Attention(torch.nn.Module):
    def __init__(self, dim, heads, dropout):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.dropout((q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5).softmax(-1), self.dropout, self.training)
        return x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class Mlp(torch.nn.Module):
    def __init__(self, dim, dropout):
        super().__init__()
        self.dropout = dropout
        self.ln = torch.nn.LayerNorm(dim)
        self.fc1 = torch.nn.Linear(dim, 4 * dim)
        self.fc2 = torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln(x)))), self.dropout, self.training)


def make_blocks(args):
    torch.manual_seed(args.seed)
    blocks = []
    for _ in range(args.layers):
        blocks += [Attention(args.dim, args.heads, args.dropout), Mlp(args.dim, args.dropout)]
    return torch.nn.ModuleList(blocks)


def step_fn(blocks, x, wrap):
    def step():
        h = x * 1.0  # an embedding's output: block 0's input is an activation
        for i, b in enumerate(blocks):
            h = wrap(i, b, h)
        h.backward(torch.ones_like(h))
    return step


def step_peak(step):
    """The most the CPU allocator held during the step above what it held before it."""
    with prefire.AllocatorPeak() as peak:
        step()
    return peak.bytes


def forward_held(blocks, x):
    """What the CPU allocator holds after the forward above what it held
    before it (the activations kept for backward, the output included)."""
    before = prefire.allocator_bytes("cpu").current
    h = x * 1.0
    for b in blocks:
        h = b(h)
    for tier in TIERS:
        tier.synchronize()
    held = prefire.allocator_bytes("cpu").current - before
    h.backward(torch.ones_like(h))
    return held


TIERS = []  # the offload tiers in use: their copies are waited for before memory is read


def offload_sweep(args, reference, x, none_bytes):
    """Budgets at fractions of none's census: recompute-only and offload plans."""
    tier = prefire.OffloadTier.host_file(args.offload_dir, args.tier_mib << 20)
    TIERS.append(tier)
    probe_bytes = 64 << 20
    seconds = min(tier.measure_copy_seconds(probe_bytes) for _ in range(3))
    print(f"tier in {args.offload_dir}: one copy each way of {probe_bytes >> 20} MiB in {seconds * 1e3:.1f} ms "
          f"({2 * probe_bytes / seconds / 1e9:.2f} GB/s)", flush=True)
    rows = []
    for fraction in [float(f) for f in args.fractions.split(",")]:
        budget = round(fraction * none_bytes)
        steps, plans, row = {}, {}, {"fraction": fraction, "budget_bytes": budget}
        for name, offload_to in (("recompute", None), ("offload", tier)):
            planned = copy.deepcopy(reference)
            planner = prefire.plan_checkpoints(planned, memory_budget=budget, offload_to=offload_to)
            step = step_fn(planned, x, lambda i, b, h: b(h))
            try:
                step()  # the measuring step
            except ValueError as error:  # below the least plan of this kind
                row[name] = {"error": str(error).split(" (")[0]}
                continue
            steps[name], plans[name] = step, planner.plan
            row[name] = {"checkpointed": [i for i, c in enumerate(planner.plan.checkpointed) if c],
                         "offloaded": [i for i, o in enumerate(planner.plan.offloaded) if o],
                         "planned_peak_bytes": planner.plan.peak_bytes,
                         "step_peak_bytes": step_peak(step), "forward_held_bytes": forward_held(planned, x)}
        ms = median_ms(steps, args.rounds, args.iterations) if steps else {}
        for name in steps:
            row[name]["step_ms"] = ms[name]
        rows.append(row)

        def say(name):
            r = row[name]
            if "error" in r:
                return f"{name}: no plan ({r['error']})"
            return (f"{name}: checkpoints {r['checkpointed']} (offloaded {r['offloaded']}), forward leaves "
                    f"{r['forward_held_bytes'] / 2**20:6.2f} MiB, step peak {r['step_peak_bytes'] / 2**20:6.2f} MiB, "
                    f"{r['step_ms']:7.1f} ms")
        ratio = (f" | offload/recompute {ms['offload'] / ms['recompute']:.3f}" if len(ms) == 2 else "")
        print(f"{fraction:.2f} of none ({budget / 2**20:6.2f} MiB): {say('recompute')} | {say('offload')}{ratio}",
              flush=True)
    print(f"tier: {tier.bytes_written / 2**20:.1f} MiB written, {tier.bytes_read / 2**20:.1f} MiB read, "
          f"peak {tier.peak_used_bytes / 2**20:.1f} MiB used", flush=True)
    return rows


def held_bytes(step):
    """The most bytes the step's activations held: saved (census) plus recomputed."""
    prefire.reset_runtime_peak()
    before = prefire.runtime_stats().held_bytes
    with prefire.SavedTensorMeter():
        step()
    return prefire.runtime_stats().peak_held_bytes - before


def chosen(blocks, which):
    """wrap() that checkpoints the blocks in `which` with `ckpt`."""
    def wrap_with(ckpt):
        def wrap(i, b, h):
            return ckpt(b, h) if i in which else b(h)
        return wrap
    return wrap_with


def prefire_ckpt(b, h):
    return prefire.checkpoint(b, h)


def torch_ckpt(b, h):
    return torch_checkpoint.checkpoint(b, h, use_reentrant=False)


def median_ms(steps, rounds, iterations):
    times = {name: [] for name in steps}
    for step in steps.values():
        step()  # warm-up (and the planner's measuring step)
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(iterations):
                step()
            times[name].append((time.perf_counter() - start) / iterations * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--budgets", type=int, default=6, help="budgets from checkpointing every block to none")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--offload-dir", help="a directory for an offload tier: the offload sweep (see above)")
    parser.add_argument("--fractions", default="0.25,0.5,0.75", help="the offload sweep's budgets, of none's")
    parser.add_argument("--tier-mib", type=int, default=1024, help="the offload tier's capacity")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.add_argument("--replot", metavar="JSON", help="only draw --plot from a --json this script wrote")
    args = parser.parse_args()
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f), args.plot)
        return
    torch.set_num_threads(args.threads)
    prefire.count_cpu_allocations()  # before the model: every storage of the steps is counted
    reference = make_blocks(args)
    n = len(reference)
    x = torch.randn(args.batch, args.seq, args.dim)
    every = {f"every {k}": set(range(0, n, k)) for k in (1, 2, 3, 4)}
    configs = {**every, "MLP blocks": set(range(1, n, 2)), "none": set()}
    bytes_of = {name: held_bytes(step_fn(reference, x, chosen(reference, which)(prefire_ckpt)))
                for name, which in configs.items()}
    peak_of = {name: step_peak(step_fn(reference, x, chosen(reference, which)(torch_ckpt)))
               for name, which in configs.items()}
    probe = copy.deepcopy(reference)
    planner = prefire.plan_checkpoints(probe, memory_budget=bytes_of["none"])
    step_fn(probe, x, lambda i, b, h: b(h))()
    least = prefire.least_plan_bytes(planner.costs, prefire.Release.IN_BACKWARD)  # what the planner promises
    print(f"{n} blocks; measured: every block checkpointed {bytes_of['every 1'] / 2**20:.2f} MiB, none "
          f"{bytes_of['none'] / 2**20:.2f} MiB; the least plan promises {least / 2**20:.2f} MiB", flush=True)
    if args.offload_dir:
        rows = offload_sweep(args, reference, x, bytes_of["none"])
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "blocks": n, "config_bytes": bytes_of, "least_plan_bytes": least,
                           "offload_rows": rows}, f, indent=1)
        return
    low, high = max(least, bytes_of["every 1"]), bytes_of["none"]
    budgets = [round(low + (high - low) * k / (args.budgets - 1)) for k in range(args.budgets)]
    rows = []
    for budget in budgets:
        planned = copy.deepcopy(reference)
        planner = prefire.plan_checkpoints(planned, memory_budget=budget)
        plan_step = step_fn(planned, x, lambda i, b, h: b(h))
        plan_step()  # the measuring step
        plan_peak = step_peak(plan_step)
        fits = [name for name in configs if peak_of[name] <= plan_peak]
        steps = {"prefire plan": plan_step}
        steps.update({f"torch {name}": step_fn(reference, x, chosen(reference, configs[name])(torch_ckpt))
                      for name in fits})
        ms = median_ms(steps, args.rounds, args.iterations)
        plan_bytes = held_bytes(plan_step)
        row = {"budget_bytes": budget,
               "plan": {"checkpointed": [i for i, c in enumerate(planner.plan.checkpointed) if c],
                        "held_bytes": plan_bytes, "step_peak_bytes": plan_peak, "step_ms": ms["prefire plan"],
                        "planned_peak_bytes": planner.plan.peak_bytes},
               "torch": {name: {"held_bytes": bytes_of[name], "step_peak_bytes": peak_of[name],
                                "step_ms": ms[f"torch {name}"]} for name in fits}}
        rows.append(row)
        best = min(fits, key=lambda name: ms[f"torch {name}"]) if fits else None
        print(f"budget {budget / 2**20:7.2f} MiB: prefire checkpoints {row['plan']['checkpointed']} "
              f"held {plan_bytes / 2**20:6.2f} MiB (census), step peak {plan_peak / 2**20:6.2f} MiB, "
              f"{ms['prefire plan']:7.1f} ms | "
              + (f"fastest torch config that fits: {best} step peak {peak_of[best] / 2**20:6.2f} MiB, "
                 f"{ms[f'torch {best}']:7.1f} ms (plan/torch {ms['prefire plan'] / ms[f'torch {best}']:.3f})"
                 if best else "no torch config fits"), flush=True)
        assert plan_bytes <= budget, f"the plan held {plan_bytes} bytes above the budget {budget}"
    result = {"args": vars(args), "blocks": n, "config_bytes": bytes_of, "config_step_peak_bytes": peak_of,
              "least_plan_bytes": least, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot(result, args.plot)


def plot(result, path):
    """Step time against peak activation memory per budget: prefire's plan,
    and the fastest torch configuration that fits the same budget, timed in
    the same interleaved rounds (the comparison this machine's noise allows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    rows = result["rows"]
    ax.plot([r["plan"]["step_peak_bytes"] / 2**20 for r in rows], [r["plan"]["step_ms"] for r in rows], "o-",
            label="prefire plan")
    best = [min(r["torch"].items(), key=lambda item: item[1]["step_ms"]) for r in rows if r["torch"]]
    ax.plot([b[1]["step_peak_bytes"] / 2**20 for b in best], [b[1]["step_ms"] for b in best], "s--",
            label="fastest torch checkpoint configuration that fits")
    for name, b in best:
        ax.annotate(name, (b["step_peak_bytes"] / 2**20, b["step_ms"]), textcoords="offset points", xytext=(4, 4),
                    fontsize=7)
    ax.set_xlabel("step peak, CPU allocator (MiB)")
    ax.set_ylabel("step time (ms)")
    ax.legend(fontsize=8)
    ax.set_title("One point per budget; a torch configuration fits when its step peak is at most the plan's",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
