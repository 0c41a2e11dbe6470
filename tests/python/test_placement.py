"""Where recomputation can run (pipeline_sim.place; Note
[Where recomputation can run]): recompute actions in the replay, the
filler's rules as a placement, the search and the floor no placement
beats."""

import random

import pytest

from pipeline_bench.config import stage_rank
from pipeline_sim.oracle import fill, oracle, oracle_placement, shortened, without_recompute
from pipeline_sim.place import floor_s, held_ahead, rules_placement, search
from pipeline_sim.replay import Costs, Pipeline, overlaps, rank_orders
from prefire.pipelining.placement import check_placement

TWO_MICRO_BATCHES = [[("F", 0, 0), ("F", 0, 1), ("BW", 0, 0), ("BW", 0, 1)],
                     [("F", 1, 0), ("BW", 1, 0), ("F", 1, 1), ("BW", 1, 1)]]


def costs_of(n_stages, f=1.0, b=3.0, w=1.0, checkpoint=0.5, checkpoints=2, latency=0.05, overhead=0.01, skew=0.0):
    """Session mode's passes hold the recomputation (none's do not); stage
    s takes ``1 + skew * s`` times the others."""
    def table(recompute):
        out = {}
        for s in range(n_stages):
            k = 1.0 + skew * s
            out.update({("F", s): f * k, ("B", s): b * k - recompute, ("W", s): w * k,
                        ("BW", s): (b + w) * k - recompute})
        return out

    return Costs({"none": table(checkpoint * checkpoints), "torch": table(0.0), "session": table(0.0)},
                 {s: checkpoint for s in range(n_stages)}, {s: checkpoints for s in range(n_stages)}, latency,
                 overhead)


def pipeline(schedule, world, micro_batches=None, **kwargs):
    micro_batches = micro_batches or 2 * world
    n_stages = (1 if schedule == "1f1b" else 2) * world
    return Pipeline(rank_orders(schedule, world, micro_batches), stage_rank(schedule, world), n_stages,
                    costs_of(n_stages, **kwargs), overlaps(schedule, world, micro_batches))


def test_a_recompute_action_fills_the_wait_it_is_placed_before_and_delays_a_busy_action():
    p = Pipeline(TWO_MICRO_BATCHES, lambda s: s, 2, costs_of(2, latency=0.0, overhead=0.0))
    p.costs.checkpoints[1] = 0
    session = p.run("session")
    # rank 0 waits before BW 0.0 (stage 1's forward and full backward): micro-batch 1's two checkpoints fit there
    filled = p.run("placed", {("BW", 0, 0): [(0, 1, 2)]})
    assert filled.prefire_s[0] == pytest.approx(1.0)
    assert filled.waited[("BW", 0, 0)] == pytest.approx(session.waited[("BW", 0, 0)] - 1.0)
    assert filled.step_s == pytest.approx(session.step_s - 1.0)  # BW 0.1 no longer recomputes
    # placed before F 0.1, nothing waits there: the forward starts 1.0 later (rank 1, busy, does not feel it)
    busy = p.run("placed", {("F", 0, 1): [(0, 0, 2)]})
    start = {(e[0], e[1], e[2]): e[3] for events in busy.events for e in events}
    before = {(e[0], e[1], e[2]): e[3] for events in session.events for e in events}
    assert start[("F", 0, 1)] == pytest.approx(before[("F", 0, 1)] + 1.0)
    assert start[("F", 1, 1)] == pytest.approx(before[("F", 1, 1)])
    # a placement names more than is left: it runs what is left, once
    assert p.run("placed", {("F", 0, 1): [(0, 0, 5)]}).prefire_s[0] == pytest.approx(1.0)


@pytest.mark.parametrize("schedule, world", [("zbv", 2), ("zbv", 4), ("interleaved-zb", 4), ("dualpipev", 4),
                                             ("interleaved-1f1b", 4)])
def test_the_rules_recorded_as_a_placement_replay_as_bubble_mode_does(schedule, world):
    p = pipeline(schedule, world, skew=0.1)
    bubble = p.run("prefire")
    placed = p.run("placed", rules_placement(bubble))
    assert sum(bubble.prefire_s) > 0
    assert placed.step_s == pytest.approx(bubble.step_s)
    assert placed.prefire_s == pytest.approx(bubble.prefire_s)
    assert [[e[1:] for e in ev if e[0] != "wait"] for ev in placed.events] == \
        [[e[1:] for e in ev if e[0] != "wait"] for ev in bubble.events]


@pytest.mark.parametrize("schedule, world", [("zbv", 2), ("zbv", 4), ("interleaved-zb", 2), ("dualpipev", 2),
                                             ("interleaved-1f1b", 2), ("1f1b", 4)])
def test_no_placement_ends_a_step_before_the_floor(schedule, world):
    """Random placements of random checkpoints, each between its forward
    and its pass: none beats the floor; with prefires worth nothing
    (latency, no waits to fill) the session step is the floor's equal or
    above."""
    rng = random.Random(f"{schedule}{world}")
    p = pipeline(schedule, world, skew=0.2)
    floor = floor_s(p)
    session = p.run("session").step_s
    assert floor <= session + 1e-9
    for _ in range(40):
        placement = {}
        for order in p.orders:
            for kind, stage, mb in order:
                if kind in ("B", "BW") and rng.random() < 0.7:
                    first, last = order.index(("F", stage, mb)) + 1, order.index((kind, stage, mb))
                    point = order[rng.randint(first, last)]
                    placement.setdefault(point, []).append((stage, mb, rng.randint(1, 2)))
        assert p.run("placed", placement).step_s >= floor - 1e-9


def test_the_search_hides_what_a_wait_holds_and_the_floor_stays_below():
    """One micro-batch on 1F1B, a long wait for its gradient: the search
    puts both checkpoints of rank 0 into it."""
    p = Pipeline(rank_orders("1f1b", 2, 1), stage_rank("1f1b", 2), 2,
                 costs_of(2, f=1.0, b=3.0, w=0.0, latency=0.0, overhead=0.0))
    p.costs.checkpoints[1] = 0
    p.costs.action["session"][("BW", 1)] = p.costs.action["none"][("BW", 1)]
    found, result = search(p)
    assert found == {("BW", 0, 0): [(0, 0, 1), (0, 0, 1)]}
    assert result.step_s == pytest.approx(p.run("session").step_s - 1.0)  # 1 + 1 + 2 + 2
    # the floor: rank 0's session work (F 1.0, BW 3.0) from 0, rank 1's (F 1.0, BW 2.0) from 1.0: 4.0. It is a
    # bound, not a placement: rank 0 cannot begin its backward before rank 1's has ended
    assert floor_s(p) == pytest.approx(4.0) and result.step_s == pytest.approx(6.0)


@pytest.mark.parametrize("schedule, world", [("zbv", 2), ("interleaved-1f1b", 2), ("dualpipev", 2)])
def test_the_search_ends_no_later_than_the_rules_and_keeps_its_cap(schedule, world):
    p = pipeline(schedule, world, skew=0.3)
    rules = rules_placement(p.run("prefire"))
    rules_step = p.run("placed", rules).step_s
    _, found = search(p, rules)
    assert floor_s(p) - 1e-9 <= found.step_s <= rules_step + 1e-9
    _, capped = search(p, rules, max_held=1)
    assert max(held_ahead(capped)) <= 1
    nothing, none_ahead = search(p, rules, max_held=0)
    assert nothing == {} and none_ahead.step_s == pytest.approx(p.run("session").step_s)


# The oracle and the step's own recomputation (Note [The oracle fill and the recomputation's own time])


def test_the_oracle_hides_what_the_wait_before_a_pass_holds_and_no_more():
    """One micro-batch on 1F1B: rank 0 waits 1.0 for its gradient and holds
    1.5 of recomputation (two checkpoints of 0.75): the oracle hides 1.0,
    the rest stays in the pass, and the step lands on the floor."""
    p = Pipeline(rank_orders("1f1b", 2, 1), stage_rank("1f1b", 2), 2,
                 costs_of(2, f=0.5, b=2.0, w=0.0, checkpoint=0.75, checkpoints=2, latency=0.0, overhead=0.0))
    p.costs.checkpoints[1] = 0
    p.costs.action["session"][("BW", 1)] = p.costs.action["none"][("BW", 1)]
    session = p.run("session")
    assert session.waited[("BW", 0, 0)] == pytest.approx(1.0)  # rank 1: F 0.5, BW 0.5 (2.0 less 1.5 recomputed)
    oracle_s, hidden, _ = oracle(p)
    assert hidden == {(0, 0): pytest.approx(1.0)}
    assert oracle_s == pytest.approx(session.step_s - 1.0) == pytest.approx(floor_s(p))


@pytest.mark.parametrize("schedule, world", [("zbv", 2), ("zbv", 4), ("interleaved-zb", 4), ("dualpipev", 4),
                                             ("interleaved-1f1b", 4), ("1f1b", 4)])
def test_the_oracle_is_a_step_its_waits_hold_between_the_floor_and_session(schedule, world):
    """What the oracle hides fits the waits of its own replay (EDF meets
    every piece), and its step lies between the floor and session's."""
    p = pipeline(schedule, world, skew=0.2)
    oracle_s, hidden, _ = oracle(p)
    assert floor_s(p) - 1e-9 <= oracle_s <= p.run("session").step_s + 1e-9
    replayed = Pipeline(p.orders, p.stage_rank, p.n_stages, shortened(p, hidden), p.groups).run("session")
    assert replayed.step_s == pytest.approx(oracle_s)
    held = fill(p, replayed, hidden)
    assert all(held.get(key, 0.0) >= want - 1e-9 for key, want in hidden.items())
    assert sum(hidden.values()) > 0


def test_the_oracle_in_whole_checkpoints_places_what_the_wait_holds_rounded():
    """The 1F1B case above: the wait holds 1.0 of two checkpoints of 0.75,
    the whole placement puts one before the pass and leaves the other in
    it (two would delay the pass by 0.5 and be worse)."""
    p = Pipeline(rank_orders("1f1b", 2, 1), stage_rank("1f1b", 2), 2,
                 costs_of(2, f=0.5, b=2.0, w=0.0, checkpoint=0.75, checkpoints=2, latency=0.0, overhead=0.0))
    p.costs.checkpoints[1] = 0
    p.costs.action["session"][("BW", 1)] = p.costs.action["none"][("BW", 1)]
    found = oracle(p)
    assert oracle_placement(p, found) == {("BW", 0, 0): [(0, 0, 1)]}
    assert p.run("placed", oracle_placement(p, found)).step_s == pytest.approx(p.run("session").step_s - 0.75)


@pytest.mark.parametrize("schedule, world", [("zbv", 4), ("interleaved-zb", 4), ("dualpipev", 4), ("dualpipev", 8),
                                             ("interleaved-1f1b", 4), ("1f1b", 4)])
def test_the_oracle_in_whole_checkpoints_is_a_placement_the_runtime_takes_and_ends_near_the_oracle(schedule, world):
    """Every entry between its micro-batch's forward and pass on its rank
    (the runtime's own check), no micro-batch prefired more than it has;
    its step between the oracle's less a checkpoint's rounding and
    session's, and within 0.9 of the oracle's H (Note [The oracle fill in
    whole checkpoints])."""
    p = pipeline(schedule, world, skew=0.2)
    found = oracle(p)
    placement = oracle_placement(p, found)
    for order in p.orders:
        mine = {action: items for action, items in placement.items() if action in order}
        assert check_placement(mine, list(order)) == mine
    placed = {}
    for items in placement.values():
        for stage, mb, count in items:
            placed[(stage, mb)] = placed.get((stage, mb), 0) + count
    assert placed and all(n <= p.costs.checkpoints[stage] for (stage, _), n in placed.items())
    session, none = p.run("session").step_s, p.run("none").step_s
    step = p.run("placed", placement).step_s
    assert floor_s(p) - 1e-9 <= step <= session
    assert (session - step) >= 0.9 * (session - found.step_s)


def test_a_sessions_cost_beyond_recomputation_is_what_replaying_without_it_leaves_above_none():
    """Session mode's passes hold their recomputation and, here, 0.2 more per
    pass (its hooks); replayed without the recomputation, the step is none's
    plus that 0.2 on every backward of the critical path."""
    p = Pipeline(rank_orders("1f1b", 2, 1), stage_rank("1f1b", 2), 2,
                 costs_of(2, f=1.0, b=3.0, w=0.0, latency=0.0, overhead=0.0))
    assert without_recompute(p).step_s == pytest.approx(p.run("none").step_s)
    for stage in (0, 1):
        p.costs.action["session"][("BW", stage)] += 0.2
    free = without_recompute(p)
    assert free.step_s == pytest.approx(p.run("none").step_s + 0.4)  # BW 1 then BW 0, one after the other
    assert p.run("session").step_s - free.step_s == pytest.approx(2.0)  # each BW's two checkpoints of 0.5
