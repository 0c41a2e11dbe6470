"""The joint plan (``python -m pipeline_sim place --plan-sweep``): keep,
recompute, selective or offload, per rank, block and micro-batch, chosen by
the replayed step under each rank's budget.

Note [The joint plan]
A rank's memory plan (Note [A pipeline rank's memory plan]) takes the least
recomputation that holds its budget, by the planner's count, blind to when
each pass runs: a second of recomputation costs it the same on a critical
rank's steady state as in a cool-down that waits anyway, and it compares
offloading with recomputing by seconds alone. The joint plan chooses by
the replayed step (Note [What the simulator replays]; a plan's passes as
Note [Searching per-block plans] replays them: none's durations plus the
share of session's recomputation its blocks recompute, an offloaded
block's its copies' exposed seconds, or its copies whole where the rank's
plan leaves no room for one in flight: ``Plan.block_seconds``, rule 6 of
Note [Offloaded blocks in a plan]):

1. It starts from the better replayed of the planner's own plans at the
   budget: offered every choice, and offered no offload (recompute only;
   none where only offloading holds the budget: ``recompute_only_s`` null).
2. It moves an item (one block on one micro-batch) to another choice it is
   offered, or swaps the choices of one stage's block on two micro-batches
   (moving recomputation to a micro-batch whose pass has room), keeping a move
   when every rank still holds its budget by the planner's count
   (``describe_plan``) and the replayed step ends earlier, or ends as early
   with the ranks' passes ending earlier in sum (``objective``).
3. It stops when a sweep over every item keeps nothing, or after
   ``max_replays`` replays.

Its recomputation runs in its passes; where it runs ahead is the filler's
at run time (Note [Filling bubbles]), so the joint step is what the plan
costs before any prefire. Each rank's budget is a fraction of what
keeping every item holds on it by the planner's count, or bytes per rank
(``bubble_budgets``: what bubble mode holds plus one stage's activations),
at least the least it can hold; the peak fraction is the largest rank's
peak over the largest rank's keep-everything peak.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import prefire
from prefire.pipelining.plans import rank_items

from .place import objective
from .plan_search import item_slots, laid_out, with_plan, without_offload
from .replay import Pipeline, Replay

RELEASE = prefire.Release.AT_STEP_END

#: a share of what keeping everything holds on each rank, or bytes per rank
Budget = Union[float, Sequence[int]]


@dataclass
class _Rank:
    """One rank's items, what each may choose and where each sits in the
    plan's per-micro-batch options."""

    items: List[Any]
    offset: int                                    # the rank's first block among every rank's
    budget: int
    keep_bytes: int
    holds: bool                                    # the least it can hold is within fraction x keep_bytes
    slots: List[Tuple[int, int]] = field(default_factory=list)   # per item: (block in the rank, micro-batch)
    offered: List[List[Any]] = field(default_factory=list)

    def peak(self, choices: Sequence[Any]) -> int:
        return prefire.describe_plan(self.items, list(choices), 0, 0, RELEASE).peak_bytes

    def fits(self, choices: Sequence[Any]) -> bool:
        return self.peak(choices) <= self.budget


def _micro_batches(pipeline: Pipeline) -> int:
    return 1 + max(mb for order in pipeline.orders for _, _, mb in order)


def _items(pipeline: Pipeline, rank: int, rank_blocks: List[Any]) -> List[Any]:
    return rank_items(rank_blocks, pipeline.orders[rank], _micro_batches(pipeline))


def _ranks(pipeline: Pipeline, blocks: Sequence[Tuple[int, List[Any]]], budget: Budget) -> List[_Rank]:
    micro_batches = _micro_batches(pipeline)
    out, offset = [], 0
    for rank, rank_blocks in blocks:
        items = _items(pipeline, rank, rank_blocks)
        keep = prefire.describe_plan(items, [prefire.Choice.KEEP] * len(items), 0, 0, RELEASE).peak_bytes
        least = prefire.least_plan_bytes(items, RELEASE)
        wanted = int(budget * keep) if isinstance(budget, float) else int(budget[rank])
        r = _Rank(items, offset, max(wanted, least), keep, least <= wanted, item_slots(rank_blocks, micro_batches))
        r.offered = [prefire.offered_choices(item) for item in items]
        out.append(r)
        offset += len(rank_blocks)
    return out


class _Search:
    """The replays of one joint plan search (Note [The joint plan])."""

    def __init__(self, pipeline: Pipeline, blocks: Sequence[Tuple[int, List[Any]]], budget: Budget,
                 max_replays: int) -> None:
        self.pipeline, self.max_replays, self.replays = pipeline, max_replays, 0
        self.ranks = _ranks(pipeline, blocks, budget)
        self.blocks = [b for _, rank_blocks in blocks for b in rank_blocks]
        self.micro_batches = _micro_batches(pipeline)

    def run(self, choices: List[List[Any]]) -> Replay:
        self.replays += 1
        options: List[List[Any]] = [[] for _ in range(self.micro_batches)]
        seconds: List[List[float]] = [[] for _ in range(self.micro_batches)]
        for r, rank_choices in zip(self.ranks, choices):  # what each choice adds as the rank's plan counts it
            plan = prefire.describe_plan(r.items, list(rank_choices), r.budget, 0, RELEASE)
            n_blocks = len(r.items) // self.micro_batches
            rank_options, rank_seconds = laid_out(plan, r.slots, self.micro_batches, n_blocks)
            for mb in range(self.micro_batches):
                options[mb] += rank_options[mb]
                seconds[mb] += rank_seconds[mb]
        costs = with_plan(self.pipeline.costs, self.blocks, options, seconds)
        return dataclasses.replace(self.pipeline, costs=costs).run("plan")

    def planner(self, offload: bool) -> Optional[List[List[Any]]]:
        """Per rank, the planner's choices at its budget (``offload``:
        offered); None where a rank's budget is below the least a plan
        without offload holds (only offloading holds it)."""
        out = []
        for r in self.ranks:
            items = r.items if offload else without_offload(r.items)
            if prefire.least_plan_bytes(items, RELEASE) > r.budget:
                return None
            out.append(list(prefire.plan_for_budget(items, r.budget, RELEASE).choices))
        return out

    def moves(self, rank: int, choices: List[Any]):
        """Single moves, then the swaps of rule 2, as (item, choice) lists."""
        r = self.ranks[rank]
        for i, offered in enumerate(r.offered):
            for c in offered:
                if c != choices[i]:
                    yield [(i, c)]
        by_block: Dict[int, List[int]] = {}
        for i, (block, _) in enumerate(r.slots):
            by_block.setdefault(block, []).append(i)
        for items in by_block.values():
            for n, i in enumerate(items):
                for j in items[n + 1:]:
                    if choices[i] != choices[j]:
                        yield [(i, choices[j]), (j, choices[i])]

    def improve(self, choices: List[List[Any]]) -> Tuple[List[List[Any]], Replay]:
        """Rules 2 and 3 from ``choices`` (changed in place: the moves read the current ones)."""
        current = self.run(choices)
        best = objective(current)
        improved = True
        while improved and self.replays < self.max_replays:
            improved = False
            for rank, r in enumerate(self.ranks):
                for move in self.moves(rank, choices[rank]):
                    if self.replays >= self.max_replays:
                        break
                    trial = list(choices[rank])
                    for i, c in move:
                        trial[i] = c
                    if trial == choices[rank] or not r.fits(trial):
                        continue
                    candidate = list(choices)  # every rank's choices, this rank's the trial
                    candidate[rank] = trial
                    result = self.run(candidate)
                    if objective(result) < best:
                        choices[rank][:] = trial
                        current, best, improved = result, objective(result), True
        return choices, current


def bubble_budgets(pipeline: Pipeline, blocks: Sequence[Tuple[int, List[Any]]], held: Sequence[int]) -> List[int]:
    """Per rank, what bubble mode holds by the planner's count (every item
    checkpointed, ``held[rank]`` of them recomputed ahead at once: the
    rules' ``held_ahead``) plus one stage's activations (the rank's largest
    stage, its blocks kept for one micro-batch)."""
    out = []
    for rank, rank_blocks in blocks:
        items = _items(pipeline, rank, rank_blocks)
        bubble = prefire.describe_plan(items, [prefire.Choice.CHECKPOINT] * len(items), 0, held[rank],
                                       RELEASE).peak_bytes
        stages: Dict[int, int] = {}
        for b in rank_blocks:
            stages[b.group] = stages.get(b.group, 0) + b.saved_bytes
        out.append(bubble + max(stages.values()))
    return out


def _by_stage(rank: _Rank, rank_blocks: List[Any], choices: Sequence[Any],
              micro_batches: int) -> Dict[int, List[List[str]]]:
    """A rank's choices as ``enable(..., choices=)`` takes them: per stage,
    per micro-batch, per block (in the stage's order) a choice's name."""
    out: Dict[int, List[List[str]]] = {}
    in_stage = [sum(1 for b in rank_blocks[:i] if b.group == block.group) for i, block in enumerate(rank_blocks)]
    for stage in dict.fromkeys(b.group for b in rank_blocks):
        width = sum(1 for b in rank_blocks if b.group == stage)
        out[stage] = [[""] * width for _ in range(micro_batches)]
    for (block, mb), choice in zip(rank.slots, choices):
        out[rank_blocks[block].group][mb][in_stage[block]] = choice.name
    return out


def joint_plan(pipeline: Pipeline, blocks: Sequence[Tuple[int, List[Any]]], budget: Budget,
               max_replays: int = 3000) -> Dict[str, Any]:
    """The joint plan (Note [The joint plan]) within ``budget``: a fraction
    of each rank's keep-everything bytes, or bytes per rank; ``blocks``: per
    rank, its blocks with their lifetimes (``rank_plan_blocks``)."""
    search = _Search(pipeline, blocks, budget, max_replays)
    starts = {"planner": search.planner(True), "recompute_only": search.planner(False)}
    start_s = {name: search.run(choices).step_s if choices is not None else None for name, choices in starts.items()}
    first = min((name for name in starts if starts[name] is not None), key=lambda name: start_s[name])
    choices, result = search.improve(starts[first])
    peaks = [r.peak(c) for r, c in zip(search.ranks, choices)]
    counts: Dict[str, int] = {}
    for rank_choices in choices:
        for c in rank_choices:
            counts[c.name] = counts.get(c.name, 0) + 1
    by_stage = [_by_stage(r, rank_blocks, c, search.micro_batches)
                for r, (_, rank_blocks), c in zip(search.ranks, blocks, choices)]
    return {"joint_s": result.step_s, "rank_choices": by_stage,
            "joint_peak_fraction": max(peaks) / max(r.keep_bytes for r in search.ranks),
            "planner_s": start_s["planner"], "recompute_only_s": start_s["recompute_only"], "started_from": first,
            "fraction": budget if isinstance(budget, float) else None,
            "budgets": [r.budget for r in search.ranks], "peaks": peaks,
            "choices": counts, "replays": search.replays,
            "fits": all(r.holds for r in search.ranks)}
