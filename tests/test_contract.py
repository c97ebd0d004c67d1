"""The planners' contract with the runtime (`plait.planner.contract`): every plan the search prices and the
straggler planner chooses for tiny models on 4 ranks is either refused for one of the documented reasons
below, or trains to the single-process losses (gloo, 4 ranks, one torchrun launch, fp32, 2 steps)."""

from __future__ import annotations

import pytest
from test_runtime import reference_losses, text, train_together  # noqa: F401

from plait.planner.contract import RANKS, emitted_plans, refusal_table, sample, shape_class

STEPS = 2
TOLERANCE = 1e-5
"""Largest relative difference from the single-process loss at any step."""

STILL_REFUSED: set[str] = set()
"""The refusals the emitted plans still meet (`plait.executable.unsupported`); a new one fails the test."""


@pytest.fixture(scope="module")
def plans():
    return emitted_plans()


def test_every_emitted_plan_runs_or_is_refused_for_a_documented_reason(plans) -> None:
    table = refusal_table(plans)
    assert set(table) - {None} == STILL_REFUSED, table
    assert table[None] >= 0.9 * len(plans), table  # most plans run


def test_the_sweep_holds_stages_of_different_widths(plans) -> None:
    """The straggler planner's shrunk tensor-parallel units beside whole ones give pipelines whose stages
    differ in width: 60 of the plans, in 2 shape classes of the sample (a tp2 unit and a one-rank unit,
    with and without ZeRO), all from the straggler planner."""
    uneven = [e for e in plans if not all(p.even_widths for p in e.plan.pipelines)]
    assert len(uneven) == 60 and {e.source for e in uneven} == {"straggler"}
    assert sum(shape_class(e.plan)[2] for e in sample(plans)) == 2


@pytest.fixture(scope="module")
def contract_runs(tmp_path_factory, text, plans):  # noqa: F811
    """The single-process references, then one runnable plan of every shape class in one torchrun job."""
    chosen = sample(plans)
    pairs = sorted({(e.plan.model, e.plan.global_batch) for e in chosen})
    ref = reference_losses(tmp_path_factory.mktemp("reference"), text, pairs)
    cases = {f"case {i}": (e.plan.model, e.plan) for i, e in enumerate(chosen)}
    proc, losses = train_together(tmp_path_factory.mktemp("contract"), text, RANKS, cases,
                                  {key: {"steps": STEPS} for key in cases})
    return chosen, ref, proc, losses


def test_sampled_plans_match_single_process(contract_runs) -> None:
    chosen, ref, proc, losses = contract_runs
    assert len(losses) == len(chosen), proc.stderr[-3000:]
    worst = {}
    for i, e in enumerate(chosen):
        got, want = losses[f"case {i}"], ref[(e.plan.model, e.plan.global_batch)][:STEPS]
        assert len(got) == STEPS, proc.stderr[-3000:]
        worst[i] = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    bad = {i: w for i, w in worst.items() if w > TOLERANCE}
    assert not bad, {i: (chosen[i].plan.model_dump_json(), w) for i, w in bad.items()}
    print(f"{len(chosen)} plans, worst relative loss difference {max(worst.values()):.2e}")
