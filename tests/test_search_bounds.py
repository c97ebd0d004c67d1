"""The lower bounds that let the search skip work: never above what the simulator predicts, so skipping by
them finds the plan that simulating everything finds."""

from __future__ import annotations

import pytest

from plait.cost.calibration import calibration_for
from plait.plan import uniform_plan
from plait.planner.baselines import Candidate, grid_layouts, run_baseline
from plait.planner.engine import DEFAULT_LIMITS, _Config, _partition_search
from plait.simulate import finish, plan_floor, price_plan, simulate
from plait.spec.cluster import dgx
from plait.spec.model import PRESETS

CASES = [("gpt3-1.3b", 1, "A100-40GB", 2048, 64), ("llama2-13b", 4, "H100-80GB", 4096, 256),
         ("gemma2-9b", 2, "A100-80GB", 4096, 64), ("t5-11b", 2, "A100-80GB", 512, 128)]
IDS = [f"{c[0]}-{c[1] * 8}gpu" for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_grid_floors_never_exceed_the_price_and_pruning_keeps_the_best(case: tuple) -> None:
    """Every layout's floor (seconds and bytes) is at most what pricing and simulating it give, and the
    baseline, which prices in floor order and skips what cannot fit or win, finds the fastest layout of
    the enumeration (each group cut after its first micro-batch size that does not fit), pricing fewer."""
    name, nodes, gpu, seq, gbs = case
    model, cluster = PRESETS[name], dgx(nodes, 8, gpu)
    cal = calibration_for(cluster.gpu.name)
    fastest = None
    enumerated = 0
    for group in grid_layouts(model, cluster, seq, gbs):
        for text in group:
            plan = uniform_plan(text, model, cluster, seq)
            p = price_plan(plan, model, cluster, validate=False)
            report = finish(p, detail=False)
            floor = plan_floor(plan, model, cluster, cal)
            assert floor.seconds <= p.lower_bound_s() * (1 + 1e-12), text
            assert floor.peak_bytes <= p.peak_bytes * (1 + 1e-12), text
            assert p.lower_bound_s() <= report.iteration_time_s * (1 + 1e-12), text
            assert report.iteration_time_s == pytest.approx(finish(p).iteration_time_s, rel=1e-12)
            enumerated += 1
            if not report.fits:
                break
            if fastest is None or report.iteration_time_s < fastest:
                fastest = report.iteration_time_s
    best, evaluated = run_baseline("megatron-grid", model, cluster, seq, gbs)
    assert 0 < evaluated < enumerated
    if fastest is not None:
        assert best is not None and best.report.iteration_time_s == fastest


def test_grid_with_nothing_fitting_returns_the_leanest_layout() -> None:
    """When no layout fits, the baseline still prices enough to return the one of least peak memory."""
    model, cluster, seq, gbs = PRESETS["llama3-405b"], dgx(1, 8, "H100-80GB"), 8192, 64
    leanest = min(price_plan(uniform_plan(text, model, cluster, seq), model, cluster, validate=False).peak_bytes
                  for group in grid_layouts(model, cluster, seq, gbs) for text in group)
    best, _ = run_baseline("megatron-grid", model, cluster, seq, gbs)
    assert best is not None and not best.report.fits
    assert best.report.peak_memory_gib * 2**30 == pytest.approx(leanest, rel=1e-12)


TIGHT = ("llama2-13b", 1, "A100-40GB", 4096, 64)
"""A case whose layers' fastest strategies do not fit: the fitting bound is well above the plain one."""


@pytest.mark.parametrize("case", [*CASES[:2], TIGHT], ids=[*IDS[:2], "llama2-13b-8gpu-40GB"])
@pytest.mark.parametrize(("pp", "m", "schedule"), [(1, 8, "1f1b"), (2, 8, "1f1b"), (4, 16, "1f1b"),
                                                   (2, 8, "interleaved")])
def test_configuration_bound_holds_for_every_plan_it_simulates(case: tuple, pp: int, m: int, schedule: str) -> None:
    name, nodes, gpu, seq, gbs = case
    model, cluster = PRESETS[name], dgx(nodes, 8, gpu)
    cal = calibration_for(cluster.gpu.name)
    chunks = 2 if schedule == "interleaved" else 1
    cfg = _Config(model, cluster, cal, seq, gbs, pp, m, schedule, chunks, "bf16", DEFAULT_LIMITS)
    bound = cfg.lower_bound_s()
    fitting = cfg.fitting_bound_s(cluster.gpu.memory_bytes)
    assert 0 < bound <= fitting
    if case == TIGHT:
        assert fitting > 1.1 * bound
    seen: list[float] = []

    def judge(plan, bar: float) -> Candidate:
        report = simulate(plan, model, cluster, cal=cal, validate=False)
        seen.append(report.iteration_time_s)
        return Candidate(plan, report, "layerwise")

    _partition_search(cfg, cluster.gpu.memory_bytes, judge)
    assert seen and all(fitting <= t * (1 + 1e-12) for t in seen)


def test_megatron_grid_gives_moe_models_tensor_parallelism_with_sequence_parallelism():
    """MoE layers need sp with tp > 1, so the grid's tp > 1 layouts of an MoE model all carry sp=1 (none
    without it) and exist at all."""
    layouts = [s for group in grid_layouts(PRESETS["tiny-moe"], dgx(1, 8, "A100-80GB"), 256, 64) for s in group]
    with_tp = [s for s in layouts if not s.startswith("tp=1,")]
    assert with_tp and all(",sp=1," in s for s in with_tp)
    assert any(s.startswith("tp=1,") and ",sp=0," in s for s in layouts)
