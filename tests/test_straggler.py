"""Straggler-resilient planning (Malleus): units, pipelines, layer and micro-batch programmes, the planner."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.cost.precision import PRECISIONS
from plait.plan import Pipeline, Plan, Stage, Strategy, uniform_plan
from plait.planner.straggler import (
    Unit,
    assign_layers,
    assign_micro_batches,
    build_pipelines,
    group_units,
    migration_seconds,
    moved_layers,
    plan_around_stragglers,
    snapped,
)
from plait.simulate import simulate
from plait.spec.cluster import dgx
from plait.spec.model import load_model

# ---- layers per stage ------------------------------------------------------------------------------------


def _brute_layers(per_layer, fixed, caps, layers):
    best = None
    for counts in itertools.product(*(range(1, c + 1) for c in caps)):
        if sum(counts) == layers:
            t = max(a * n + b for a, n, b in zip(per_layer, counts, fixed))
            best = t if best is None else min(best, t)
    return best


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.5, 6.0), min_size=2, max_size=4), st.data())
def test_layers_minimise_the_slowest_stage(per_layer, data) -> None:
    n = len(per_layer)
    fixed = data.draw(st.lists(st.floats(0.0, 3.0), min_size=n, max_size=n))
    caps = data.draw(st.lists(st.integers(1, 8), min_size=n, max_size=n))
    layers = data.draw(st.integers(n, 12))
    got = assign_layers(per_layer, fixed, caps, layers)
    expected = _brute_layers(per_layer, fixed, caps, layers)
    if expected is None:
        assert got is None
        return
    assert got is not None and sum(got) == layers and all(1 <= g <= c for g, c in zip(got, caps))
    assert max(a * g + b for a, g, b in zip(per_layer, got, fixed)) == pytest.approx(expected)


def test_a_slow_stage_gets_fewer_layers() -> None:
    counts = assign_layers([5.0, 1.0, 1.0, 1.0], [0.0] * 4, [32] * 4, 32)
    assert counts == [3, 10, 10, 9] or (sum(counts) == 32 and counts[0] == min(counts))
    assert max(f * c for f, c in zip([5.0, 1.0, 1.0, 1.0], counts)) <= 15.0 + 1e-9


def test_among_equally_fast_layer_cuts_the_closest_to_the_current_one_wins() -> None:
    # Healthy stages: 3+3+2 and 2+3+3 etc. are all as fast (max 3); the current cut is 2, 3, 3.
    assert assign_layers([1.0, 1.0, 1.0], [0.0] * 3, [8] * 3, 8, current=[2, 3, 3]) == [2, 3, 3]
    assert assign_layers([1.0, 1.0, 1.0], [0.0] * 3, [8] * 3, 8, current=[3, 3, 2]) == [3, 3, 2]


def test_layers_respect_the_memory_caps() -> None:
    assert assign_layers([1.0, 1.0], [0.0, 0.0], [2, 10], 8) == [2, 6]
    assert assign_layers([1.0, 1.0], [0.0, 0.0], [2, 3], 8) is None


# ---- micro-batches per pipeline -------------------------------------------------------------------------

def _brute_micro(slope, intercept, total, least):
    best = None
    for counts in itertools.product(*(range(total + 1) for _ in slope)):
        if sum(counts) != total or any(0 < c < least for c in counts):
            continue
        t = max((a * c + b for a, b, c in zip(slope, intercept, counts) if c), default=None)
        if t is not None:
            best = t if best is None else min(best, t)
    return best


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.2, 5.0), min_size=1, max_size=4), st.data())
def test_micro_batches_minimise_the_slowest_pipeline(slope, data) -> None:
    n = len(slope)
    intercept = data.draw(st.lists(st.floats(0.0, 4.0), min_size=n, max_size=n))
    total = data.draw(st.integers(1, 9))
    least = data.draw(st.integers(1, 3))
    got = assign_micro_batches(slope, intercept, total, least)
    expected = _brute_micro(slope, intercept, total, least)
    if expected is None:
        assert got is None
        return
    assert got is not None and sum(got) == total and all(c == 0 or c >= least for c in got)
    assert max(a * c + b for a, b, c in zip(slope, intercept, got) if c) == pytest.approx(expected, rel=1e-6)


def test_data_follows_speed_and_a_hopeless_pipeline_gets_none() -> None:
    assert assign_micro_batches([1.0, 1.0, 1.0, 5.0], [0.0] * 4, 16, 1) == [5, 5, 5, 1]
    assert assign_micro_batches([1.0, 1.0, 1.0, 50.0], [0.0] * 4, 16, 1)[3] == 0


# ---- units and pipelines --------------------------------------------------------------------------------

def test_stragglers_share_a_unit_and_a_shrunk_unit_keeps_the_healthy_members() -> None:
    c = dgx(1, 8, "A100-80GB").with_slow({1: 3.0, 6: 2.0})
    units = group_units(c, 2, False, (32, 8))
    slow = [u for u in units if u.factor > 1]
    assert len(slow) == 1 and set(slow[0].ranks) == {1, 6} and slow[0].factor == 3.0
    assert sorted(r for u in units for r in u.ranks) == list(range(8))
    shrunk = group_units(c.with_slow({6: 1.0}), 4, True, (32, 8))
    assert all(u.factor == 1.0 for u in shrunk) and sorted(u.tp for u in shrunk) == [2, 4]
    assert 1 not in {r for u in shrunk for r in u.ranks}


def test_pipelines_spread_or_concentrate_the_stragglers() -> None:
    units = [Unit((i,), 1.0) for i in range(6)] + [Unit((6,), 3.0), Unit((7,), 2.0)]
    spread = build_pipelines(units, 4, spread=True)
    assert [sum(u.factor > 1 for u in p) for p in spread] == [1, 1]
    together = build_pipelines(units, 4, spread=False)
    assert [sum(u.factor > 1 for u in p) for p in together] == [0, 2]
    assert together[1][0].factor == 3.0  # slowest first: fewest layers where most activations live
    assert build_pipelines(units[:3], 4, spread=False) == []


def test_snap_treats_small_slowdowns_as_healthy() -> None:
    c = dgx(1, 4, "A100-80GB").with_slow({0: 1.1, 1: 1.5})
    assert snapped(c).speed == (1.0, 1.5, 1.0, 1.0)


# ---- moves --------------------------------------------------------------------------------------------------

def _two_stage(cut: int, layers: int = 8) -> Plan:
    s = (Strategy(),)
    return Plan(model="m", seq_len=8, global_batch=4, precision="fp32", pipelines=(Pipeline(
        stages=(Stage(layers=(0, cut), ranks=(0,), strategies=s), Stage(layers=(cut, layers), ranks=(1,), strategies=s)),
        micro_batches=4, micro_batch_sequences=1),))


def test_moved_layers_and_their_migration_time() -> None:
    assert moved_layers(_two_stage(4), _two_stage(4)) == 0
    assert moved_layers(_two_stage(4), _two_stage(3)) == 1  # layer 3 goes to rank 1
    assert moved_layers(_two_stage(4), _two_stage(6)) == 2
    spec = load_model("llama:layers=8,hidden=128,heads=4,kv_heads=2,ffn=384,vocab=512")
    c = dgx(1, 2, "A100-80GB")
    one = migration_seconds(_two_stage(4), _two_stage(3), spec, c, "fp32")
    fp32 = PRECISIONS["fp32"]
    assert one == pytest.approx(spec.block_params * (fp32.param + fp32.optimizer) / c.inter.bandwidth)
    assert migration_seconds(_two_stage(4), _two_stage(6), spec, c, "fp32") == pytest.approx(2 * one)


def test_a_change_of_zero_sharding_moves_state_too() -> None:
    """ZeRO-3 over two ranks -> two pipelines with ZeRO-1: same layers on the same ranks, but every rank now
    needs whole weights (it held halves)."""
    spec = load_model("llama:layers=4,hidden=128,heads=4,kv_heads=2,ffn=384,vocab=512")
    sharded = Plan(model=spec.name, seq_len=8, global_batch=4, precision="fp32", pipelines=(Pipeline(
        stages=(Stage(layers=(0, 4), ranks=(0, 1), strategies=(Strategy(dp=2, zero=3),)),),
        micro_batches=2, micro_batch_sequences=2),))
    replicas = Plan(model=spec.name, seq_len=8, global_batch=4, precision="fp32", pipelines=tuple(
        Pipeline(stages=(Stage(layers=(0, 4), ranks=(r,), strategies=(Strategy(zero=1),)),), micro_batches=2,
                 micro_batch_sequences=1) for r in (0, 1)))
    assert moved_layers(sharded, sharded) == 0
    assert moved_layers(sharded, replicas) == 8
    fp32, c = PRECISIONS["fp32"], dgx(1, 2, "A100-80GB")
    expected = 4 * spec.block_params * (fp32.param + fp32.optimizer / 2) / c.inter.bandwidth
    assert migration_seconds(sharded, replicas, spec, c, "fp32") == pytest.approx(expected)


# ---- the planner -------------------------------------------------------------------------------------------

LLAMA = load_model("llama2-7b")
SMALL = "llama:layers=8,hidden=1024,heads=16,kv_heads=8,ffn=2816,vocab=32000"


@pytest.fixture(scope="module")
def healthy_plan() -> Plan:
    c = dgx(2, 8, "A100-80GB")
    return uniform_plan("tp=2,pp=2,dp=4,mbs=1,gbs=64", LLAMA, c, 4096)


@pytest.mark.parametrize("factor", [2.0, 5.0])
def test_replanning_around_one_straggler_recovers_most_of_the_healthy_speed(healthy_plan, factor) -> None:
    c = dgx(2, 8, "A100-80GB")
    healthy = simulate(healthy_plan, LLAMA, c).iteration_time_s
    slow = c.with_slow({3: factor})
    static = simulate(healthy_plan, LLAMA, slow).iteration_time_s
    r = plan_around_stragglers(LLAMA, slow, 4096, 64, current=healthy_plan)
    assert r.plan is not None and r.report.fits
    assert r.report.iteration_time_s == pytest.approx(simulate(r.plan, LLAMA, slow).iteration_time_s)
    assert static / r.report.iteration_time_s > (1.3 if factor == 2.0 else 2.0)
    assert r.report.iteration_time_s < 1.35 * healthy
    assert r.moved_layers > 0 and r.migration_s > 0
    assert r.solve_time_s > 0  # recorded; how fast the solve is belongs in benchmarks/


def test_no_straggler_keeps_the_current_plan(healthy_plan) -> None:
    c = dgx(2, 8, "A100-80GB").with_slow({5: 1.1})  # below the snap threshold
    r = plan_around_stragglers(LLAMA, c, 4096, 64, current=healthy_plan)
    assert r.report.iteration_time_s <= simulate(healthy_plan, LLAMA, c).iteration_time_s * 1.01
    if r.plan != healthy_plan:
        assert r.report.iteration_time_s < simulate(healthy_plan, LLAMA, c).iteration_time_s


def test_a_hopeless_device_is_left_out() -> None:
    c = dgx(1, 4, "A100-80GB").with_slow({2: 50.0})
    model = load_model(SMALL)
    r = plan_around_stragglers(model, c, 1024, 16)
    assert r.plan is not None and 2 not in r.plan.ranks
    assert r.report.iteration_time_s < simulate(uniform_plan("dp=4,gbs=16", model, c, 1024), model, c).iteration_time_s / 5


def test_the_straggler_planner_emits_executable_plans() -> None:
    from plait.executable import unsupported

    c = dgx(1, 4, "A100-80GB").with_slow({2: 3.0})
    model = load_model(SMALL)
    r = plan_around_stragglers(model, c, 1024, 16)
    assert r.plan is not None and unsupported(r.plan, model) is None


# ---- the command line ------------------------------------------------------------------------------------

def test_plan_with_slow_devices_reports_static_and_replanned() -> None:
    from typer.testing import CliRunner

    from plait.cli import app

    args = ["plan", "--model", SMALL, "--cluster", "1x4xA100-80GB", "--seq-len", "1024", "--global-batch", "16",
            "--slow", "2:5.0"]
    res = CliRunner().invoke(app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)["straggler"]
    assert s["static_time_s"] > 2 * s["replanned_time_s"]
    assert s["replanned_time_s"] >= s["no_straggler_time_s"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0 and "static" in res.stdout and "re-planned" in res.stdout
