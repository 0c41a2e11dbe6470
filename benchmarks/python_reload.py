"""A plain backward over offloaded blocks: fetching each block when backward
reaches it (lazy) against the reload schedule (prefire.reload_schedule: a
block's fetch begins at the backward of the block above it, through
prefire.fetch_ahead in an output-gradient hook), on a paced host file tier.

The model: 8 blocks of LayerNorm, Linear(dim, 4 dim), GELU, Linear(4 dim,
dim), dropout, every one offloaded. The tier is paced so that one block's
fetch takes about as long as one block's backward (--ratio 1; measured here
first, unchecked): a GPU's ratio of host-link time to compute, where an
H200 block's backward and its fetch over PCIe Gen5 are of one order, not
this CPU's, where a page-cache copy is nearly free. The reload schedule is
given one block's saved bytes of headroom (one fetch ahead). Printed, in one
run, medians over interleaved rounds: the backward's time unchecked, with
lazy fetches and with the schedule; the fetch time the lazy backward exposes
(lazy - unchecked); and the share of it the schedule hides,
(lazy - scheduled) / (lazy - unchecked).

    PYTHONPATH=build/python ~/.cache/prefire/venv/bin/python benchmarks/python_reload.py [--dir /tmp]
"""

import argparse
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

import prefire


class Mlp(torch.nn.Module):
    def __init__(self, dim, dropout):
        super().__init__()
        self.ln = torch.nn.LayerNorm(dim)
        self.fc1 = torch.nn.Linear(dim, 4 * dim)
        self.fc2 = torch.nn.Linear(4 * dim, dim)
        self.dropout = dropout

    def forward(self, x):
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln(x)))), self.dropout, self.training)


def backward_seconds(blocks, x, wrap, schedule=None):
    """One step's backward (forward untimed), the tier's writes done first."""
    torch.manual_seed(1)
    handles, y = [], x
    for i, b in enumerate(blocks):
        with prefire.collect() as made:
            y = wrap(b, y)
        handles.append(made[0] if made else None)
        if schedule and schedule[i]:
            y.register_hook(fetching(handles, schedule[i]))
    loss = y.square().mean()
    if isinstance(wrap, Offloaded):
        wrap.tier.synchronize()
    begin = time.perf_counter()
    loss.backward()
    return time.perf_counter() - begin


def fetching(handles, below):
    """A gradient hook that begins the fetches of blocks ``below``."""
    def hook(_):
        for j in below:
            prefire.fetch_ahead(handles[j])
    return hook


class Offloaded:
    def __init__(self, tier):
        self.tier = tier

    def __call__(self, b, y):
        return prefire.checkpoint(b, y, offload_to=self.tier)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--tokens", type=int, default=8 * 256, help="batch x sequence")
    p.add_argument("--ratio", type=float, default=1.0, help="one block's fetch time over its backward time")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the tier's file goes")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(Mlp(a.dim, 0.1) for _ in range(a.blocks))
    x = torch.randn(a.tokens // 256, 256, a.dim, requires_grad=True)

    # one block's saved bytes and its backward, unchecked, to pace the tier by
    with prefire.SavedTensorMeter() as meter:
        y = blocks[0](x)
    saved = meter.current_bytes
    unchecked = [backward_seconds(blocks, x, lambda b, y: b(y)) for _ in range(3)]
    per_block = statistics.median(unchecked) / a.blocks
    bandwidth = saved / (a.ratio * per_block)
    tier = prefire.OffloadTier.host_file(a.dir, 2 * a.blocks * saved + (64 << 20), bytes_per_second=bandwidth)
    offloaded = Offloaded(tier)

    costs = [prefire.with_offload(prefire.BlockCost(saved_bytes=saved, input_bytes=x.nbytes, recompute_seconds=1e-3),
                                  moved_bytes=saved, copy_seconds=1e-3) for _ in blocks]
    choices = [prefire.Choice.OFFLOAD] * a.blocks
    peak = prefire.describe_plan(costs, choices, 0, 0, prefire.Release.IN_BACKWARD).peak_bytes
    schedule = prefire.reload_schedule(costs, choices, peak + saved)  # one fetch ahead

    times = {"unchecked": [], "lazy": [], "scheduled": []}
    for _ in range(a.rounds):
        times["unchecked"].append(backward_seconds(blocks, x, lambda b, y: b(y)))
        times["lazy"].append(backward_seconds(blocks, x, offloaded))
        times["scheduled"].append(backward_seconds(blocks, x, offloaded, schedule))
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    exposed = ms["lazy"] - ms["unchecked"]
    fetch_ms = a.blocks * saved / bandwidth * 1e3
    print(f"{a.blocks} blocks, {saved / 2**20:.2f} MiB saved each; tier paced at {bandwidth / 1e9:.3f} GB/s "
          f"(a block's fetch {saved / bandwidth * 1e3:.2f} ms, its backward {per_block * 1e3:.2f} ms); "
          f"schedule {schedule}")
    print(f"backward ms: unchecked {ms['unchecked']:.1f}, lazy {ms['lazy']:.1f}, scheduled {ms['scheduled']:.1f}; "
          f"fetches {fetch_ms:.1f} ms in all, the lazy backward exposes {exposed:.1f}")
    hidden = (ms["lazy"] - ms["scheduled"]) / exposed if exposed > 0 else float("nan")
    print(f"hidden by the reload schedule: {hidden:.3f} of the exposed fetch time (target >= 0.5); "
          f"scheduled / unchecked {ms['scheduled'] / ms['unchecked']:.3f}, lazy / unchecked "
          f"{ms['lazy'] / ms['unchecked']:.3f}")


if __name__ == "__main__":
    main()
