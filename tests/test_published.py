"""The cost model against published training runs (no row is special-cased in the model)."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from plait.published import load_runs, relative_errors
from plait.simulate import simulate

ROOT = Path(__file__).resolve().parents[1]
# The copy in the checkout, so that the result never depends on what sits beside it.
REFERENCE = ROOT / "tests" / "data" / "reference-training-runs.json"
COLLECTED = ROOT / "benchmarks" / "data" / "published_runs.json"

reference_runs, reference_skipped = load_runs(REFERENCE)


def test_every_reference_run_is_simulated() -> None:
    assert not reference_skipped
    assert len(reference_runs) == 6


@pytest.mark.parametrize("run", reference_runs, ids=lambda r: f"{r.model.name}-{r.cluster.world_size}gpu-"
                         f"{r.plan.pipelines[0].stages[0].strategies[0].recompute}")
def test_reference_runs_within_10_percent(run) -> None:
    report = simulate(run.plan, run.model, run.cluster)
    for key, (published, predicted, error) in relative_errors(run, report).items():
        assert abs(error) <= 0.10, f"{key}: published {published}, predicted {predicted:.4g} ({error:+.1%})"


def test_collected_megatron_runs_generalise() -> None:
    """Runs of Megatron-LM whose layout is fully published: median error <= 6%, none beyond 12%."""
    runs, _ = load_runs(COLLECTED)
    errors = []
    for run in runs:
        if not run.fully_published or "DeepSpeed" in run.source:
            continue
        report = simulate(run.plan, run.model, run.cluster)
        errors.extend(abs(e) for _, _, e in relative_errors(run, report).values())
    assert len(errors) >= 10
    assert statistics.median(errors) <= 0.06
    assert max(errors) <= 0.12


def test_all_collected_megatron_runs_mostly_within_10_percent() -> None:
    runs, skipped = load_runs(COLLECTED)
    assert all("fp8" in reason for _, reason in skipped)
    errors = [abs(e) for run in runs if "DeepSpeed" not in run.source
              for _, _, e in relative_errors(run, simulate(run.plan, run.model, run.cluster)).values()]
    assert len(errors) >= 60
    assert sum(e <= 0.10 for e in errors) >= 0.9 * len(errors)
