"""enable(schedule, bubble=True, placement=...): the simulator's recompute
actions run by the rank (Note [Running a placement] in prefire/pipelining/_bubbles.py)."""

import pytest
import torch

import prefire
from prefire import pipelining
from prefire.pipelining._bubbles import BubbleFiller
from prefire.pipelining.placement import check_placement
from prefire.pipelining.actions import rank_actions
from pipeline_bench import run
from pipeline_bench.config import RunConfig
from pipeline_sim.measured import validate
from pipeline_bench.model import reference_gradients
from pipeline_sim.replay import rank_orders
from pipeline_bench.report import table
from prefire.pipelining import PipelineStats
from prefire.pipelining._sessions import _MicroBatch

from test_pipelining import TINY, count_runs, zbv_one_rank


#: one rank's order
ORDER = [("F", 1, 0), ("F", 1, 1), ("B", 1, 0), ("B", 1, 1)]


def test_a_placement_prefires_what_it_names_before_each_action_once_a_step_from_the_second():
    prefired = []

    def prefire_fn(handle, session):
        prefired.append(handle)
        return prefire.PrefireStatus.RECOMPUTED

    mbs = {(1, 0): _MicroBatch(10, ["a0", "b0", "c0"]), (1, 1): _MicroBatch(11, ["a1", "b1"])}
    stats = PipelineStats()
    placement = {("F", 1, 1): [(1, 0, 2)], ("B", 1, 0): [(1, 0, 5), (1, 1, 1)]}
    filler = BubbleFiller(ORDER, lambda s, m: mbs.get((s, m)), stats, prefire_fn, placement=placement)

    def step(training=True):
        filler.new_step(training)
        filler.before_action(("F", 1, 0))
        filler.before_action(("F", 1, 1))
        filler.before_wait("backward", 1, 0, [])   # the receive of B (1, 0): its placed prefires run here ...
        filler.before_action(("B", 1, 0))          # ... and not again in the stage method
        filler.before_action(("B", 1, 1))

    step()
    assert prefired == []  # the first training step infers shapes
    step(training=False)
    assert prefired == []  # nothing in eval() steps
    step()
    # before F (1, 1): two of micro-batch 0's, last block first; before B (1, 0): what is left of 0 (one, not
    # five), then one of micro-batch 1; nothing twice
    assert prefired == ["c0", "b0", "a0", "b1"]
    assert stats.bubble_prefires == 4 and mbs[(1, 0)].prefired == 3 and mbs[(1, 1)].prefired == 1
    assert filler.slack == {}  # a placement learns no slack


@pytest.mark.parametrize("placement, message", [
    ([], "must be a dict"),
    ({("W", 1, 0): []}, "not an action of this rank's order"),
    ({("F", 1, 1): [(1, 0)]}, r"each entry is \(stage, micro-batch, count\)"),
    ({("F", 1, 1): [(1, 0, 0)]}, "count >= 1"),
    ({("F", 1, 1): [(2, 0, 1)]}, "does not run forward and backward"),
    ({("F", 1, 0): [(1, 0, 1)]}, "outside its forward and backward"),
    ({("B", 1, 1): [(1, 0, 1)]}, "outside its forward and backward"),
])
def test_a_placement_that_does_not_fit_the_ranks_order_is_refused_naming_the_entry(placement, message):
    with pytest.raises(ValueError, match=message):
        check_placement(placement, ORDER)
    with pytest.raises(ValueError, match="keeps an order of actions"):
        check_placement({}, None)
    assert check_placement({("B", 1, 0): [[1, 0, 2]]}, ORDER) == {("B", 1, 0): [(1, 0, 2)]}


def after_each_forward(order):
    """Every micro-batch's checkpoints placed right after its forward."""
    placement = {}
    for kind, stage, mb in order:
        if kind in ("B", "BW"):
            after = order[order.index(("F", stage, mb)) + 1]
            placement.setdefault(after, []).append((stage, mb, 2))
    return placement


def test_on_one_rank_the_placed_prefires_replace_the_lazy_recomputation_bit_equal(one_rank):
    """ZBV with both stages on the rank (no receive: every placed prefire
    runs from a stage method): each block still runs twice per
    micro-batch (forward, one recomputation), all of them placed."""
    expected = reference_gradients(TINY)
    schedule, modules, step = zbv_one_rank(lambda b, x: prefire.checkpoint(b, x))
    with pytest.raises(ValueError, match="pass bubble=True"):
        pipelining.enable(schedule, placement={})
    with pytest.raises(ValueError, match="not an action of this rank's order"):
        pipelining.enable(schedule, bubble=True, placement={("F", 7, 0): []})
    assert all("forward_one_chunk" not in vars(s) for s in schedule._stages)  # refused before wrapping anything
    placement = after_each_forward(rank_actions(schedule))
    sessions = pipelining.enable(schedule, bubble=True, placement=placement)
    runs = count_runs(modules)
    step()
    assert sessions.stats().bubble_prefires == 0
    for _ in range(2):
        runs.clear()
        sessions.reset_stats()
        grads = step()
        assert all(torch.equal(grads[n], expected[n]) for n in expected)
        assert runs == {b: 2 * TINY.micro_batches for b in range(TINY.blocks)}
        assert sessions.stats().bubble_prefires == TINY.blocks * TINY.micro_batches  # every checkpoint, placed
    sessions.disable()


def test_two_ranks_run_a_placement_where_it_puts_each_prefire_bit_equal_and_not_in_eval(no_children_left):
    # interleaved zero bubble: schedule.eval() of a rank with local stage pairs (ZBV's) fails in torch 2.14 itself
    orders = rank_orders("interleaved-zb", 2, TINY.micro_batches)
    placements = [after_each_forward(order) for order in orders]
    data = {"schedule": "interleaved-zb", "world": 2, "micro_batches": TINY.micro_batches,
            "ranks": [[[list(a), [list(i) for i in items]] for a, items in p.items()] for p in placements]}
    cfg = RunConfig(model=TINY, schedule="interleaved-zb", modes=("none", "torch", "session", "placed"), steps=2,
                    warmup=3, eval_steps=1, timeout_s=120, placement=data)
    summary = run(cfg, world=2)
    assert no_children_left()
    placed = summary["modes"]["placed"]
    assert placed["gradients"]["exact"], placed["gradients"]
    assert [r["eval_recomputations"] for r in placed["ranks"]] == [0, 0]
    per_stage = TINY.blocks // 4
    for rank, timeline in enumerate(summary["timelines"]["placed"]):
        for step in timeline["steps"]:
            events = sorted(step["events"], key=lambda e: e[3])
            ran = {}
            for i, event in enumerate(events):  # each placed prefire counts for the action it preceded
                if event[0] == "recompute-bubble":
                    action = next(tuple(e[:3]) for e in events[i:] if e[0] in ("F", "B", "W", "BW"))
                    ran[action] = ran.get(action, 0) + 1
            assert ran == {a: per_stage * len(items) for a, items in placements[rank].items()}, (rank, ran)
            assert not any(e[0] == "recompute" for e in events)  # the passes recomputed nothing
    assert "placed (the simulator's placement, not the rules)" in table(summary)
    # the simulator replays placed mode with the run's placement (validate's rows; how near is the docs' to say)
    rows = {row["mode"]: row for row in validate(summary)}
    assert set(rows) == {"none", "torch", "session", "placed"}
    assert rows["placed"]["simulated_step_s"] > 0 and rows["placed"]["simulated_wait_s"] >= 0
