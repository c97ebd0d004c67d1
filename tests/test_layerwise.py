"""Tests for plait.planner.layerwise: the per-layer strategy DP against brute force."""

from __future__ import annotations

import itertools
import math
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.errors import PlaitError
from plait.planner import layerwise
from plait.planner.layerwise import (
    LayerSolution,
    prune_dominated,
    solve_layers,
    solve_layers_all_budgets,
    solve_layers_brute_force,
    solve_layers_pareto,
)

INF = math.inf
# Few distinct values so that ties are common; the odd float breaks them.
TIMES = st.one_of(st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0, 3.0]), st.floats(0.0, 5.0))
SWITCHES = st.one_of(st.sampled_from([0.0, 0.0, 0.25, 1.0, INF]), st.floats(0.0, 2.0))


@st.composite
def masks(draw, shape: tuple[int, int]) -> np.ndarray:
    """A sparse boolean mask (about one entry in four set)."""
    bits = draw(st.lists(st.sampled_from([False, False, False, True]), min_size=shape[0] * shape[1],
                         max_size=shape[0] * shape[1]))
    return np.array(bits, dtype=bool).reshape(shape)


@st.composite
def instances(draw, max_layers: int = 6, max_strategies: int = 5, identical: bool = False):
    """(time, memory, transition, budget, allowed) with forbidden pairs, ties and zeros."""
    n_layers = draw(st.integers(1, max_layers))
    n_strat = draw(st.integers(1, max_strategies))
    if identical:
        time = np.tile(np.array(draw(st.lists(TIMES, min_size=n_strat, max_size=n_strat))), (n_layers, 1))
        memory = np.tile(np.array(draw(st.lists(st.integers(0, 4), min_size=n_strat, max_size=n_strat))),
                         (n_layers, 1))
    else:
        time = np.array(draw(st.lists(TIMES, min_size=n_layers * n_strat, max_size=n_layers * n_strat)))
        time = time.reshape(n_layers, n_strat)
        memory = np.array(draw(st.lists(st.integers(0, 5), min_size=time.size, max_size=time.size)))
        memory = memory.reshape(time.shape)
        if draw(st.booleans()):
            time[draw(masks(time.shape))] = INF
    kind = draw(st.sampled_from(["zero", "random", "uniform", "layouts"]))
    if kind == "zero":
        transition = np.zeros((n_strat, n_strat))
    elif kind == "uniform":
        transition = np.full((n_strat, n_strat), draw(st.sampled_from([0.25, 1.0, 10.0])))
    elif kind == "layouts":  # strategies of one layout switch freely (the search's re-layout costs)
        layout = np.array(draw(st.lists(st.integers(0, 2), min_size=n_strat, max_size=n_strat)))
        between = np.array(draw(st.lists(SWITCHES, min_size=9, max_size=9))).reshape(3, 3)
        transition = np.where(layout[:, None] != layout[None, :], between[layout][:, layout], 0.0)
    else:
        transition = np.array(draw(st.lists(SWITCHES, min_size=n_strat**2, max_size=n_strat**2)))
        transition = transition.reshape(n_strat, n_strat)
    np.fill_diagonal(transition, 0.0)
    allowed = None
    if not identical and draw(st.booleans()):
        allowed = ~draw(masks(time.shape))
    # Budgets from just below the least possible memory to just above the most.
    budget = draw(st.integers(max(0, int(memory.min(axis=1).sum()) - 1), int(memory.max(axis=1).sum()) + 1))
    return time, memory, transition, budget, allowed


def recompute(time, memory, transition, choice, allowed=None) -> tuple[float, int]:
    """Time (s) and memory (units) of an assignment, straight from the definition."""
    assert len(choice) == time.shape[0]
    for layer, s in enumerate(choice):
        assert 0 <= s < time.shape[1]
        assert allowed is None or allowed[layer, s]
    total = sum(float(time[layer, s]) for layer, s in enumerate(choice))
    total += sum(float(transition[a, b]) for a, b in itertools.pairwise(choice) if a != b)
    used = sum(int(memory[layer, s]) for layer, s in enumerate(choice))
    return total, used


def check_against_brute_force(time, memory, transition, budget, allowed) -> LayerSolution | None:
    ref = solve_layers_brute_force(time, memory, transition, budget, allowed)
    for cube_limit in (layerwise._CUBE_LIMIT, 0):  # both relaxation code paths
        with mock.patch.object(layerwise, "_CUBE_LIMIT", cube_limit):
            got = solve_layers(time, memory, transition, budget, allowed)
        assert (got is None) == (ref is None), (got, ref)
        if got is None:
            continue
        assert got.time == pytest.approx(ref.time, abs=1e-9)
        total, used = recompute(time, memory, transition, got.choice, allowed)
        assert math.isfinite(total)
        assert used == got.memory <= budget
        assert total == pytest.approx(got.time, abs=1e-9)
    return ref


# ------------------------------------------------------------------ exactness


@settings(max_examples=400, deadline=None)
@given(instances())
def test_matches_brute_force(inst):
    check_against_brute_force(*inst)


@settings(max_examples=100, deadline=None)
@given(instances(identical=True))
def test_matches_brute_force_identical_layers(inst):
    check_against_brute_force(*inst)


@settings(max_examples=100, deadline=None)
@given(instances(max_layers=4, max_strategies=4))
def test_all_budgets_agrees_with_solve_and_is_monotone(inst):
    time, memory, transition, budget, allowed = inst
    curve = solve_layers_all_budgets(time, memory, transition, budget, allowed)
    assert curve.shape == (budget + 1,)
    assert np.all(curve[1:] <= curve[:-1])
    for u in range(budget + 1):
        sol = solve_layers(time, memory, transition, u, allowed)
        if sol is None:
            assert curve[u] == INF
        else:
            assert curve[u] == pytest.approx(sol.time, abs=1e-9)


@settings(max_examples=60, deadline=None)
@given(instances(max_layers=5, max_strategies=4))
def test_more_budget_never_slower(inst):
    time, memory, transition, budget, allowed = inst
    times = []
    for u in range(budget + 3):
        sol = solve_layers(time, memory, transition, u, allowed)
        times.append(INF if sol is None else sol.time)
    assert all(b <= a + 1e-12 for a, b in itertools.pairwise(times))


# ------------------------------------------------------------------ pruning


@settings(max_examples=200, deadline=None)
@given(instances(identical=True), st.booleans())
def test_pruning_keeps_the_optimum(inst, free_switching):
    time, memory, transition, budget, _ = inst
    if free_switching:
        transition = np.zeros_like(transition)
    keep = prune_dominated(time[0], memory[0], None if free_switching else transition)
    assert np.all(np.diff(keep) > 0)
    full = solve_layers_brute_force(time, memory, transition, budget)
    pruned = solve_layers(time[:, keep], memory[:, keep], transition[np.ix_(keep, keep)], budget)
    assert (full is None) == (pruned is None)
    if full is not None:
        assert pruned.time == pytest.approx(full.time, abs=1e-9)
        choice = tuple(int(keep[s]) for s in pruned.choice)  # back to original indices
        total, used = recompute(time, memory, transition, choice)
        assert used <= budget and total == pytest.approx(full.time, abs=1e-9)


def test_prune_hand_built():
    #              0    1    2    3    4    5
    time = np.array([1.0, 2.0, 1.0, 0.5, 1.0, INF])
    memory = np.array([4, 4, 5, 8, 4, 0])
    # 1 is slower at equal memory, 2 uses more memory at equal time, 4 duplicates 0,
    # 5 is unusable; 3 is on the Pareto front.
    assert prune_dominated(time, memory).tolist() == [0, 3]
    # Switching into 0 is dear, so its twin 4 (free to enter) is no longer a duplicate; 4 now
    # dominates 1 and 2 in 0's place.
    transition = np.zeros((6, 6))
    transition[:, 0] = 5.0
    transition[0, 0] = 0.0
    assert prune_dominated(time, memory, transition).tolist() == [0, 3, 4]
    # 0 beats 1 on (time, memory), but leaving 2 for 0 is dear, so 1 must stay.
    time, memory = np.array([1.0, 2.0, 3.0]), np.array([1, 1, 0])
    assert prune_dominated(time, memory).tolist() == [0, 2]
    transition = np.array([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [5.0, 0.0, 0.0]])
    assert prune_dominated(time, memory, transition).tolist() == [0, 1, 2]
    assert prune_dominated(np.array([INF]), np.array([0])).tolist() == []
    assert prune_dominated(np.array([]), np.array([], dtype=int)).tolist() == []


def test_prune_ignores_switches_between_the_pair():
    # a=0 dominates b=1; the a<->b switch costs are irrelevant (b is replaced everywhere).
    time, memory = np.array([1.0, 2.0]), np.array([1, 1])
    transition = np.array([[0.0, 7.0], [3.0, 0.0]])
    assert prune_dominated(time, memory, transition).tolist() == [0]


# ------------------------------------------------------------------ hand-built cases


def test_transitions_make_mixing_worse_than_uniform():
    # Each layer prefers the other strategy than its neighbour: mixing wins only without switches.
    time = np.array([[1.0, 2.0], [2.0, 1.0], [1.0, 2.0], [2.0, 1.0]])
    memory = np.zeros((4, 2), dtype=int)
    free = solve_layers(time, memory, np.zeros((2, 2)), 0)
    assert free == LayerSolution(time=4.0, memory=0, choice=(0, 1, 0, 1))
    dear = solve_layers(time, memory, np.array([[0.0, 1.5], [1.5, 0.0]]), 0)
    assert dear.time == 6.0 and dear.choice in {(0, 0, 0, 0), (1, 1, 1, 1)}
    # Asymmetric: 1 -> 0 is free, 0 -> 1 costs 5 s; only the free direction is worth mixing.
    asym = np.array([[0.0, 5.0], [0.0, 0.0]])
    assert solve_layers(np.array([[2.0, 1.0], [1.0, 2.0]]), memory[:2], asym, 0).choice == (1, 0)
    costly = solve_layers(np.array([[1.0, 2.0], [2.0, 1.0]]), memory[:2], asym, 0)
    assert costly.time == 3.0 and costly.choice in {(0, 0), (1, 1)}


def test_tight_budget_forces_a_galvatron_mix():
    # Strategy 0 (plain data parallel): 1.0 s, 4 units. Strategy 1 (sharded + recompute): 1.5 s, 1 unit.
    time = np.tile([1.0, 1.5], (4, 1))
    memory = np.tile([4, 1], (4, 1))
    free = np.zeros((2, 2))
    assert solve_layers(time, memory, free, 16) == LayerSolution(4.0, 16, (0, 0, 0, 0))
    assert solve_layers(time, memory, free, 4) == LayerSolution(6.0, 4, (1, 1, 1, 1))
    assert solve_layers(time, memory, free, 3) is None
    mix = solve_layers(time, memory, free, 10)  # 3 * (#fast) <= 6: two fast layers
    assert mix.time == 5.0 and mix.memory == 10 and sorted(mix.choice) == [0, 0, 1, 1]
    # With a switching cost the fast layers are grouped: exactly one switch.
    grouped = solve_layers(time, memory, np.array([[0.0, 0.1], [0.1, 0.0]]), 10)
    assert grouped.time == pytest.approx(5.1)
    assert sum(a != b for a, b in itertools.pairwise(grouped.choice)) == 1
    curve = solve_layers_all_budgets(time, memory, free, 16)
    assert int(np.argmax(np.isfinite(curve))) == 4  # smallest memory at which anything fits
    assert curve[[4, 7, 10, 13, 16]].tolist() == [6.0, 5.5, 5.0, 4.5, 4.0]


# ------------------------------------------------------------------ edge cases


def test_no_layers():
    empty = np.zeros((0, 3))
    sol = solve_layers(empty, empty.astype(int), np.zeros((3, 3)), 0)
    assert sol == LayerSolution(time=0.0, memory=0, choice=())
    assert solve_layers_all_budgets(empty, empty.astype(int), np.zeros((3, 3)), 2).tolist() == [0, 0, 0]
    assert solve_layers_brute_force(empty, empty.astype(int), np.zeros((3, 3)), 0) == sol


def test_single_strategy_and_zero_budget():
    time, memory = np.array([[1.0], [2.0]]), np.array([[0], [0]])
    assert solve_layers(time, memory, np.zeros((1, 1)), 0) == LayerSolution(3.0, 0, (0, 0))
    assert solve_layers(time, memory + 1, np.zeros((1, 1)), 1) is None
    assert solve_layers(time, memory + 1, np.zeros((1, 1)), 2) == LayerSolution(3.0, 2, (0, 0))


def test_forbidden_and_oversized():
    time = np.array([[1.0, INF], [INF, 2.0]])
    memory = np.array([[1, 0], [0, 1]])
    transition = np.array([[0.0, 0.5], [0.0, 0.0]])
    assert solve_layers(time, memory, transition, 2) == LayerSolution(3.5, 2, (0, 1))
    assert solve_layers(time, memory, transition, 1) is None
    assert solve_layers(time, memory, transition, 2, allowed=np.array([[True, True], [True, False]])) is None
    assert solve_layers(np.full((3, 2), INF), np.zeros((3, 2), int), np.zeros((2, 2)), 5) is None
    # A strategy bigger than the whole budget is simply never picked.
    big = solve_layers(np.array([[0.1, 1.0]]), np.array([[99, 1]]), np.zeros((2, 2)), 5)
    assert big == LayerSolution(1.0, 1, (1,))
    # An infinite switch cost forbids that switch.
    blocked = solve_layers(np.array([[0.0, 9.0], [9.0, 0.0]]), np.zeros((2, 2), int),
                           np.array([[0.0, INF], [INF, 0.0]]), 0)
    assert blocked.time == 9.0
    assert solve_layers(np.zeros((2, 0)), np.zeros((2, 0), int), np.zeros((0, 0)), 3) is None
    no_strategies = solve_layers_all_budgets(np.zeros((2, 0)), np.zeros((2, 0), int), np.zeros((0, 0)), 3)
    assert np.all(np.isinf(no_strategies))


def test_diagonal_of_transition_is_ignored():
    time, memory = np.ones((3, 2)), np.zeros((3, 2), int)
    sol = solve_layers(time, memory, np.array([[7.0, 1.0], [1.0, 7.0]]), 0)
    assert sol.time == 3.0


@pytest.mark.parametrize(
    ("time", "memory", "transition", "budget"),
    [
        (np.ones(3), np.ones(3, int), np.zeros((3, 3)), 1),  # time not 2-D
        (np.ones((2, 2)), np.ones((2, 3), int), np.zeros((2, 2)), 1),  # shape mismatch
        (np.ones((2, 2)), -np.ones((2, 2), int), np.zeros((2, 2)), 1),  # negative memory
        (np.ones((2, 2)), np.full((2, 2), 0.5), np.zeros((2, 2)), 1),  # fractional memory
        (np.full((2, 2), np.nan), np.ones((2, 2), int), np.zeros((2, 2)), 1),  # NaN time
        (-np.ones((2, 2)), np.ones((2, 2), int), np.zeros((2, 2)), 1),  # negative time
        (np.ones((2, 2)), np.ones((2, 2), int), -np.ones((2, 2)), 1),  # negative switch
        (np.ones((2, 2)), np.ones((2, 2), int), np.zeros((3, 3)), 1),  # transition shape
        (np.ones((2, 2)), np.ones((2, 2), int), np.zeros((2, 2)), -1),  # negative budget
        (np.ones((2, 2)), np.ones((2, 2), int), np.zeros((2, 2)), 1.5),  # fractional budget
    ],
)
def test_bad_input_is_rejected(time, memory, transition, budget):
    with pytest.raises(PlaitError):
        solve_layers(time, memory, transition, budget)


def test_larger_instance_is_consistent():
    rng = np.random.default_rng(0)
    time = rng.random((40, 24))
    memory = rng.integers(0, 12, (40, 24))
    transition = rng.random((24, 24)) * 0.05
    curve = solve_layers_all_budgets(time, memory, transition, 300)
    for budget in (0, 50, 120, 300):
        sol = solve_layers(time, memory, transition, budget)
        with mock.patch.object(layerwise, "_CUBE_LIMIT", 0):
            looped = solve_layers(time, memory, transition, budget)
        if sol is None:
            assert looped is None and curve[budget] == INF
            continue
        total, used = recompute(time, memory, transition, sol.choice)
        assert used == sol.memory <= budget
        assert total == pytest.approx(sol.time, abs=1e-9) == curve[budget] == looped.time


# ------------------------------------------------------------------ real-valued memory (Pareto lists)

SLACKS = st.sampled_from([0.0, 0.01, 0.2, 0.6])


def recompute_real(time, memory, transition, choice) -> tuple[float, float]:
    """Time (s) and memory of an assignment, memory summed layer by layer as the solver does."""
    total, _ = recompute(time, np.zeros(time.shape, dtype=int), transition, choice)
    used = 0.0
    for layer, s in enumerate(choice):
        used += float(memory[layer, s])
    return total, used


def best_time_real(time, memory, transition, budget, allowed=None) -> float:
    """Least time over every assignment within ``budget`` (``inf`` if none fits), by enumeration;
    memory summed layer by layer (a running sum) as the solver does."""
    n_layers, n_strat = time.shape
    choices = np.array(list(itertools.product(range(n_strat), repeat=n_layers)), dtype=np.intp)
    layers = np.arange(n_layers)
    switch = np.array(transition, dtype=float)
    np.fill_diagonal(switch, 0.0)
    totals = time[layers, choices].sum(axis=1) + switch[choices[:, :-1], choices[:, 1:]].sum(axis=1)
    used = np.cumsum(memory[layers, choices], axis=1)[:, -1]
    ok = used <= budget
    if allowed is not None:
        ok &= allowed[layers, choices].all(axis=1)
    return float(totals[ok].min()) if ok.any() else INF


def check_pareto(time, memory, transition, budget, allowed, slack) -> LayerSolution | None:
    """The answer fits, is priced right, and is at least as fast as the optimum under (1 - slack) x
    budget (the optimum itself when slack is 0), on both merge paths of the free-switching solver."""
    exact = best_time_real(time, memory, transition, budget, allowed)
    loose = best_time_real(time, memory, transition, (1 - slack) * budget, allowed)
    for pair_limit in (layerwise._PAIR_LIMIT, 0):  # merging powers of two, or one layer at a time
        with mock.patch.object(layerwise, "_PAIR_LIMIT", pair_limit):
            got = solve_layers_pareto(time, memory, transition, budget, allowed, slack=slack)
        if got is None:
            assert loose == INF
            continue
        total, used = recompute_real(time, memory, transition, got.choice)
        assert used == got.memory <= budget
        assert total == pytest.approx(got.time, abs=1e-9)
        assert exact - 1e-9 <= got.time <= loose + 1e-9
        if allowed is not None:
            assert all(allowed[layer, s] for layer, s in enumerate(got.choice))
    return got


def test_switch_classes_group_strategies_with_the_same_switches():
    trans = np.array([[0, 1, 0, 2], [1, 0, 1, 3], [0, 1, 0, 2], [5, 5, 5, 0]], dtype=float)
    classes = layerwise._switch_classes(trans)
    assert classes is not None and classes[0] == classes[2] and len(set(classes.tolist())) == 3
    assert layerwise._switch_classes(np.array([[0, 1.0], [2.0, 0]])) is None


@settings(max_examples=300, deadline=None)
@given(instances())
def test_pareto_matches_brute_force(inst):
    time, memory, transition, budget, allowed = inst
    ref = solve_layers_brute_force(time, memory, transition, budget, allowed)
    got = check_pareto(time, memory.astype(float), transition, budget, allowed, 0.0)
    assert (got is None) == (ref is None)
    if got is not None:
        assert got.time == pytest.approx(ref.time, abs=1e-9)


@settings(max_examples=100, deadline=None)
@given(instances(identical=True))
def test_pareto_matches_brute_force_identical_layers(inst):
    time, memory, transition, budget, allowed = inst
    ref = solve_layers_brute_force(time, memory, transition, budget, allowed)
    got = check_pareto(time, memory.astype(float), transition, budget, allowed, 0.0)
    assert (got is None) == (ref is None)


@settings(max_examples=200, deadline=None)
@given(instances(max_layers=5, max_strategies=4), SLACKS, st.integers(0, 2**32 - 1))
def test_pareto_slack_bounds_the_loss(inst, slack, seed):
    time, memory, transition, budget, allowed = inst
    jitter = np.random.default_rng(seed).random(memory.shape)  # real-valued memory
    check_pareto(time, memory + jitter, transition, budget + 0.5, allowed, slack)


TIGHT_LAYERS = 20
MIB = 2**20
FAST_BYTES, SLOW_BYTES = 1310 * MIB, 1010 * MIB  # per layer; whole MiB keep the sums exact
TIGHT_BUDGET = 25730 * MIB  # 18 fast + 2 slow layers use 25600 MiB: 99.5% of it
GRID_UNITS = 256  # the coarse grid the bytes were once rounded up to


@pytest.mark.parametrize("switch", [0.0, 0.3])
def test_tight_budget_is_packed(switch):
    """18 of 20 layers fit the fast strategy; rounding each layer's bytes up to 1/256 of the
    budget leaves room for 12 only (92.5% of the budget). The real-valued solver finds the
    optimum, and its bytes (summed exactly) stay within the budget."""
    time = np.tile([1.0, 2.0], (TIGHT_LAYERS, 1))
    memory = np.tile([float(FAST_BYTES), float(SLOW_BYTES)], (TIGHT_LAYERS, 1))
    transition = np.array([[0.0, switch], [switch, 0.0]])
    unit = TIGHT_BUDGET / GRID_UNITS
    coarse = solve_layers(time, np.ceil(memory / unit).astype(int), transition, GRID_UNITS)
    coarse_bytes = sum(memory[layer, s] for layer, s in enumerate(coarse.choice))
    assert coarse.choice.count(0) == 12 and coarse_bytes / TIGHT_BUDGET < 0.93
    for slack in (0.0, 0.01):
        sol = solve_layers_pareto(time, memory, transition, TIGHT_BUDGET, slack=slack)
        assert sol.choice.count(0) == 18
        assert sol.time == pytest.approx(18 * 1.0 + 2 * 2.0 + switch)
        assert 0.99 * TIGHT_BUDGET <= sol.memory <= TIGHT_BUDGET
        assert math.fsum(memory[layer, s] for layer, s in enumerate(sol.choice)) == sol.memory
    # One MiB less than the optimum's 25600 and only 17 fast layers fit.
    assert solve_layers_pareto(time, memory, transition, 25599 * MIB).choice.count(0) == 17


def test_pareto_halves_free_layers_and_handles_edges():
    # Free switching: each half of the layers gets half of each strategy's, in blocks.
    time = np.tile([1.0, 3.0], (10, 1))
    memory = np.tile([4.0, 1.0], (10, 1))
    sol = solve_layers_pareto(time, memory, np.zeros((2, 2)), 22.0)  # 4 fast, 6 slow
    assert sol.choice.count(0) == 4 and sol.memory == 22.0
    assert sol.choice[:5].count(0) == 2 and sol.choice[5:].count(0) == 2
    assert sum(a != b for a, b in itertools.pairwise(sol.choice)) <= 2
    # Unconstrained: every layer's fastest strategy, the least memory among ties.
    tie = solve_layers_pareto(np.array([[1.0, 1.0]]), np.array([[3.0, 2.0]]), np.zeros((2, 2)), 9.0)
    assert tie == LayerSolution(1.0, 2.0, (1,))
    empty = np.zeros((0, 2))
    assert solve_layers_pareto(empty, empty, np.zeros((2, 2)), 0.0) == LayerSolution(0.0, 0.0, ())
    assert solve_layers_pareto(np.zeros((2, 0)), np.zeros((2, 0)), np.zeros((0, 0)), 3.0) is None
    assert solve_layers_pareto(time, memory, np.zeros((2, 2)), 9.9) is None  # 10 layers need >= 10


@pytest.mark.parametrize(
    ("memory", "budget", "slack"),
    [
        (np.full((2, 2), -1.0), 1.0, 0.0),  # negative memory
        (np.full((2, 2), np.inf), 1.0, 0.0),  # infinite memory
        (np.ones((2, 3)), 1.0, 0.0),  # shape mismatch
        (np.ones((2, 2)), -1.0, 0.0),  # negative budget
        (np.ones((2, 2)), np.inf, 0.0),  # infinite budget
        (np.ones((2, 2)), 1.0, 1.0),  # slack out of range
        (np.ones((2, 2)), 1.0, -0.1),
    ],
)
def test_pareto_bad_input_is_rejected(memory, budget, slack):
    with pytest.raises(PlaitError):
        solve_layers_pareto(np.ones((2, 2)), memory, np.zeros((2, 2)), budget, slack=slack)


def _class_survivors_by_hand(time: np.ndarray, memory: np.ndarray, cls: np.ndarray, limit: float, merge: float,
                             slowest: float) -> list[tuple[int, int]]:
    """What a class's list keeps, one candidate at a time: every candidate of the class's rows in order of
    memory (ties in row, then column order), kept when faster than all before it, within `limit` and `slowest`,
    and the last such of its `merge`-wide memory bucket."""
    kept: list[tuple[int, int]] = []
    for c in sorted(set(cls.tolist())):
        cells = sorted((memory[r, k], r, k) for r in range(len(cls)) if cls[r] == c
                       for k in range(time.shape[1]))
        best = math.inf
        front = []
        for m, r, k in cells:
            if time[r, k] < best and m <= limit and time[r, k] <= slowest:
                front.append((r, k))
            best = min(best, time[r, k])
        for i, (r, k) in enumerate(front):
            bucket = (lambda x: math.floor(x / merge)) if merge > 0 else (lambda x: x)
            if i + 1 == len(front) or bucket(memory[front[i + 1]]) != bucket(memory[r, k]):
                kept.append((r, k))
    return kept


def test_class_survivors_keep_what_one_list_per_class_keeps() -> None:
    """The class lists are merged from each row's own survivors; they keep exactly what sorting every
    candidate of a class into one list keeps (the rows arrive memory-ascending, as a front's extensions do)."""
    rng = np.random.default_rng(7)
    for _ in range(3000):
        rows, width = int(rng.integers(1, 7)), int(rng.integers(1, 20))
        memory = np.sort(rng.integers(0, 40, (rows, width)) / rng.choice([1, 3]), axis=1).astype(float)
        time = rng.integers(0, 25, (rows, width)).astype(float) if rng.random() < 0.5 \
            else rng.random((rows, width)) * 25
        time[rng.random((rows, width)) < 0.1] = math.inf
        cls = rng.integers(0, 3, rows)
        limit, slowest = rng.choice([math.inf, 25.0]), rng.choice([math.inf, 18.0])
        merge = rng.choice([0.0, 1.0, 4.0, 0.37])
        got = layerwise._class_survivors(time, memory, cls, limit, merge, slowest)
        expected = _class_survivors_by_hand(time, memory, cls, limit, merge, slowest)
        assert list(zip(*(a.tolist() for a in got))) == expected
