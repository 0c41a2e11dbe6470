"""The joint plan (pipeline_sim.joint; Note [The joint plan]): keep,
recompute, selective or offload per rank, block and micro-batch, chosen by
the replayed step within each rank's budget."""

import dataclasses

import pytest

import prefire
from pipeline_bench.config import stage_rank
from prefire.pipelining._plan import check_choices
from prefire.pipelining.plans import choices_file, rank_choices, rank_items
from pipeline_sim.joint import _Search, bubble_budgets, joint_plan
from pipeline_sim.place import held_ahead, rules_placement
from pipeline_sim.plan_predict import rank_plan_blocks
from pipeline_sim.plan_search import with_plan
from pipeline_sim.replay import Costs, Pipeline, overlaps, rank_orders


def costs_of(n_stages, f=1.0, b=2.0, w=1.0, checkpoint=0.5, checkpoints=2, skew=0.1):
    """Session's passes hold two checkpoints of 0.5 (in B, or a full
    backward) beyond none's; stage s takes ``1 + skew * s`` times the
    others."""
    def table(recompute):
        out = {}
        for s in range(n_stages):
            k = 1.0 + skew * s
            out.update({("F", s): f * k, ("B", s): b * k + recompute, ("W", s): w * k,
                        ("BW", s): (b + w) * k + recompute})
        return out

    recompute = checkpoint * checkpoints
    return Costs({"none": table(0.0), "torch": table(recompute), "session": table(recompute)},
                 {s: checkpoint for s in range(n_stages)}, {s: checkpoints for s in range(n_stages)}, 0.01, 0.01)


def measured_blocks(copy_seconds, selective=True, input_bytes=1 << 16, offload_bytes=1 << 16, hidden=0.0):
    """Two blocks per measured stage (ZBV on 2 ranks: 4 stages): 1 MiB saved,
    0.5 s to recompute, offloadable (``offload_bytes`` left) at
    ``copy_seconds`` (``hidden`` of them), and selectively (half the bytes,
    0.2 s)."""
    block = prefire.BlockCost(saved_bytes=1 << 20, input_bytes=input_bytes, recompute_seconds=0.5,
                              offload_bytes=offload_bytes, offload_moved_bytes=1 << 20, offload_seconds=copy_seconds,
                              offload_hidden=hidden, selective_bytes=(1 << 19) if selective else -1,
                              selective_seconds=0.2)
    return {s: [block.to_dict(), block.to_dict()] for s in range(4)}


def pipeline(schedule, world):
    n_stages = 2 * world
    return Pipeline(rank_orders(schedule, world, 2 * world), stage_rank(schedule, world), n_stages,
                    costs_of(n_stages), overlaps(schedule, world, 2 * world))


@pytest.mark.parametrize("schedule, world", [("zbv", 4), ("dualpipev", 4), ("interleaved-zb", 4)])
def test_the_joint_plan_holds_every_ranks_budget_and_ends_before_the_planners_own_plans(schedule, world):
    """The planner takes the least recomputation, blind to when its passes
    run; the joint plan moves recomputation to micro-batches whose passes
    have room and ends the step earlier than both of the planner's plans,
    every rank within its budget by the planner's count."""
    p = pipeline(schedule, world)
    row = joint_plan(p, rank_plan_blocks(measured_blocks(2.0), 4, schedule, world), 0.5)
    assert row["fits"] and all(peak <= budget for peak, budget in zip(row["peaks"], row["budgets"])), row
    assert row["joint_peak_fraction"] <= 0.5
    assert row["joint_s"] < min(row["planner_s"], row["recompute_only_s"]) - 1e-9, row
    assert row["joint_s"] >= p.run("none").step_s - 1e-9


def test_the_joint_plan_offloads_over_a_fast_tier_and_recomputes_as_the_link_slows():
    p = pipeline("zbv", 4)
    fast = joint_plan(p, rank_plan_blocks(measured_blocks(0.1), 4, "zbv", 4), 0.5)
    slow = joint_plan(p, rank_plan_blocks(measured_blocks(2.0), 4, "zbv", 4), 0.5)
    assert fast["choices"].get("OFFLOAD", 0) > 0 and fast["joint_s"] < slow["joint_s"], (fast, slow)
    assert "OFFLOAD" not in slow["choices"] and slow["choices"].get("CHECKPOINT", 0) > 0, slow
    # the same switch by an assumed tier's bandwidth: 1 MiB each way at 1 GB/s is 2 ms, at 100 kB/s 21 s
    measured = measured_blocks(0.1)
    assert joint_plan(p, rank_plan_blocks(measured, 4, "zbv", 4, bandwidth=1e9), 0.5)["choices"].get("OFFLOAD", 0)
    assert "OFFLOAD" not in joint_plan(p, rank_plan_blocks(measured, 4, "zbv", 4, bandwidth=1e5), 0.5)["choices"]


def test_a_plan_that_leaves_no_room_for_a_copy_in_flight_replays_its_copies_whole():
    """Note [Offloaded blocks in a plan], rule 6, as the planner counts it:
    at a budget of the all-offload plan's own peak, forward waits for every
    copy into the tier (0.4 s a block); with room for one copy in flight
    beside it, 0.9 of each hides behind the next forward (0.04 s exposed)."""
    p = pipeline("zbv", 2)
    release = prefire.Release.AT_STEP_END
    blocks = rank_plan_blocks(measured_blocks(0.4, selective=False, hidden=0.9), 4, "zbv", 2)
    items = [rank_items(b, p.orders[rank], 4) for rank, b in blocks]
    offload = [[prefire.Choice.OFFLOAD] * len(rank) for rank in items]
    peaks = [prefire.describe_plan(rank, c, 0, 0, release).peak_bytes for rank, c in zip(items, offload)]
    every = [b for _, rank_blocks in blocks for b in rank_blocks]
    steps = {}
    for room, exposed in ((0, 0.4), (1 << 20, 0.04)):  # the room a copy of 1 MiB needs
        steps[room] = _Search(p, blocks, [peak + room for peak in peaks], 0).run(offload).step_s
        expected = with_plan(p.costs, every, [[prefire.Choice.OFFLOAD] * len(every)] * 4, [[exposed] * len(every)] * 4)
        assert steps[room] == pytest.approx(dataclasses.replace(p, costs=expected).run("plan").step_s)
    assert steps[0] > steps[1 << 20] + 1.0, steps


def test_a_budget_below_what_a_rank_can_hold_is_planned_at_its_least_and_said():
    p = pipeline("zbv", 2)
    blocks = rank_plan_blocks(measured_blocks(2.0, selective=False), 4, "zbv", 2)
    row = joint_plan(p, blocks, 0.01)
    least = [prefire.least_plan_bytes(rank_items(b, p.orders[rank], 4), prefire.Release.AT_STEP_END)
             for rank, b in blocks]
    assert not row["fits"] and row["budgets"] == least, row
    assert all(peak <= budget for peak, budget in zip(row["peaks"], row["budgets"])), row


def test_where_only_offloading_holds_the_budget_the_joint_plan_starts_from_the_plan_that_offloads():
    """Offloading leaves 4 KiB of a block where recomputing keeps its 256 KiB
    of inputs: a budget between the two least plans has no recompute-only
    plan."""
    p = pipeline("zbv", 2)
    blocks = rank_plan_blocks(measured_blocks(0.1, selective=False, input_bytes=1 << 18, offload_bytes=1 << 12), 4,
                              "zbv", 2)
    items = [rank_items(b, p.orders[rank], 4) for rank, b in blocks]
    release = prefire.Release.AT_STEP_END
    recompute_least = [prefire.least_plan_bytes([prefire.BlockCost.from_dict(dict(i.to_dict(), offload_bytes=-1))
                                                 for i in rank], release) for rank in items]
    keep = [prefire.describe_plan(rank, [prefire.Choice.KEEP] * len(rank), 0, 0, release).peak_bytes
            for rank in items]
    fraction = 0.99 * min(least / k for least, k in zip(recompute_least, keep))
    assert all(prefire.least_plan_bytes(rank, release) <= fraction * k for rank, k in zip(items, keep))
    row = joint_plan(p, blocks, fraction)
    assert row["recompute_only_s"] is None and row["started_from"] == "planner" and row["fits"], row
    assert row["choices"].get("OFFLOAD", 0) > 0
    assert all(peak <= budget for peak, budget in zip(row["peaks"], row["budgets"])), row


def test_a_budget_of_bubble_modes_bytes_plus_a_stage_keeps_more_than_checkpointing_everything():
    """``bubble_budgets``: every item checkpointed with the rules' held
    prefires, plus the rank's largest stage of blocks kept once; the joint
    plan there keeps items (it has a stage's room) and ends before session."""
    p = pipeline("zbv", 4)
    blocks = rank_plan_blocks(measured_blocks(2.0, selective=False), 4, "zbv", 4)
    held = held_ahead(p.run("placed", rules_placement(p.run("prefire"))))
    budgets = bubble_budgets(p, blocks, held)
    release = prefire.Release.AT_STEP_END
    for (rank, b), budget in zip(blocks, budgets):
        items = rank_items(b, p.orders[rank], 8)
        bubble = prefire.describe_plan(items, [prefire.Choice.CHECKPOINT] * len(items), 0, held[rank],
                                       release).peak_bytes
        assert budget == bubble + 2 * (1 << 20)  # a stage: two blocks of 1 MiB
    row = joint_plan(p, blocks, budgets)
    assert row["fits"] and row["fraction"] is None and row["choices"].get("KEEP", 0) > 0, row
    assert row["joint_s"] < p.run("session").step_s
    assert all(peak <= budget for peak, budget in zip(row["peaks"], budgets))


def test_the_joint_plans_choices_are_what_enable_takes_and_describe_the_same_plan():
    """Per rank, ``rank_choices`` (what ``place --write-choices`` writes,
    through its file) passes enable's check and, laid out as the planner's
    items (stage, micro-batch, block), holds the peak the joint plan
    counted."""
    p = pipeline("zbv", 4)
    blocks = rank_plan_blocks(measured_blocks(0.1), 4, "zbv", 4)
    row = joint_plan(p, blocks, 0.5)
    data = choices_file(row["rank_choices"], "zbv", 4, 8)
    names = set()
    for rank, rank_blocks in blocks:
        given = check_choices(rank_choices(data, rank), sorted({b.group for b in rank_blocks}), 8)
        chosen = [c for stage in dict.fromkeys(b.group for b in rank_blocks) for row_ in given[stage] for c in row_]
        items = rank_items(rank_blocks, p.orders[rank], 8)
        plan = prefire.describe_plan(items, chosen, 0, 0, prefire.Release.AT_STEP_END)
        assert plan.peak_bytes == row["peaks"][rank]
        names |= {c.name for c in chosen}
    assert {"OFFLOAD", "KEEP"} <= names  # a plan of more than one choice, so the layout is checked
