"""Durations set to another machine's ratios (``place --ratios``): what the
simulator predicts where B, W and the recomputation stand to F as they do
on a GPU rather than on the machine that measured.

Note [Durations at another machine's ratios]
A 2-rank run measures F, B, W and one checkpoint's recomputation on the
machine it ran on; a GPU's ratios differ (an H200 on a GPT block: B
1.1-1.36x F, W 0.5-0.94x F, a micro-batch's recomputation 0.30-0.36 of
F + B + W). ``with_ratios`` keeps each stage's forward as none mode
measured it and sets, per stage: none's B = b F, W = w F (a full backward
their sum); one micro-batch's recomputation R = r (F + B + W), split evenly
over its checkpoints; session mode's passes that and R in the pass that
recomputed on the measured run (B, or W on a stage whose measured B held
none of it, as a first stage's), nothing else: the ratios say nothing of a
session's own cost, so session mode has none beyond its recomputation;
torch mode recomputes in B and again in W. The message latency, a rank's
own time per action and the step's ending stay as measured, in seconds.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Tuple

from .replay import Costs

#: (B / F, W / F, one micro-batch's recomputation / (F + B + W))
Ratios = Tuple[float, float, float]

#: an H200 on a GPT block, the middle of each measured range (Note [Durations at another machine's ratios])
H200: Ratios = (1.23, 0.72, 0.33)


def with_ratios(costs: Costs, ratios: Ratios) -> Costs:
    """``costs`` at ``ratios`` (Note [Durations at another machine's ratios])."""
    b, w, r = ratios
    none, session = costs.action["none"], costs.action["session"]
    tables: Dict[str, Dict[Tuple[str, int], float]] = {"none": {}, "session": {}, "torch": {}}
    checkpoint: Dict[int, float] = {}
    for stage in sorted({s for _, s in none}):
        f = none[("F", stage)]
        recompute = r * (1 + b + w) * f
        checkpoint[stage] = recompute / max(1, costs.checkpoints.get(stage, 0))
        if not costs.checkpoints.get(stage, 0):
            recompute = 0.0
        in_w = (session.get(("B", stage), 0.0) - none.get(("B", stage), 0.0)
                < session.get(("W", stage), 0.0) - none.get(("W", stage), 0.0))
        base = {"F": f, "B": b * f, "W": w * f, "BW": (b + w) * f}
        extra = {"none": {}, "session": {"W" if in_w else "B": recompute, "BW": recompute},
                 "torch": {"B": recompute, "W": recompute, "BW": recompute}}
        for mode, table in tables.items():
            for kind, seconds in base.items():
                if (kind, stage) in none:
                    table[(kind, stage)] = seconds + extra[mode].get(kind, 0.0)
    return dataclasses.replace(costs, action=tables, checkpoint=checkpoint, instance={}, before={})
